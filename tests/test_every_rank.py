"""A route every rank must take (ProcessGroupNCCL2's elided calls): no rank may fall back alone.

On ProcessGroupNCCL2 torch's list all_gather (one ncclBroadcast per rank) and the
single-tensor call (ncclAllGather) never meet, so a rank whose slots cannot be
rebound stages through a temporary with the same single call (``Strategy.STAGED``).
What decides it is device-independent, so it runs here on gloo standing in for
the transport: the rank processes route gloo's calls as ProcessGroupNCCL2's
(``routes.elided_route`` for elided calls, torch's list call for the rest). Gloo
lets the two kinds of call meet on the wire, so a split would pass unseen; the
ranks run under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, whose check of every rank's
collectives tells them apart and raises, and ``test_a_split_is_caught`` shows
that it does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memgather.engine import strategies
from memgather.engine.strategies import Reason, Strategy
from tests.conftest import EAGER, unwrap
from tests.pool import RankError

DETAIL = {"POOL": "detail", "TORCH_DISTRIBUTED_DEBUG": "DETAIL", **EAGER}


@contextlib.contextmanager
def gloo_as_nccl2(stage_refusals: bool = True) -> Iterator[None]:
    """In a rank process: gloo's calls routed as ProcessGroupNCCL2's, for the block."""
    from memgather.engine import core, planner, routes

    saved = routes.elided_route, routes.choose, routes.single_route, strategies.stage
    routes.elided_route = lambda backend, device, flavour=None: routes.SINGLE_EVERY_RANK  # type: ignore[assignment]
    routes.choose = lambda *args, **kwargs: None  # type: ignore[assignment]  # kept lists: torch's call
    routes.single_route = lambda *args, **kwargs: None  # type: ignore[assignment]
    if not stage_refusals:
        planner.stage = lambda refused, tensor_list, tensor: refused
    planner.configure(core.settings())  # forget what was worked out for the group
    try:
        yield
    finally:
        routes.elided_route, routes.choose, routes.single_route, planner.stage = saved
        planner.configure(core.settings())


class _Seen(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _slots(case: str, n: int) -> List[torch.Tensor]:
    """Two slots of shape (n, 3) as ``case`` builds them."""
    if case in ("fresh", "dispatch_mode", "function_mode", "device_mode", "parameter_input"):  # the slots are fresh
        return [torch.empty(n, 3) for _ in range(2)]
    if case == "reversed_views":  # views of one buffer, out of rank order: neither direct nor rebindable
        base = torch.full((2, n, 3), -1.0)
        return [base[1], base[0]]
    if case == "storage_kept":  # someone holds a slot's storage
        slots = [torch.zeros(n, 3) for _ in range(2)]
        _kept.append(slots[0].untyped_storage())
        return slots
    if case == "not_contiguous":
        return [torch.zeros(3, n).t() for _ in range(2)]
    if case == "shared_memory":
        return [torch.zeros(n, 3).share_memory_() for _ in range(2)]
    raise ValueError(case)


_kept: List[Any] = []


def mixed(ctx: Any, case: str, async_op: bool, stage_refusals: bool = True) -> Dict[str, Any]:
    """Rank 0's slots built as ``case``, every other rank's fresh; an elided gather and its cat,
    against torch's list call and cat on slots built alike."""
    import memgather

    n = 5
    given = torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 100 * ctx.rank
    built = case if ctx.rank == 0 else "fresh"
    if case == "parameter_input" and ctx.rank == 0:
        given = torch.nn.Parameter(given, requires_grad=False)
    with gloo_as_nccl2(stage_refusals):
        theirs = _slots(built, n)
        torch.distributed.all_gather(theirs, given)
        want = torch.cat(theirs)
        ours = _slots(built, n)
        addresses = [slot.data_ptr() for slot in ours]
        memgather.reset_stats()
        modes = {"dispatch_mode": _Seen, "function_mode": _Logged, "device_mode": lambda: torch.device("cpu")}
        mode = modes[case]() if case in modes and ctx.rank == 0 else contextlib.nullcontext()
        with mode:
            work = memgather.all_gather(ours, given, elide=True, async_op=async_op)
        if work is not None:
            work.wait()
        versions = [slot._version for slot in ours]
        got = torch.cat(ours)
        stats = memgather.stats()
    _kept.clear()
    return {
        "equal": torch.equal(got, want),
        "versions": versions == [slot._version for slot in theirs],
        "in_place": addresses == [slot.data_ptr() for slot in ours],
        "strategies": dict(stats.by_strategy),
        "routes": dict(stats.by_route),
        "fallbacks": dict(stats.fallbacks),
    }


CASES = ["fresh", "reversed_views", "storage_kept", "not_contiguous", "shared_memory", "dispatch_mode",
         "function_mode", "device_mode", "parameter_input"]


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_a_rank_that_cannot_rebind_takes_the_same_collective(pools: Any, case: str, async_op: bool) -> None:
    """Rank 0 stages (or, with fresh slots, rebinds), rank 1 rebinds; both take the single call,
    DETAIL's check finds every rank's collectives alike, and the result is torch's, bit for bit."""
    first, second = unwrap(pools(2, **DETAIL).run(mixed, case, async_op))
    # A mode's rank stages (the mode sees ordinary calls), but for torch's default-device mode, which
    # changes nothing memgather does.
    staged = case not in ("fresh", "parameter_input", "device_mode")
    assert first["strategies"] == ({"staged": 1} if staged else {"rebind": 1}), first
    assert second["strategies"] == {"rebind": 1}, second
    for result in (first, second):
        assert result["routes"] == {"single_every_rank": 1}, result
        assert result["fallbacks"] == {}, result
        assert result["equal"] and result["versions"], result
    assert first["in_place"] is staged, first  # staged slots keep their memory
    assert second["in_place"] is False, second  # rebound


def test_a_split_is_caught(pools: Any) -> None:
    """The control: where rank 0 took torch's list call while rank 1 took the single call, DETAIL's
    check raises. Without it the test above could not see a split on gloo."""
    results = pools(2, **DETAIL).run(mixed, "reversed_views", False, False)
    assert any(isinstance(result, RankError) for result in results), results
    assert any("mismatch" in result.message.lower() for result in results if isinstance(result, RankError)), results


@pytest.mark.parametrize("reason", sorted(strategies._STAGEABLE, key=str))
def test_stage_takes_every_reason_of_a_ranks_own_slots(reason: Reason) -> None:
    slots = [torch.empty(3), torch.empty(3)]
    assert strategies.stage(reason, slots, torch.ones(3)) is Strategy.STAGED


@pytest.mark.parametrize("reason", sorted(set(Reason) - strategies._STAGEABLE, key=str))
def test_stage_leaves_every_other_reason_to_torch(reason: Reason) -> None:
    """Reasons every rank of a working program shares (the group, the size, the dtype, ...)."""
    assert strategies.stage(reason, [torch.empty(3), torch.empty(3)], torch.ones(3)) is reason


def _inference_slot() -> torch.Tensor:
    with torch.inference_mode():
        return torch.empty(3)


@pytest.mark.parametrize("odd", [
    lambda: torch.zeros(3, requires_grad=True),  # torch: "a leaf Variable that requires grad ... in-place"
    _inference_slot,  # torch: "Inplace update to inference tensor outside InferenceMode"
    lambda: torch.zeros(3, dtype=torch.complex64).conj(),  # torch's view_as_real refuses a conjugate bit
    lambda: torch.zeros(3).to_sparse(),
], ids=["requires_grad", "inference", "conj", "sparse"])
def test_slots_torch_refuses_are_not_staged(odd: Any) -> None:
    """A slot torch's own call raises for on this rank keeps torch's outcome: staging would write it."""
    refused = Reason.SLOTS_SHARED
    assert strategies.stage(refused, [torch.empty(3), odd()], torch.ones(3)) is refused


class _Logged(torch.overrides.TorchFunctionMode):
    """A mode of the user's own: it sees every torch function called under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def under_mode(ctx: Any, mode: str, on_ranks: List[int], async_op: bool = False, check: bool = False) -> Dict[str, Any]:
    """gloo's own routes (no stand-in): a fresh-slot gather under ``mode`` on ``on_ranks`` only."""
    import memgather

    given = torch.arange(6.0) + 10 * ctx.rank
    slots = [torch.empty(6) for _ in range(ctx.world)]
    want = [torch.arange(6.0) + 10 * rank for rank in range(ctx.world)]
    memgather.reset_stats()
    active = {"device": lambda: torch.device("cpu"), "logged": _Logged}[mode]() if ctx.rank in on_ranks \
        else contextlib.nullcontext()
    with active:
        work = memgather.all_gather(slots, given, async_op=async_op, check=check)
    if work is not None:
        work.wait()
    stats = memgather.stats()
    return {"equal": all(torch.equal(s, w) for s, w in zip(slots, want)), "strategies": dict(stats.by_strategy),
            "fallbacks": dict(stats.fallbacks), "seen": getattr(active, "seen", None)}


@pytest.mark.parametrize("on_ranks", [[0], [0, 1]], ids=["one rank", "every rank"])
def test_the_default_device_mode_changes_nothing(pools: Any, on_ranks: List[int]) -> None:
    """``with torch.device(...)`` / ``set_default_device`` only names the device of factory calls that
    name none: memgather acts under it as without it, on one rank or on all."""
    for result in unwrap(pools(2, **DETAIL).run(under_mode, "device", on_ranks)):
        assert result["equal"] and result["fallbacks"] == {} and result["strategies"] == {"in_slots": 1}, result


@pytest.mark.parametrize("async_op,check", [(False, False), (True, True)], ids=["broadcasts", "async, check"])
def test_a_mode_of_one_ranks_own_takes_the_others_to_torch(pools: Any, async_op: bool, check: bool) -> None:
    """Where the ranks agree first (gloo's broadcasts; check mode), a user's TorchFunctionMode on rank 0
    sends it to torch's call, which the mode sees as under torch; the exchange takes rank 1 along,
    instead of rank 0 meeting rank 1's broadcasts (or its exchange) with a list call."""
    first, second = unwrap(pools(2, **DETAIL).run(under_mode, "logged", [0], async_op, check))
    assert first["equal"] and second["equal"], (first, second)
    assert first["fallbacks"] == {"torch_function": 1} and "all_gather" in first["seen"], first
    assert second["fallbacks"] == {"peer_fallback": 1}, second


def seen_by_a_mode(ctx: Any, gloo_min_bytes: Any) -> Dict[str, Any]:
    """What a user's TorchFunctionMode sees of two small gathers (the group described, then known)."""
    from dataclasses import replace

    import memgather
    from memgather.engine import core

    given = torch.arange(6.0) + 10 * ctx.rank
    before = core.settings()
    core.configure(replace(before, gloo_min_bytes=gloo_min_bytes))
    try:
        mode = _Logged()
        with mode:
            for _ in range(2):
                memgather.all_gather([torch.empty(6) for _ in range(ctx.world)], given)
    finally:
        core.configure(before)
    return {"seen": [name for name in mode.seen if name != "empty"]}


@pytest.mark.parametrize("gloo_min_bytes", [None, 0], ids=["below the threshold", "threshold 0"])
def test_a_users_mode_sees_torchs_call_and_none_of_memgathers_reads(pools: Any, gloo_min_bytes: Any) -> None:
    """memgather's own reads of the input and the slots, the first lines of its plan included, happen
    where no user's TorchFunctionMode sees them: the mode sees what it sees under torch."""
    for result in unwrap(pools(2, **DETAIL).run(seen_by_a_mode, gloo_min_bytes)):
        assert result["seen"] == ["all_gather", "all_gather"], result
