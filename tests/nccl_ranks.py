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
import shutil
import sys
import tempfile
import textwrap
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from benchmarks import processes

WORLD = 2

_PRELUDE = """
import json, os, sys, tempfile, warnings
warnings.simplefilter("ignore")
RANK, WORLD, STORE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
import torch, torch.distributed as dist
import memgather  # before CUDA is first used, as memgather asks: else it counts a CUDA graph alive
if BACKEND != "gloo":  # (gloo: the launcher itself, on any machine)
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


def run(script: str, backend: str = "nccl", env: Optional[Dict[str, str]] = None,
        timeout_s: float = 240) -> List[Any]:
    """``script`` (dedented) on ``WORLD`` ranks sharing GPU 0; each rank's last JSON line, in rank order.

    Skips without CUDA and NCCL where ``backend`` is NCCL's (``gloo`` runs on any machine). A rank
    that fails is reported at once with every rank's output (``benchmarks.processes``).
    """
    if backend != "gloo" and not available():
        pytest.skip("needs a CUDA device and NCCL (benchmarks/gpu_check.py runs these on a GPU)")
    body = _PRELUDE.replace("BACKEND", repr(backend)) + textwrap.dedent(script) + _EPILOGUE
    store = tempfile.mkdtemp(prefix="memgather-nccl-")
    try:
        base = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "OFF", **(env or {})}
        commands = [[sys.executable, "-c", body, str(rank), str(WORLD), os.path.join(store, "store")]
                    for rank in range(WORLD)]
        envs = [{**base, "NCCL_HOSTID": f"memgather-rank-{rank}"} for rank in range(WORLD)]
        ends = processes.run(commands, envs, timeout_s)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    if any("Duplicate GPU" in end.stderr for end in ends):
        pytest.skip("NCCL refused two ranks on one GPU")
    failed = [(rank, end) for rank, end in enumerate(ends) if end.returncode != 0]
    assert not failed, "\n---\n".join(
        f"rank {rank}: {'killed (timeout, or after another rank failed)' if end.returncode is None else end.returncode}"
        f"\n{end.stderr[-3000:]}" for rank, end in failed)
    return [json.loads(end.stdout.strip().splitlines()[-1]) for end in ends]
