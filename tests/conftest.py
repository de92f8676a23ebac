from __future__ import annotations

from typing import Dict, Iterator

import pytest

from tests.pool import RankError, RankPool


class Pools:
    """One RankPool per world size, started on first use and kept for the session."""

    def __init__(self) -> None:
        self._pools: Dict[int, RankPool] = {}

    def __call__(self, world: int) -> RankPool:
        if world not in self._pools or self._pools[world].closed:
            self._pools[world] = RankPool(world)
        return self._pools[world]

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
