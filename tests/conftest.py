from __future__ import annotations

from typing import Dict, FrozenSet, Iterator, Tuple

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
