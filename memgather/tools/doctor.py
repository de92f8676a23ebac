"""``memgather doctor``: what memgather would do in this environment, and why."""

from __future__ import annotations

import ast
import importlib.util
import os
import site
import sys
from typing import Dict, List, Optional

_PTH = "memgather.pth"


def main() -> int:
    """Print the report; 0 when memgather can rewire calls here, 1 otherwise."""
    lines, usable = report()
    print("\n".join(lines))
    return 0 if usable else 1


def report() -> "tuple[List[str], bool]":
    import torch
    import torch.distributed as dist

    from memgather import compat, config
    from memgather.patching import targets

    primitive = compat.single_tensor_primitive()
    lines = [f"python {sys.version.split()[0]} at {sys.executable}", f"torch {torch.__version__}"]
    lines.append(f"  distributed available: {'yes' if dist.is_available() else 'no'}")
    lines.append(f"  single-tensor all-gather: {primitive.name or 'none'} ({primitive.reason})")
    lines.append(f"  storage use count (rebind strategy): {'yes' if compat.can_prove_exclusive() else 'no'}")
    try:
        settings: Optional[config.Settings] = config.load()
    except ValueError as error:
        settings, invalid = None, error
    lines.append("backends:")
    gloo_min_bytes = settings.gloo_min_bytes if settings is not None else None
    nccl_min_bytes = settings.nccl_min_bytes if settings is not None else None
    lines.extend(
        f"  {name:<5} {'available' if _available(dist, name) else 'not available'}: {plan}"
        for name, plan in backend_plans(primitive.name, gloo_min_bytes, nccl_min_bytes).items()
    )
    lines.append(uneven_line(settings.gloo_route if settings is not None else "auto"))
    lines.append(object_line(gloo_min_bytes))
    lines.extend(helper_lines())
    lines.append("targets:")
    for target in targets.BUILTIN:
        verdict = targets.gate(target)
        state = "rewired" if verdict.allowed else "left to torch"
        source = f" (version from {verdict.source})" if verdict.source else ""
        lines.append(f"  {target.name:<17} {verdict.version or '-':<12} {state}: {verdict.reason}{source}")
    lines.extend(elision_lines(settings.elide if settings is not None else None))
    lines.append(f"environment: {settings}" if settings is not None else f"environment: INVALID: {invalid}")
    pth = find_pth()
    stale = pth_stale(pth) if pth else None
    lines.append(
        f".pth: {pth or 'not installed (MEMGATHER=1 and memgather run cannot patch new processes)'}"
        + (f": STALE, {stale}" if stale else "")
    )
    usable = dist.is_available() and primitive.function is not None and settings is not None and not stale
    lines.append(f"verdict: {'usable' if usable else 'NOT usable'}")
    return lines, usable


def backend_plans(
    primitive: Optional[str], gloo_min_bytes: Optional[int] = None, nccl_min_bytes: Optional[int] = None
) -> Dict[str, str]:
    """What memgather does with a call on each backend, on this torch (see routes.choose)."""
    from memgather import compat
    from memgather.engine import routes

    if primitive is None:
        return {
            name: "every call stays with torch (no single-tensor all-gather)" for name in ("gloo", "nccl", "mpi", "ucc")
        }
    since = ".".join(map(str, compat.GLOO_SINGLE_TENSOR_SINCE))
    threshold = _size(routes.gloo_threshold(gloo_min_bytes))
    if compat.gloo_has_single_tensor():
        gloo_async = f"async ones through {primitive} (gloo has it from torch {since})"
    else:
        gloo_async = f"async ones stay with torch (gloo has no single-tensor all-gather before torch {since})"
    return {
        "gloo": f"sync calls from {threshold} per rank (MEMGATHER_GLOO_MIN_BYTES): one broadcast per rank into "
        "the slots (a group whose ranks run on more than one host: a ring of point-to-point transfers; "
        f"MEMGATHER_GLOO_ROUTE); {gloo_async}",
        "nccl": nccl_plan(primitive, nccl_min_bytes),
        "mpi": "every call stays with torch",
        "ucc": "every call stays with torch",
    }


def uneven_line(gloo_route: str) -> str:
    """How ``memgather.gather_uneven`` moves the rows on each backend, under ``MEMGATHER_GLOO_ROUTE``."""
    ring = {"auto": "the ring where the group spans hosts", "ring": "the ring", "broadcast": "no ring"}[gloo_route]
    return (
        "uneven gathers (memgather.gather_uneven): one int64 row per rank exchanged, then each rank's rows "
        f"written once into one tensor of the summed rows, as bytes: gloo one broadcast per rank ({ring}, "
        "MEMGATHER_GLOO_ROUTE), NCCL one broadcast per rank; no padding, no world x largest temporary"
    )


def object_line(gloo_min_bytes: Optional[int]) -> str:
    """How torch's object collectives from a target are made (docs/objects.md)."""
    from memgather.engine import routes

    small = _size(routes.gloo_threshold(gloo_min_bytes))
    return (
        "object collectives from targets (all_gather_object, gather_object, broadcast_object_list): one all_reduce "
        "of every rank's pickled size, then each rank's bytes at their own size, one part at a time, read back by "
        f"torch's _unpickler from a view; all_gather_object's parts all under {small} (MEMGATHER_GLOO_MIN_BYTES): "
        "one padded gather"
    )


def helper_lines() -> List[str]:
    """The libraries' uneven-gather helpers memgather takes over, and whether the installed code is one."""
    from memgather.patching import helpers, library_helpers

    lines = ["uneven gathers of the libraries (their helpers taken over at patch(), recognised by their code):"]
    lines.extend(f"  {name}: {state}" for name, state in helpers.survey(library_helpers.HELPERS))
    return lines


def nccl_plan(primitive: str, nccl_min_bytes: Optional[int] = None) -> str:
    """What memgather does on each NCCL flavour, and which one "nccl" is here (see compat.nccl_flavour)."""
    import torch

    from memgather import compat
    from memgather.engine import routes

    setting = os.environ.get("TORCH_DIST_USE_NCCL2")
    if nccl_min_bytes is None:
        sizes = ", ".join(
            f"{_size(routes.nccl_threshold(None, world))} per rank at {world} ranks" for world in (2, 8, 64)
        )
        threshold = f"Calls under {sizes} stay with torch (MEMGATHER_NCCL_MIN_BYTES). "
    elif nccl_min_bytes == 0:
        threshold = "Calls of every size are rewired (MEMGATHER_NCCL_MIN_BYTES=0). "
    else:
        threshold = f"Calls under {_size(nccl_min_bytes)} per rank stay with torch (MEMGATHER_NCCL_MIN_BYTES). "
    default = compat.default_nccl_flavour(torch.__version__, setting)
    if compat.can_prove_exclusive():
        fresh = f"fresh slots ({cuda_slots()}) are released and rebound to one buffer that {primitive} fills"
        cat = ", and an elided cat too"
    else:
        fresh = "fresh slots stay with torch (this torch has no storage use count to prove a rebind safe)"
        cat = ""
    shown = "unset" if setting is None else repr(setting)
    return (
        f'"nccl" is the {default} group here (torch {torch.__version__}, TORCH_DIST_USE_NCCL2 {shown}). '
        f"{threshold}"
        f"Legacy ProcessGroupNCCL: {fresh}, slots that already are views of one buffer (DeepSpeed "
        f"ZeRO's) are filled where they lie: the gathered-size temporary of torch's list call is saved"
        f"{cat}. ProcessGroupNCCL2 (no temporary of its own): calls whose cat is elided take "
        f"{primitive} on every rank (a rank whose slots cannot be rebound stages through a temporary), "
        f"every other call stays with torch"
    )


def cuda_slots() -> str:
    """Which CUDA slots may be rebound in this process, told from its allocator backend."""
    import torch

    from memgather.engine import cuda_memory

    if not torch.cuda.is_available():
        rule = "no CUDA device here"
    else:
        backend = cuda_memory.allocator_backend()
        if backend in cuda_memory.STREAM_ORDERED:
            rule = f"allocator {backend}: rebindable"
        else:
            rule = f"allocator {backend}: none is rebound, its frees are not stream-ordered"
    return (
        f"made by torch's allocator, never written since (e.g. empty_like / zeros_like / clone), not lent "
        f"through __cuda_array_interface__, none while a captured CUDA graph lives; {rule}"
    )


def elision_lines(elide: Optional[bool]) -> List[str]:
    """Where cat elision is on: the setting, then every all_gather call site of each installed
    target (found by reading its files, never importing it) with the proof's verdict."""
    from memgather import cow
    from memgather.patching import callsites, targets

    if elide is None:
        lines = [
            "cat elision (MEMGATHER_ELIDE unset): at call sites whose code is proven to hand the list to one cat "
            "first; on the CPU it may be used again after it, or returned (proven: copy-on-write), on CUDA it "
            "must be dropped after the cat"
        ]
    else:
        where = "on for every rewired call" if elide else "off everywhere"
        lines = [f"cat elision: {where} (MEMGATHER_ELIDE={int(elide)}); what the proof says of each call site"]
    if cow.works():
        lines.append(
            "  the cat's result on the CPU: a copy-on-write snapshot of the buffer (torch._lazy_clone, probed at "
            "import): no later use of the slots or the result can tell it from torch.cat's copy"
        )
        if not cow.grows():
            lines.append(
                "  but this torch cannot resize a copy-on-write storage before its first write: resizing an elided "
                "result's storage (or a slot's) before anything wrote it fails torch's own assertion "
                "(ctx != nullptr) at its next write or pointer read"
            )
    else:
        lines.append(f"  the cat's result: the buffer itself, the slots watched until first used ({cow.why_not()})")
    # torch's own all-gathering Function, whose forward hands its slots to the code that applies it.
    function, _ = callsites.of_package("torch.distributed.nn.functional")
    packages = [("torch.distributed.nn", function)]
    for top in dict.fromkeys(prefix.split(".")[0] for target in targets.BUILTIN for prefix in target.prefixes):
        found, note = callsites.of_package(top)
        if not note:
            packages.append((top, found))
    for top, found in packages:
        elided = sum(call_site.verdict.proven for call_site in found)
        lines.append(
            f"  {top}: {len(found)} call site{'s' if len(found) != 1 else ''} of torch's all_gather, {elided} proven"
        )
        for call_site in found:
            state = "not proven"
            if call_site.verdict.proven:
                state = "proven (copy-on-write)" if call_site.verdict.needs_cow else "proven"
            lines.append(f"    {call_site.name} ({call_site.role}): {state}: {call_site.verdict.reason}")
    return lines


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes and nbytes % (1 << 20) == 0 else f"{nbytes} bytes"


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


def pth_stale(path: str) -> Optional[str]:
    """Why the .pth at ``path`` cannot switch this memgather on, or None where it can or no
    reason is seen.

    A copy made at install time: after an upgrade without reinstalling (a
    checkout installed with ``pip install -e``), it may name a module this
    memgather no longer has, and Python then skips it with one line on stderr.
    Read as ``site`` reads it: only lines starting with ``import`` run.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None  # site would say so at start-up; nothing here to add
    missing = [
        name
        for line in lines
        if line.startswith(("import ", "import\t"))
        for name in _modules_named(line)
        if name.startswith("memgather") and not _importable(name)
    ]
    if missing:
        return (
            f"it imports {', '.join(missing)}, which this memgather has not: reinstall memgather "
            "(pip install -e . in a checkout)"
        )
    return None


def _modules_named(line: str) -> List[str]:
    """Modules a .pth line imports: ``import x.y`` statements and ``__import__("x.y")`` calls."""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return []
    names: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.append(node.args[0].value)
    return names


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _available(dist: object, name: str) -> bool:
    check = getattr(dist, f"is_{name}_available", None)
    return bool(check and check())
