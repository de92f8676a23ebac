"""Threads: gathers on several process groups at once, the opt-out confined to its thread,
and patch()/unpatch() racing with gathers; and torch.compile of a target's gather."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import EAGER, unwrap
from tests.ranks import compiled_gather, patch_races_gathers, threads_on_own_groups


def test_four_threads_on_their_own_groups_opt_out_in_two(pools: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(threads_on_own_groups, 4, 25, timeout_s=180)):
        assert result["errors"] == []
        # Threads 1 and 3 opted out: their 50 calls went to torch untouched (not even counted);
        # threads 0 and 2 were rewired, all 50 calls.
        assert result["rewired"] == result["calls"] == 50


def test_patch_unpatch_racing_with_gathers(pools: Any) -> None:
    # One rank: whether a call is rewired depends on the race, and ranks must agree on it.
    for result in unwrap(pools(1, **EAGER).run(patch_races_gathers, 100, timeout_s=180)):
        assert result["problems"] == []
        assert result["consistent"] and result["original_restored"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_of_a_target_function(pools: Any, backend: str) -> None:
    """Compiled, a target's dist.all_gather is left to torch (Dynamo maps it itself): correct, not rewired."""
    for result in unwrap(pools(2).run(compiled_gather, backend, timeout_s=300)):
        assert result == {"correct": True, "rewired": 0}
