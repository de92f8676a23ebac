"""Two NCCL ranks on the one GPU a test machine has, each in a fresh interpreter.

A world of 1 does not exercise memgather's CUDA path: its one slot is the whole output, so
every call takes the direct route and no slot is released or rebound. Two processes on the
same device can form a world of 2 when each names a different ``NCCL_HOSTID``: NCCL then
takes them for two hosts and connects them through its network transport. The calls, the
caching allocator and the slots' memory are those of a real two-rank job; only the link
differs, so these runs check values and memory, never time.

``run(script)`` runs ``script`` on both ranks; in it ``RANK`` and ``WORLD`` are set and the
default group is initialised (``BACKEND``, through a file store). Each rank prints one JSON
line last; ``run`` returns them in rank order, or skips where NCCL refuses the pair.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

WORLD = 2

_PRELUDE = """
import json, os, sys, tempfile, warnings
warnings.simplefilter("ignore")
RANK, WORLD, STORE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
import torch, torch.distributed as dist
import memgather  # before CUDA is first used, as memgather asks: else it counts a CUDA graph alive
if torch.cuda.is_available():  # (a CPU machine runs the launcher itself on gloo)
    torch.cuda.set_device(0)
dist.init_process_group(BACKEND, init_method="file://" + STORE, rank=RANK, world_size=WORLD)
"""

_EPILOGUE = """
dist.barrier()
dist.destroy_process_group()
"""


def available() -> bool:
    """Whether this machine has a CUDA device and NCCL."""
    return torch.cuda.is_available() and dist.is_nccl_available()


def run(script: str, backend: str = "nccl", env: Optional[Dict[str, str]] = None, timeout_s: float = 240) -> List[Any]:
    """``script`` (dedented) on ``WORLD`` ranks sharing GPU 0; each rank's last JSON line, in rank order."""
    if not available():
        pytest.skip("needs a CUDA device and NCCL (benchmarks/gpu_check.py runs these on a GPU)")
    body = _PRELUDE.replace("BACKEND", repr(backend)) + textwrap.dedent(script) + _EPILOGUE
    store = os.path.join(tempfile.mkdtemp(prefix="memgather-nccl-"), "store")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", body, str(rank), str(WORLD), store],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "TORCH_DISTRIBUTED_DEBUG": "OFF",
                "NCCL_HOSTID": f"memgather-rank-{rank}",
                **(env or {}),
            },
        )
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + timeout_s
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    errors = [err for code, _, err in outputs if code != 0]
    if any("Duplicate GPU" in err for err in errors):
        pytest.skip("NCCL refused two ranks on one GPU")
    assert not errors, "\n---\n".join(err[-3000:] for err in errors)
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in outputs]
