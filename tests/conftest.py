from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, Optional, Tuple

import pytest

from tests.pool import RankError, RankPool

# Rewire gloo calls of every size (memgather leaves those under 2 MiB per rank to
# torch by default): how tests reach the rewired paths with small tensors.
EAGER = {"MEMGATHER_GLOO_MIN_BYTES": "0"}


class Pools:
    """One RankPool per world size and environment, started on first use and kept for the session."""

    def __init__(self) -> None:
        self._pools: Dict[Tuple[int, FrozenSet[Tuple[str, str]]], RankPool] = {}

    def __call__(self, world: int, **env: str) -> RankPool:
        key = (world, frozenset(env.items()))
        if key not in self._pools or self._pools[key].closed:
            self._pools[key] = RankPool(world, env=env)
        return self._pools[key]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    holder = Pools()
    yield holder
    holder.close()


def unwrap(results: list) -> list:
    """Fail the test with the rank's traceback if any rank raised."""
    for rank, result in enumerate(results):
        if isinstance(result, RankError):
            pytest.fail(f"rank {rank} raised {result.type_name}: {result.message}\n{result.traceback}")
    return results


ROOT = Path(__file__).resolve().parent.parent

# A process that is a world of 2 on torch's no-op fake backend, memgather imported, and
# ``user``: a namespace whose code counts as the module ``user_code`` (name it as a target).
# Its ``call(per_rank)`` gathers per_rank bytes of float32 into fresh slots. memgather has no
# route for a backend that moves nothing; the process gives the fake backend legacy NCCL's
# (benchmarks/overhead.py), so that its calls reach memgather's paths as a small or a
# rewired NCCL call does.
_FAKE_PRELUDE = f"""
import sys
sys.path.append({str(ROOT)!r})  # for benchmarks.overhead
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
import memgather
from memgather.engine import core
from benchmarks.overhead import treat_fake_as_legacy_nccl
treat_fake_as_legacy_nccl()
exec(compile('import torch, torch.distributed as dist\\n'
             'def call(per_rank):\\n'
             '    t = torch.ones(per_rank // 4)\\n'
             '    slots = [torch.empty_like(t), torch.empty_like(t)]\\n'
             '    dist.all_gather(slots, t)\\n'
             '    return slots\\n', '<user>', 'exec'), user := {{'__name__': 'user_code'}})
"""


def run_on_fake(body: str, env: Optional[Dict[str, str]] = None) -> str:
    """``body`` (dedented) run after ``_FAKE_PRELUDE`` in a fresh interpreter; its standard output."""
    # torch cannot wrap the fake backend for TORCH_DISTRIBUTED_DEBUG=DETAIL (its checks need a real
    # store), and a world of one process has no other rank to check against.
    done = subprocess.run([sys.executable, "-c", _FAKE_PRELUDE + textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TORCH_DISTRIBUTED_DEBUG": "OFF", **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout


def forget_verdicts() -> None:
    """Drop every version verdict memgather cached, and the installed metadata it read: for tests
    that install and remove releases in the middle of a run (the library reads them once)."""
    from memgather.patching import releases, targets

    targets._gate.cache_clear()
    releases._shipped_by.cache_clear()
