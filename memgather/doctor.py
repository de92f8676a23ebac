"""``memgather doctor``: what memgather would do in this environment, and why."""

from __future__ import annotations

import os
import site
import sys
from typing import List, Optional

_PTH = "memgather.pth"


def main() -> int:
    """Print the report; 0 when memgather can rewire calls here, 1 otherwise."""
    lines, usable = report()
    print("\n".join(lines))
    return 0 if usable else 1


def report() -> "tuple[List[str], bool]":
    import torch
    import torch.distributed as dist

    from memgather import compat, config, targets

    primitive = compat.single_tensor_primitive()
    lines = [f"python {sys.version.split()[0]} at {sys.executable}", f"torch {torch.__version__}"]
    lines.append(f"  distributed available: {'yes' if dist.is_available() else 'no'}")
    lines.append(f"  single-tensor all-gather: {primitive.name or 'none'} ({primitive.reason})")
    since = ".".join(map(str, compat.GLOO_SINGLE_TENSOR_SINCE))
    if compat.gloo_has_single_tensor():
        lines.append(f"  on gloo: yes (torch >= {since}); sync calls use per-rank broadcasts from 2 MiB per rank")
    else:
        lines.append(f"  on gloo: no (before torch {since}); sync calls use per-rank broadcasts, async ones stay with torch")
    lines.append(f"  storage use count (rebind strategy): {'yes' if compat.can_prove_exclusive() else 'no'}")
    lines.append("backends: " + ", ".join(f"{name} {'yes' if _available(dist, name) else 'no'}"
                                          for name in ("gloo", "nccl", "mpi", "ucc")))
    lines.append("targets:")
    for target in targets.BUILTIN:
        verdict = targets.gate(target)
        state = "rewired" if verdict.allowed else "left to torch"
        lines.append(f"  {target.name:<13} {verdict.version or '-':<12} {state}: {verdict.reason}")
    try:
        settings = config.load()
        lines.append(f"environment: {settings}")
    except ValueError as error:
        lines.append(f"environment: INVALID: {error}")
        settings = None
    pth = find_pth()
    lines.append(f".pth: {pth or 'not installed (MEMGATHER=1 and memgather run cannot patch new processes)'}")
    usable = dist.is_available() and primitive.function is not None and settings is not None
    lines.append(f"verdict: {'usable' if usable else 'NOT usable'}")
    return lines, usable


def find_pth() -> Optional[str]:
    """Path of memgather.pth in a site directory this interpreter processes."""
    directories = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        directories.append(site.getusersitepackages())
    for directory in directories:
        path = os.path.join(directory, _PTH)
        if os.path.isfile(path):
            return path
    return None


def _available(dist: object, name: str) -> bool:
    check = getattr(dist, f"is_{name}_available", None)
    return bool(check and check())
