"""Verify mode: every rewired call checked against the original, on real gloo ranks."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

import memgather
from memgather.engine import verification
from tests.conftest import EAGER, unwrap
from tests.ranks import filled
from tests.test_entry_points import PYTHON, _run

EXPECTED_STRATEGY = {
    "broadcast_in_slots": "in_slots",
    "broadcast_rebind_elided": "rebind",
    "broadcast_direct": "direct",
    "single_rebind_async": "rebind",
    "single_direct_async": "direct",
}


def test_expected_strategies_cover_every_case() -> None:
    assert set(EXPECTED_STRATEGY) == set(VERIFY_CASES)


@pytest.mark.parametrize("world", [2, 3])
def test_every_strategy_is_verified_and_passes(pools: Any, world: int) -> None:
    for result in unwrap(pools(world, **EAGER).run(verified_calls, (4, 3))):
        for name, strategy in EXPECTED_STRATEGY.items():
            assert result[name] == {"correct": True, "strategy": {strategy: 1}, "verified": 1}, name


@pytest.mark.parametrize("async_op", [False, True], ids=["broadcast", "single-async"])
@pytest.mark.parametrize("corrupt_rank", [0, 1])
def test_a_wrong_element_raises_on_every_rank(pools: Any, async_op: bool, corrupt_rank: int) -> None:
    results = unwrap(pools(3, **EAGER).run(verify_catches, (2, 4), async_op, corrupt_rank))
    for result in results:
        assert result["raised"], result
        # Element 5 of slot 1 is (1, 1) in a (2, 4) input, seen by the corrupted rank only.
        assert (result["rank"], result["index"], result["seen_by"]) == (1, [1, 1], corrupt_rank)
        assert result["shape"] == [2, 4] and result["dtype"] == "torch.float32"
        assert "tests.test_verify.verify_catches (" in result["message"] and "test_verify.py:" in result["message"]
        assert "slot 1 differs from the original all_gather at index (1, 1)" in result["message"]


def test_first_difference_compares_bytes() -> None:
    nan = torch.tensor([1.0, float("nan"), 0.0])
    assert verification.first_difference([nan.clone()], [nan.clone()]) is None  # the same NaN is equal
    assert verification.first_difference([nan.clone()], [torch.tensor([1.0, float("nan"), -0.0])]) == (0, 2)
    a, b = torch.arange(12).reshape(3, 4), torch.arange(12).reshape(3, 4)
    b[2, 1] = 0
    assert verification.first_difference([a, a.clone()], [a, b]) == (1, 9)
    assert verification.first_difference([torch.empty(0)], [torch.empty(0)]) is None
    complex_pair = torch.tensor([1 + 2j]), torch.tensor([1 + 3j])
    assert verification.first_difference([complex_pair[0]], [complex_pair[1]]) == (0, 0)


def test_pytest_option_verifies_an_unedited_suite(tmp_path: Path) -> None:
    (tmp_path / "legacy_sync.py").write_text(textwrap.dedent(
        """
        import torch, torch.distributed as dist

        def concat_all_gather(t):
            slots = [torch.ones_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(slots, t)
            return torch.cat(slots)
        """
    ))
    (tmp_path / "test_legacy.py").write_text(textwrap.dedent(
        """
        import os, socket
        import torch, torch.distributed as dist
        import memgather
        import legacy_sync

        def test_gather_in_a_world_of_one():
            sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
            try:
                t = torch.arange(6.0)
                assert torch.equal(legacy_sync.concat_all_gather(t), t)
                assert memgather.stats().verified == 1 and os.environ["MEMGATHER_VERIFY"] == "1"
            finally:
                dist.destroy_process_group()
        """
    ))
    done = _run([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "--memgather", "--memgather-targets", "legacy_sync",
                 "--memgather-verify", str(tmp_path / "test_legacy.py")], cwd=tmp_path,
                env={"MEMGATHER_GLOO_MIN_BYTES": "0", "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


# Run on every rank of a pool (tests/pool.py): each takes the rank's context first and
# returns plain data for the test above to assert on.


VERIFY_CASES = {
    # name: (slots builder, async_op, elide) -- each reaches one strategy and route
    "broadcast_in_slots": (lambda w, r, t: [torch.zeros_like(t) for _ in range(w)], False, False),
    "broadcast_rebind_elided": (lambda w, r, t: [torch.zeros_like(t) for _ in range(w)], False, True),
    "broadcast_direct": (lambda w, r, t: list(torch.zeros((w, *t.shape)).unbind(0)), False, False),
    "single_rebind_async": (lambda w, r, t: [torch.zeros_like(t) for _ in range(w)], True, False),
    "single_direct_async": (lambda w, r, t: list(torch.zeros((w, *t.shape)).unbind(0)), True, False),
}


def verified_calls(ctx: Any, shape: Tuple[int, ...]) -> Dict[str, Any]:
    """Every case under verify mode: results, strategy and the verified count."""
    out = {}
    for name, (build, async_op, elide) in VERIFY_CASES.items():
        given = filled(ctx.rank, shape)
        slots = build(ctx.world, ctx.rank, given)
        memgather.reset_stats()
        work = memgather.all_gather(slots, given, async_op=async_op, elide=elide, verify=True)
        if work is not None:
            work.wait()
        stats = memgather.stats()
        joined = torch.cat(slots)  # elided where armed: the gathered buffer itself
        want = torch.cat([filled(r, shape) for r in range(ctx.world)])
        out[name] = {"correct": torch.equal(joined, want), "strategy": dict(stats.by_strategy),
                     "verified": stats.verified}
    return out


def verify_catches(ctx: Any, shape: Tuple[int, ...], async_op: bool, corrupt_rank: int) -> Dict[str, Any]:
    """A route made to write one wrong element on ``corrupt_rank``: verify mode must
    raise VerifyError on every rank. Fault injection: the real route runs first."""
    from memgather.engine import routes

    real_run, real_broadcast = routes.run, routes.broadcast_into

    def corrupt(flat_or_slots: Any) -> None:
        if ctx.rank == corrupt_rank:
            target = flat_or_slots[1] if isinstance(flat_or_slots, list) else flat_or_slots.view(ctx.world, -1)[1]
            target.view(-1)[5] += 1

    def run(route: Any, flat: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = real_run(route, flat, *args, **kwargs)
        if work is not None:
            work.wait()
        corrupt(flat)
        return work

    def broadcast_into(destinations: List[torch.Tensor], *args: Any) -> None:
        real_broadcast(destinations, *args)
        corrupt(destinations)

    routes.run, routes.broadcast_into = run, broadcast_into
    try:
        given = filled(ctx.rank, shape)
        slots = [torch.zeros_like(given) for _ in range(ctx.world)]
        try:
            work = memgather.all_gather(slots, given, async_op=async_op, verify=True)
        except memgather.VerifyError as error:
            return {"raised": True, "message": str(error), "rank": error.rank, "index": list(error.index),
                    "seen_by": error.seen_by, "shape": list(error.shape), "dtype": str(error.dtype)}
        if work is not None:
            work.wait()
        return {"raised": False}
    finally:
        routes.run, routes.broadcast_into = real_run, real_broadcast
