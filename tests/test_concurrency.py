"""Threads: gathers on several process groups at once, the opt-out confined to its thread,
and patch()/unpatch() racing with gathers; and torch.compile of a target's gather."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import memgather
from tests.conftest import EAGER, unwrap
from tests.ranks import filled


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


# Run on every rank of a pool (tests/pool.py): each takes the rank's context first and
# returns plain data for the test above to assert on.


def threads_on_own_groups(ctx: Any, threads: int, calls: int) -> Dict[str, Any]:
    """``threads`` threads gather at once, each on its own process group; odd ones inside disabled()."""
    import threading

    from tests.sites import target_caller

    groups = [dist.new_group(list(range(ctx.world))) for _ in range(threads)]  # same order on every rank
    memgather.patch(["tests.sites.target_caller"])
    memgather.reset_stats()
    errors: List[str] = []
    barrier = threading.Barrier(threads)

    def work(index: int) -> None:
        try:
            barrier.wait(30)
            for call in range(calls):
                t = filled(ctx.rank + 10 * index + call, (64,))
                if index % 2:
                    with memgather.disabled():
                        slots = target_caller.gather_on(t, groups[index])
                else:
                    slots = target_caller.gather_on(t, groups[index])
                if not all(torch.equal(s, filled(r + 10 * index + call, (64,))) for r, s in enumerate(slots)):
                    errors.append(f"thread {index} call {call}: wrong data")
        except Exception as error:  # noqa: BLE001
            errors.append(f"thread {index}: {type(error).__name__}: {error}")

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    memgather.unpatch()
    snapshot = memgather.stats()
    return {"errors": errors, "rewired": snapshot.rewired, "calls": snapshot.calls}


def patch_races_gathers(ctx: Any, calls: int) -> Dict[str, Any]:
    """One thread patches and unpatches in a loop while this one gathers from a target."""
    import threading

    from tests.sites import target_caller

    stop = threading.Event()
    problems: List[str] = []

    def churn() -> None:
        while not stop.is_set():
            try:
                memgather.patch(["tests.sites.target_caller"])
                memgather.unpatch()
            except Exception as error:  # noqa: BLE001
                problems.append(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for call in range(calls):
            slots = target_caller.gather(filled(ctx.rank + call, (64,)))
            if not torch.equal(slots[0], filled(call, (64,))):
                problems.append(f"call {call}: wrong data")
    finally:
        stop.set()
        thread.join(30)
    memgather.unpatch()
    consistent = dist.all_gather is dist.distributed_c10d.all_gather and not memgather.is_patched()
    return {"problems": problems, "consistent": consistent,
            "original_restored": dist.all_gather is memgather.engine.core.original_all_gather()}


def compiled_gather(ctx: Any, backend: str) -> Dict[str, Any]:
    """torch.compile of a target module's function that calls dist.all_gather, memgather patched."""
    from tests.sites import target_caller

    torch._dynamo.reset()
    t = filled(ctx.rank, (1 << 19,))  # 2 MiB: rewired when not compiled
    memgather.patch(["tests.sites.target_caller"])
    try:
        memgather.reset_stats()
        compiled = torch.compile(target_caller.gather, backend=backend)
        got = compiled(t)
        snapshot = memgather.stats()
    finally:
        memgather.unpatch()
    want = [filled(r, (1 << 19,)) for r in range(ctx.world)]
    return {"correct": all(torch.equal(a, b) for a, b in zip(got, want)), "rewired": snapshot.rewired}
