"""What ranks see of one another's choices, and what a program sees of memgather's own work:
version counters of slots that share one, ranks that make the call differently (async_op on
one rank only), a dispatch mode watching, and the exit report's rank after a new default group.
Each on real gloo ranks, compared with torch alone in the same processes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from typing import Any, Dict, List

import pytest
import torch

from memgather import compat
from tests.conftest import EAGER, unwrap
from tests.jobs import environment

BIG = 655360  # float32 elements: 2.5 MiB per rank, gloo's broadcast route


def views_versions(ctx: Any, numel: int, async_op: bool) -> Dict[str, Any]:
    """Slots that are views of one buffer share its version counter: torch's list call bumps it
    once per slot. memgather's direct route must leave it where torch does."""
    import torch.distributed as dist

    import memgather

    def run(gather: Any) -> List[Any]:
        flat = torch.zeros(ctx.world * numel)
        flat.add_(0)  # a version of its own before the call
        slots = list(flat.view(ctx.world, numel).unbind(0))
        work = gather(slots, torch.full((numel,), float(ctx.rank)), async_op=async_op)
        if work is not None:
            work.wait()
        return [flat._version] + [s._version for s in slots] + [flat.view(ctx.world, numel)[:, 0].tolist()]

    want = run(dist.all_gather)
    memgather.reset_stats()
    got = run(memgather.all_gather)
    return {"torch": want, "memgather": got, "rewired": memgather.stats().rewired}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("numel,async_op", [(BIG, False), (BIG, True), (5, False)], ids=["broadcast", "single", "small"])
def test_shared_version_counters_move_as_under_torch(pools: Any, world: int, numel: int, async_op: bool) -> None:
    for result in unwrap(pools(world, **EAGER).run(views_versions, numel, async_op)):
        if result["memgather"] != result["torch"] and not compat.can_set_version():
            pytest.xfail(f"torch {torch.__version__} cannot set a version counter back: memgather's own set_ and "
                         f"copies leave it ahead of torch's (docs/torch-releases.md): {result}")
        assert result["memgather"] == result["torch"], result
        assert result["torch"][0] == 1 + world  # one bump per slot on the shared counter
        # An async call has no route where gloo has no single-tensor call (torch < 2.2): torch's, then.
        assert result["rewired"] == (0 if async_op and not compat.gloo_has_single_tensor() else 1)


def async_on_rank_zero(ctx: Any, check: bool) -> Dict[str, Any]:
    """Rank 0 calls with async_op=True, the others without; with check on every rank agrees first,
    and ranks that would take two wire protocols (the single call, the broadcasts) all take torch's."""
    import torch.distributed as dist

    import memgather

    slots = [torch.empty(BIG) for _ in range(ctx.world)]
    memgather.reset_stats()
    work = memgather.all_gather(slots, torch.full((BIG,), float(ctx.rank)), async_op=ctx.rank == 0, check=check)
    if work is not None:
        work.wait()
    correct = all(torch.equal(s, torch.full((BIG,), float(r))) for r, s in enumerate(slots))
    dist.barrier()
    return {"correct": correct, "fallbacks": dict(memgather.stats().fallbacks)}


def test_async_on_one_rank_with_check_falls_back_on_every_rank(pools: Any) -> None:
    for rank, result in enumerate(unwrap(pools(2).run(async_on_rank_zero, True))):
        # Where gloo has no single-tensor call (torch < 2.2), rank 0's async call has no route of its
        # own: it falls back for that reason, and tells the other rank, which falls back for it.
        own = "backend" if rank == 0 and not compat.gloo_has_single_tensor() else "peer_fallback"
        assert result == {"correct": True, "fallbacks": {own: 1}}, result


def under_a_keeping_mode(ctx: Any, watched: List[int]) -> Dict[str, Any]:
    """A TorchDispatchMode that keeps every tensor it sees, on the ranks in ``watched``: memgather steps
    aside on every rank (a mode would see memgather's own operations, and hold memgather's tensors so
    that each wait ran to its bound); the exchange that tells the others runs outside the mode."""
    import time

    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import memgather

    class Keeper(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.kept: List[Any] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            self.kept.append((args, out))
            return out

    def run(gather: Any) -> Any:
        slots = [torch.empty(BIG) for _ in range(ctx.world)]
        keeper = Keeper()
        with keeper if ctx.rank in watched else contextlib.nullcontext():
            started = time.perf_counter()
            gather(slots, torch.full((BIG,), float(ctx.rank)))
            took = time.perf_counter() - started
        return [s[0].item() for s in slots], took, len(keeper.kept)

    want, _, seen_under_torch = run(dist.all_gather)
    memgather.reset_stats()
    got, took, seen = run(memgather.all_gather)
    return {"same": got == want, "fallbacks": dict(memgather.stats().fallbacks), "under_a_second": took < 1.0,
            "mode_saw_what_it_sees_under_torch": seen == seen_under_torch}


@pytest.mark.parametrize("watched", [[0, 1], [0]], ids=["every-rank", "rank-0-only"])
def test_a_dispatch_mode_leaves_the_call_to_torch_on_every_rank(pools: Any, watched: List[int]) -> None:
    for rank, result in enumerate(unwrap(pools(2).run(under_a_keeping_mode, watched))):
        reason = "dispatch_mode" if rank in watched else "peer_fallback"
        assert result == {"same": True, "fallbacks": {reason: 1}, "under_a_second": True,
                          "mode_saw_what_it_sees_under_torch": True}, (rank, result)


def small_call_under_a_mode_on_rank_zero(ctx: Any) -> Dict[str, Any]:
    """A call under the threshold whose input a Parameter (the wrapper's shortcut takes plain tensors
    only, so it reaches the planner every time), under a TorchDispatchMode on rank 0 only: no rank
    takes a route, so none may wait in an agreement round for the others."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import memgather

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    memgather.reset_stats()
    got = []
    for _ in range(2):
        slots = [torch.zeros(4) for _ in range(ctx.world)]
        given = torch.nn.Parameter(torch.full((4,), float(ctx.rank + 1)))
        with Watching() if ctx.rank == 0 else contextlib.nullcontext():
            memgather.all_gather(slots, given)
        got.append([s[0].item() for s in slots])
    return {"values": got, "fallbacks": dict(memgather.stats().fallbacks)}


def test_a_small_call_under_a_mode_on_one_rank_needs_no_agreement(pools: Any) -> None:
    results = unwrap(pools(2).run(small_call_under_a_mode_on_rank_zero, timeout_s=30))
    assert results[0] == {"values": [[1.0, 2.0]] * 2, "fallbacks": {"dispatch_mode": 2}}, results[0]
    assert results[1] == {"values": [[1.0, 2.0]] * 2, "fallbacks": {"below_threshold": 2}}, results[1]


def test_the_exit_report_names_the_rank_of_the_default_group_at_exit(tmp_path: Any) -> None:
    """A world of 2, destroyed; a new world of 2 in which the ranks swap and only a subgroup
    gathers: the report names each process's rank in the new default group."""
    script = tmp_path / "swap.py"
    script.write_text(textwrap.dedent(
        """
        import os, sys, torch, torch.distributed as dist
        import memgather
        first = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=first, world_size=2)
        memgather.all_gather([torch.empty(3) for _ in range(2)], torch.ones(3))
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=1 - first, world_size=2)
        sub = dist.new_group([0, 1])
        memgather.all_gather([torch.empty(3) for _ in range(2)], torch.ones(3), group=sub)
        dist.barrier()
        """
    ))
    from tests.pool import free_port

    ports = [str(free_port()), str(free_port())]
    env = environment(MEMGATHER="1", MEMGATHER_REPORT="all")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), *ports], stderr=subprocess.PIPE, text=True,
                              env=env) for rank in range(2)]
    reports = []
    try:
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            reports.append([line.split("]")[0] for line in err.splitlines() if line.startswith("[memgather rank")])
    finally:
        for proc in procs:  # a rank stuck in its rendezvous must not outlive the test (it spun a core)
            proc.kill()
            proc.wait()
    assert reports == [["[memgather rank 1"], ["[memgather rank 0"]], reports
