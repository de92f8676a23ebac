"""Every reason to fall back is reached, and falling back changes nothing.

Each case runs torch's all_gather and memgather's on real gloo ranks with the
same arguments: both must raise the same exception type, or both succeed with
the same bytes, and memgather must report the expected reason.

``REACHES`` holds, for every ``Reason``, one real input that reaches it, and
``test_every_reason_is_reached`` runs each and asserts that memgather's counter
for that reason moved in the processes that ran it: a reason no input reaches
fails by name, and each case stands alone, so any subset of tests can run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Tuple

import pytest
import torch
import torch.distributed as dist

import memgather
from memgather import Reason, compat
from tests import nccl_ranks
from tests.conftest import EAGER, run_on_fake, unwrap
from tests.ranks import FunctionTensor, as_bytes, differential, filled, storage_of
from tests.releases import EMPTY_KILLS_GLOO, gloo_gathers_empty_tensors, requires_fake_backend

# Run on every rank of a pool (tests/pool.py): each takes the rank's context first and
# returns plain data for the tests below to assert on.


def _views(world: int, rank: int) -> List[torch.Tensor]:
    return list(torch.zeros(world * 3).view(world, 3).unbind(0))


# name -> builder(rank, world) returning (tensor_list, input, keepalive).
# Each builds what a caller could really pass; the keepalive holds references
# (views, storages) the case needs alive during the call.
BAD_INPUTS: Dict[str, Any] = {
    "not_a_list": lambda r, w: (tuple(torch.empty(3) for _ in range(w)), filled(r), None),
    "wrong_length": lambda r, w: ([torch.empty(3) for _ in range(w + 1)], filled(r), None),
    "slot_not_a_tensor": lambda r, w: ([torch.empty(3) for _ in range(w - 1)] + [[0.0, 0.0, 0.0]], filled(r), None),
    "input_not_a_tensor": lambda r, w: ([torch.empty(3) for _ in range(w)], [1.0, 2.0, 3.0], None),
    "slot_subclass": lambda r, w: ([torch.nn.Parameter(torch.zeros(3), requires_grad=False) for _ in range(w)], filled(r), None),
    "input_torch_function": lambda r, w: ([torch.empty(3) for _ in range(w)], filled(r).as_subclass(FunctionTensor), None),
    "sparse_input": lambda r, w: ([torch.empty(3) for _ in range(w)], filled(r).to_sparse(), None),
    "conj_input": lambda r, w: ([torch.empty(3, dtype=torch.complex64) for _ in range(w)], filled(r, dtype=torch.complex64).conj(), None),
    "dtype_mismatch": lambda r, w: ([torch.empty(3, dtype=torch.float64) for _ in range(w)], filled(r), None),
    "device_mismatch": lambda r, w: ([torch.empty(3, device="meta") for _ in range(w)], filled(r), None),
    "meta_device": lambda r, w: ([torch.empty(3, device="meta") for _ in range(w)], torch.empty(3, device="meta"), None),
    # int16: refused by gloo's collectives on every release (routes.GLOO_DTYPES)
    "refused_dtype": lambda r, w: ([torch.ones(3, dtype=torch.int16) for _ in range(w)], filled(r, dtype=torch.int16), None),
    "uneven_slots": lambda r, w: ([torch.empty(4) for _ in range(w)], filled(r), None),
    "slot_requires_grad": lambda r, w: ([torch.zeros(3, requires_grad=True) for _ in range(w)], filled(r), None),
    "inference_slots": lambda r, w: (_inference_slots(w), filled(r), None),
    "duplicate_slot": lambda r, w: ([torch.zeros(3)] * w, filled(r), None),
    "input_is_other_rank_view": lambda r, w: _input_in_wrong_view(r, w),
    "input_is_own_fresh_slot": lambda r, w: _input_is_fresh_slot(r, w),
    "slot_view_held": lambda r, w: _slot_with_view(r, w),
    "slot_storage_held": lambda r, w: _slot_with_storage(r, w),
    "permuted_slots": lambda r, w: ([torch.empty(3, 2).t() for _ in range(w)], filled(r, (2, 3)), None),
    "overlapping_slots": lambda r, w: (_overlapping_slots(w), filled(r), None),
    "input_views_other_slot": lambda r, w: _input_views_other_slot(r, w),
}


def _overlapping_slots(world: int) -> List[torch.Tensor]:
    """Slots sharing elements (torch's sequential copies decide what stays), not adjacent."""
    base = torch.zeros(world + 2)
    return [base[i:i + 3] for i in range(world)]


def _input_views_other_slot(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    """The input is a view of the next rank's slot (not the slot object itself)."""
    slots = [torch.zeros(3) for _ in range(world)]
    other = slots[(rank + 1) % world]
    other.copy_(filled(rank))
    return slots, other.view(3), None


def _inference_slots(world: int) -> List[torch.Tensor]:
    with torch.inference_mode():
        return [torch.zeros(3) for _ in range(world)]


def _input_in_wrong_view(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    views = _views(world, rank)
    other = views[(rank + 1) % world]
    other.copy_(filled(rank))
    return views, other, None


def _input_is_fresh_slot(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    slots = [torch.zeros(3) for _ in range(world)]
    slots[rank].copy_(filled(rank))
    return slots, slots[rank], None


def _slot_with_view(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    slots = [torch.zeros(3) for _ in range(world)]
    return slots, filled(rank), slots[-1][1:]


def _slot_with_storage(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    slots = [torch.zeros(3) for _ in range(world)]
    return slots, filled(rank), storage_of(slots[0])


def _outcome(fn: Any, build: Any, rank: int, world: int, **kwargs: Any) -> Tuple[Any, ...]:
    slots, given, keep = build(rank, world)
    before = _where(slots)
    try:
        fn(slots, given, **kwargs)
    except Exception as error:  # noqa: BLE001 - the outcome is what we compare
        # torch raises before it writes: the slots must be as they were, where they were
        return ("raise", type(error).__name__, _where(slots) == before)
    seen = keep if isinstance(keep, torch.Tensor) else None
    return ("ok", [as_bytes(s) for s in slots], as_bytes(seen) if seen is not None else None)


def _where(slots: Any) -> List[Any]:
    """Each slot's address, version counter and bytes (None for what is not a tensor)."""
    return [(s.data_ptr(), None if s.is_inference() else s._version, as_bytes(s))
            if isinstance(s, torch.Tensor) and not s.is_meta else None
            for s in slots]


def compare_bad_input(ctx: Any, name: str) -> Dict[str, Any]:
    """Torch's outcome and memgather's for one BAD_INPUTS case, plus memgather's stats."""
    build = BAD_INPUTS[name]
    want = _outcome(dist.all_gather, build, ctx.rank, ctx.world)
    memgather.reset_stats()
    got = _outcome(memgather.all_gather, build, ctx.rank, ctx.world)
    snapshot = memgather.stats()
    return {"want": want, "got": got, "fallbacks": dict(snapshot.fallbacks), "strategy": dict(snapshot.by_strategy)}


def compare_call(ctx: Any, name: str, numel: int, **kwargs: Any) -> Dict[str, Any]:
    """Torch's outcome and memgather's for fresh slots of one BAD_INPUTS dtype case, the call
    made with ``kwargs`` (torch's gets them too, but for memgather's own ``elide`` and ``check``;
    a tuple as ``async_op`` gives each rank its own)."""
    dtype = torch.int16 if name == "refused_dtype" else torch.float32
    if isinstance(kwargs.get("async_op"), tuple):
        kwargs["async_op"] = kwargs["async_op"][ctx.rank]

    def build(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
        return [torch.ones(numel, dtype=dtype) for _ in range(world)], filled(rank, (numel,), dtype), None

    torch_kwargs = {key: value for key, value in kwargs.items() if key not in ("elide", "check")}
    want = _outcome(_waited(dist.all_gather, **torch_kwargs), build, ctx.rank, ctx.world)
    memgather.reset_stats()
    got = _outcome(_waited(memgather.all_gather, **kwargs), build, ctx.rank, ctx.world)
    snapshot = memgather.stats()
    return {"want": want, "got": got, "fallbacks": dict(snapshot.fallbacks), "strategy": dict(snapshot.by_strategy)}


def compare_peer_dependent(ctx: Any, numel: int, odd_on: int, async_op: bool = False, odd: str = "view") -> Dict[str, Any]:
    """Only rank ``odd_on`` has an odd slot: it must fall back, alone or with all.

    ``odd``: "view" (a view of a slot is kept: no rebind) or "strided" (a slot is
    not contiguous: neither rebound nor filled in place by broadcasts).
    """

    def build(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
        slots = [torch.zeros(numel) for _ in range(world)]
        if rank == odd_on and odd == "strided":
            slots[0] = torch.zeros(2 * numel)[::2]
        return slots, filled(rank, (numel,)), slots[0][:1] if rank == odd_on and odd == "view" else None

    want = _outcome(_waited(dist.all_gather, async_op), build, ctx.rank, ctx.world)
    memgather.reset_stats()
    got = _outcome(_waited(memgather.all_gather, async_op), build, ctx.rank, ctx.world)
    snapshot = memgather.stats()
    return {"want": want, "got": got, "strategy": dict(snapshot.by_strategy), "fallbacks": dict(snapshot.fallbacks)}


def _waited(function: Any, async_op: Any = False, **kwargs: Any) -> Any:
    def call(slots: Any, given: Any) -> None:
        work = function(slots, given, async_op=async_op, **kwargs)
        if work is not None:
            work.wait()

    return call


def compare_mixed_dtypes(ctx: Any, numel: int, check: bool) -> Dict[str, Any]:
    """Ranks pass equal byte counts of different dtypes (a broken program torch lets through)."""

    def build(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
        dtype = torch.float32 if rank == 0 else torch.int32
        return [torch.zeros(numel, dtype=dtype) for _ in range(world)], filled(rank, (numel,), dtype), None

    want = _outcome(dist.all_gather, build, ctx.rank, ctx.world)
    memgather.reset_stats()
    got = _outcome(memgather.all_gather, build, ctx.rank, ctx.world, check=check)
    return {"want": want, "got": got, "fallbacks": dict(memgather.stats().fallbacks)}


def _shared_memory_slots(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    """Fresh slots, one moved to shared memory (``share_memory_()``, as DataLoader workers' tensors are)."""
    slots = [torch.zeros(3) for _ in range(world)]
    slots[0].share_memory_()
    return slots, filled(rank), None


def _numpy_slots(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    """Fresh slots, the last over a NumPy array's memory; the keepalive, a second tensor over
    that array, shows whether the gathered bytes landed there, as they do under torch."""
    import numpy

    array = numpy.zeros(3, dtype=numpy.float32)
    slots = [torch.zeros(3) for _ in range(world - 1)] + [torch.from_numpy(array)]
    return slots, filled(rank), torch.from_numpy(array)


# name -> builder(rank, world), as BAD_INPUTS: fresh slots that each hold their storage
# alone, so memgather would rebind them, but whose memory is not the default allocator's.
SLOT_MEMORY_INPUTS: Dict[str, Any] = {
    "shared_memory_slot": _shared_memory_slots,
    "numpy_slot": _numpy_slots,
}


def compare_slot_memory(ctx: Any, name: str, async_op: bool = False) -> Dict[str, Any]:
    """Torch's outcome and memgather's for one SLOT_MEMORY_INPUTS case, elision on.

    Elision on, so that gloo's broadcast route tries a rebind too (without a cat to
    elide, it fills fresh slots where they lie and never asks). ``async_op``: gloo's
    single-tensor route, where fresh slots can only be rebound or left to torch.
    """
    from functools import partial

    build = SLOT_MEMORY_INPUTS[name]
    want = _memory_outcome(_waited(dist.all_gather, async_op), build, ctx.rank, ctx.world)
    memgather.reset_stats()
    got = _memory_outcome(_waited(partial(memgather.all_gather, elide=True), async_op), build, ctx.rank, ctx.world)
    snapshot = memgather.stats()
    return {"want": want, "got": got, "fallbacks": dict(snapshot.fallbacks), "strategy": dict(snapshot.by_strategy)}


def _memory_outcome(fn: Any, build: Any, rank: int, world: int) -> Tuple[Any, ...]:
    """``_outcome``, plus which slots are still in shared memory afterwards (a rebind moves a slot out)."""
    built: List[List[torch.Tensor]] = []

    def keep_slots(r: int, w: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
        slots, given, keep = build(r, w)
        built.append(slots)
        return slots, given, keep

    outcome = _outcome(fn, keep_slots, rank, world)
    return (*outcome, [slot.is_shared() for slot in built[0]])



EXPECTED_REASON = {
    "not_a_list": "not_a_list",
    "wrong_length": "wrong_length",
    "slot_not_a_tensor": "not_a_tensor",
    "input_not_a_tensor": "not_a_tensor",
    "slot_subclass": "slot_subclass",
    "input_torch_function": "torch_function",
    "sparse_input": "unsupported_layout",
    "conj_input": "unsupported_layout",
    "dtype_mismatch": "dtype_mismatch",
    "device_mismatch": "device_mismatch",
    "meta_device": "backend",
    "refused_dtype": "unsupported_dtype",
    "uneven_slots": "uneven_slots",
    "slot_requires_grad": "slot_requires_grad",
    "inference_slots": "inference_tensor",
    "duplicate_slot": "duplicate_slot",
    "input_is_other_rank_view": "input_overlaps_output",
    "input_is_own_fresh_slot": "input_overlaps_output",
    "slot_view_held": "slots_shared",
    "slot_storage_held": "slots_shared",
    "permuted_slots": "slot_not_contiguous",
    "overlapping_slots": "slots_shared" if compat.can_prove_exclusive() else "cannot_prove_exclusive",
    "input_views_other_slot": "input_overlaps_output",
}

BIG = 655360  # float32 elements: 2.5 MiB per rank, on gloo's broadcast route
SMALL = 3
# Fresh slots, elision asked for: rebound where that can be proven safe, else filled where they lie.
ELIDED_FRESH = {"rebind": 1} if compat.can_prove_exclusive() else {"in_slots": 1}


# Not rebound (something else holds the slot's memory), but on gloo's broadcast route
# filled where they lie: the kept view or storage then sees the gathered data, as under
# torch (compared above). On the single route they fall back (slots_shared, below).
FILLED_IN_SLOTS = {"slot_view_held", "slot_storage_held"}
if not compat.can_prove_exclusive():
    # Where no rebind can be proven (torch 1.13.1, 2.0.1), the rebind that this case's
    # input (its own fresh slot) rules out is never tried: the slots are filled where they lie.
    FILLED_IN_SLOTS.add("input_is_own_fresh_slot")

# Where torch has no storage use count, no rebind is ever tried: the questions a rebind
# asks (is the storage shared? is its memory the allocator's?) are never reached.
NO_REBIND = ("torch {} has no storage use count (docs/torch-releases.md): no rebind is tried, "
             "so memgather never asks this").format(torch.__version__)


def test_every_bad_input_has_an_expected_reason() -> None:
    assert set(EXPECTED_REASON) == set(BAD_INPUTS)


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_same_outcome_as_torch(pools: Any, name: str) -> None:
    # EAGER: small gloo calls are otherwise left to torch before their slots are even looked at
    for rank, result in enumerate(unwrap(pools(2, **EAGER).run(compare_bad_input, name))):
        assert result["got"] == result["want"], f"rank {rank}: torch {result['want']}, memgather {result['got']}"
        if name in FILLED_IN_SLOTS:
            assert result["strategy"] == {"in_slots": 1}, f"rank {rank}: {result}"
        else:
            assert result["fallbacks"] == {EXPECTED_REASON[name]: 1}, f"rank {rank}: {result['fallbacks']}"


@pytest.mark.parametrize("async_op", [False, True], ids=["broadcast", "single"])
@pytest.mark.parametrize("name", sorted(SLOT_MEMORY_INPUTS))
def test_slot_memory_is_never_moved(pools: Any, name: str, async_op: bool) -> None:
    """Fresh slots in shared or foreign memory, elision on (so memgather would rebind them):
    torch's outcome, the slots still in that memory (compared in the outcome), never rebound.
    The single route cannot fill slots where they lie: there the call is left to torch."""
    if async_op and not compat.gloo_has_single_tensor():
        pytest.skip("this torch's gloo has no single-tensor call: async calls stay with torch (backend)")
    for rank, result in enumerate(unwrap(pools(2, **EAGER).run(compare_slot_memory, name, async_op))):
        assert result["got"] == result["want"], f"rank {rank}: torch {result['want']}, memgather {result['got']}"
        assert "rebind" not in result["strategy"], f"rank {rank}: {result}"
        if async_op and compat.can_prove_exclusive():
            assert result["fallbacks"] == {"slot_memory": 1}, f"rank {rank}: {result}"


@pytest.mark.parametrize("numel", [SMALL, BIG], ids=["small", "broadcast"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("elide", [False, True], ids=["in-slots", "rebind"])
def test_a_dtype_gloo_refuses_leaves_the_slots_as_torch_does(pools: Any, numel: int, async_op: bool, elide: bool) -> None:
    """torch raises "Invalid scalar type" before it writes; memgather once copied the input into its
    own slot first (in_slots), or rebound every slot (elide, async): same error, slots changed."""
    for rank, result in enumerate(unwrap(pools(2, **EAGER).run(compare_call, "refused_dtype", numel,
                                                                 async_op=async_op, elide=elide))):
        assert result["want"][:3] == ("raise", "RuntimeError", True), f"rank {rank}: torch {result['want']}"
        assert result["got"] == result["want"], f"rank {rank}: torch {result['want']}, memgather {result['got']}"
        # Where gloo has no single-tensor call, an async call has no route to refuse the dtype for.
        expected = "backend" if async_op and not compat.gloo_has_single_tensor() else "unsupported_dtype"
        assert result["fallbacks"] == {expected: 1}, f"rank {rank}: {result}"


@pytest.mark.parametrize("value", ["yes", 1, None, "tensor-pair"], ids=["string", "int", "none", "tensor-pair"])
def test_an_async_op_torch_refuses_is_left_to_torch(pools: Any, value: Any) -> None:
    """From torch 2.12 torch hands async_op to its backend's options: a string raises there, after
    memgather had rebound the slots. 1 works, as True does, and None as False: memgather takes them
    as torch does. A two-element tensor has no truth value: 2.12 on refuse it as a string, 1.13.1
    and 2.0.1 gather and then raise reading it (memgather once raised reading it, before the gather)."""
    if value == "tensor-pair":
        value = torch.tensor([1, 2])
    for rank, result in enumerate(unwrap(pools(2, **EAGER).run(compare_call, "fresh", SMALL, async_op=value,
                                                                 elide=True))):
        # 1.13.1 and 2.0.1 raise reading the tensor's truth after starting a gather they never wait
        # for: whether the slots show its bytes when the error arrives is a race under torch alone.
        racy = isinstance(value, torch.Tensor) and result["want"][:2] == ("raise", "RuntimeError")
        seen, expected = (result["got"][:2], result["want"][:2]) if racy else (result["got"], result["want"])
        assert seen == expected, f"rank {rank}: torch {result['want']}, memgather {result['got']}"
        if compat.async_op_refused(value):
            assert result["want"][0] == "raise", f"rank {rank}: {result}"
            assert result["fallbacks"] == {"bad_arguments": 1}, f"rank {rank}: {result}"
        else:
            assert "bad_arguments" not in result["fallbacks"], f"rank {rank}: {result}"
        if value is None:
            assert result["strategy"] == ELIDED_FRESH, f"rank {rank}: {result}"


@pytest.mark.parametrize("check", [False, True], ids=["check-off", "check-on"])
@pytest.mark.parametrize("values", [(0, False), ("numpy-false", False), (1, True)], ids=["0", "numpy", "1"])
@pytest.mark.parametrize("numel", [SMALL, BIG], ids=["small", "broadcast"])
def test_async_op_values_torch_reads_alike_meet_alike(pools: Any, values: Any, numel: int, check: bool) -> None:
    """0 on one rank and False on another are one call to torch: a first version of the check
    above sent the 0 to torch's list call and the False to the broadcasts, and gloo aborted."""
    if values[0] == "numpy-false":
        import numpy

        values = (numpy.bool_(False), False)
    env = EAGER if numel == SMALL else {}
    for rank, result in enumerate(unwrap(pools(2, **env).run(compare_call, "fresh", numel, async_op=values,
                                                                 check=check))):
        assert result["got"] == result["want"], f"rank {rank}: torch {result['want']}, memgather {result['got']}"
        assert result["want"][0] == "ok" and not result["fallbacks"].get("bad_arguments"), f"rank {rank}: {result}"


def test_single_route_mixed_decisions_meet_on_the_wire(pools: Any) -> None:
    """Rank 0 rewires (async: the single-tensor call), rank 1 falls back (torch's list call):
    both still meet on the wire and give torch's bytes. Under TORCH_DISTRIBUTED_DEBUG=DETAIL,
    torch checks that the ranks' collectives match: the ranks agree first, and rank 0 falls back too."""
    first, second = unwrap(pools(2, **EAGER).run(compare_peer_dependent, SMALL, 1, True))
    if compat.gloo_has_single_tensor() and compat.collectives_checked():
        assert first["fallbacks"] == {"peer_fallback": 1}
        assert second["fallbacks"] == {"slots_shared": 1}
    elif compat.gloo_has_single_tensor():
        assert first["strategy"] == {"rebind": 1}
        assert second["fallbacks"] == {"slots_shared": 1}
    else:  # no single-tensor call on this gloo: both stay with torch, before their slots are looked at
        assert first["fallbacks"] == second["fallbacks"] == {"backend": 1}
    for result in (first, second):
        assert result["got"] == result["want"]


def mixed_decisions_after_the_level_went_off(ctx: Any) -> Dict[str, Any]:
    """compare_peer_dependent on a group created under DETAIL, the debug level turned off since."""
    dist.set_debug_level(dist.DebugLevel.OFF)
    return compare_peer_dependent(ctx, SMALL, 1, True)


def test_a_group_created_under_detail_is_checked_whatever_the_level_now(pools: Any) -> None:
    """torch wraps a group for DETAIL's checks when it creates it: memgather asks the group, not the
    debug level (turned off after init, the single call met a list call, and failed)."""
    if not compat.gloo_has_single_tensor():
        pytest.skip("this torch's gloo has no single-tensor call: async calls stay with torch")
    ranks = pools(2, POOL="detail", TORCH_DISTRIBUTED_DEBUG="DETAIL", **EAGER)
    first, second = unwrap(ranks.run(mixed_decisions_after_the_level_went_off))
    assert first["fallbacks"] == {"peer_fallback": 1}, first
    assert second["fallbacks"] == {"slots_shared": 1}, second
    for result in (first, second):
        assert result["got"] == result["want"]


def _one_strided_rank(pools: Any) -> list:
    """Rank 1 has a strided slot on gloo's broadcast route, rank 0 fresh ones."""
    return unwrap(pools(2).run(compare_peer_dependent, BIG, 1, False, "strided"))


def test_large_gather_falls_back_on_every_rank_when_one_must(pools: Any) -> None:
    """The broadcast route is a different protocol: one rank's fallback takes all ranks along."""
    first, second = _one_strided_rank(pools)
    assert first["fallbacks"] == {"peer_fallback": 1}
    assert second["fallbacks"] == {"slot_not_contiguous": 1}
    for result in (first, second):
        assert result["got"] == result["want"]


def _dtypes_disagree(pools: Any) -> list:
    """Rank 0 passes float32, rank 1 int32 of the same byte count, check off."""
    return unwrap(pools(2).run(compare_mixed_dtypes, BIG, False))


def test_ranks_disagreeing_on_dtype_fall_back_without_check(pools: Any) -> None:
    for result in _dtypes_disagree(pools):
        assert result["fallbacks"] == {"uneven_ranks": 1}
        assert result["got"] == result["want"]


# --- One real input per reason -------------------------------------------------------
# Each function below runs its input through torch's all_gather and memgather's, asserts
# that both ended alike, and returns memgather's fallback counts (summed over every process
# that ran it). A release that cannot run an input skips it, saying why.

def _counted(results: Iterable[Dict[str, Any]]) -> Counter:
    """Every rank's fallback counts, added up."""
    total: Counter = Counter()
    for result in results:
        total.update(result["fallbacks"])
    return total


def _same_outcome(results: list) -> Counter:
    """Assert each rank ended as torch did; its fallback counts, summed."""
    for rank, result in enumerate(results):
        assert result["got"] == result["want"], f"rank {rank}: torch {result['want']}, memgather {result['got']}"
    return _counted(results)


def _bad_input(name: str, pools: Any) -> Counter:
    """One BAD_INPUTS case on ranks that rewire every gloo call (EAGER)."""
    return _same_outcome(unwrap(pools(2, **EAGER).run(compare_bad_input, name)))


def _one_call(env: Dict[str, str], pools: Any, **case: Any) -> Counter:
    """One well-formed call (tests.ranks.differential): torch's bytes, the caller's tensor objects kept."""
    full = {"dtype": "float32", "shape": (3,), "layout": "contiguous", "slots": "zeros_like",
            "async": False, "group": None, "seed": 0, **case}
    results = [rows[0] for rows in unwrap(pools(2, **env).run(differential, [full]))]
    for rank, result in enumerate(results):
        assert result["raised"] == [None, None], f"rank {rank}: {result}"
        assert result["equal"] and result["identity_kept"], f"rank {rank}: {result}"
    return _counted(results)


def _not_in_group(pools: Any) -> Counter:
    """Rank 0 is outside the subgroup (1,): torch warns and returns None, its slots untouched."""
    return _one_call(EAGER, pools, group=(1,))


def _unregistered_group(pools: Any) -> Counter:
    """Subgroups kept through destroy_process_group(), before and after a new init_process_group():
    torch's call still runs on them, and so must a target's (check on and off, sync and async,
    whether memgather described the group before or not), and memgather.gather too; memgather
    cannot name their ranks any more."""
    return Counter(_run_script(
        """
        import os, tempfile
        os.environ["MEMGATHER_GLOO_MIN_BYTES"] = "0"  # every call rewired where memgather can
        import memgather
        def init():
            dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        init()
        described, fresh = dist.new_group([0]), dist.new_group([0])
        memgather.patch(["__main__"])
        t = torch.arange(4.0)
        slots = [torch.empty(4)]
        dist.all_gather(slots, t, group=described)  # described by memgather, then rewired
        memgather.gather(t, group=described)
        assert dict(memgather.stats().by_strategy) == {"direct": 2}, memgather.stats()
        memgather.reset_stats()
        dist.destroy_process_group()
        got = []
        def calls():
            for group in (described, fresh):
                for check in (False, True):
                    for async_op in (False, True):
                        memgather.patch(["__main__"], check=check)
                        slots = [torch.empty(4)]
                        work = dist.all_gather(slots, t, group=group, async_op=async_op)
                        if work is not None:
                            work.wait()
                        got.append(slots[0].tolist())
                    got.append(memgather.gather(t, group=group, check=check).tolist())
        calls()  # no default group now
        init()
        calls()  # a new default group; these two are not in it
        assert got == [t.tolist()] * 24, got
        stats = memgather.stats()
        assert dict(stats.fallbacks) == {"unregistered_group": 24}, dict(stats.fallbacks)
        print(json.dumps(dict(stats.fallbacks)))
        # gloo's threads left running at exit abort the interpreter now and then ("terminate called
        # without an active exception"; a fresh-clone CI run hit it here): every group let go first
        dist.destroy_process_group()
        del described, fresh
        import gc
        gc.collect()
        """
    ))


def _below_threshold(pools: Any) -> Counter:
    """12 bytes per rank at the default threshold (2 MiB per rank)."""
    return _one_call({}, pools)


def _empty(pools: Any) -> Counter:
    """Zero elements, every gloo call rewired."""
    if not gloo_gathers_empty_tensors():
        pytest.skip(EMPTY_KILLS_GLOO)
    return _one_call(EAGER, pools, shape=(0,))


def _slots_shared(pools: Any) -> Counter:
    """Slots that overlap one another: neither adjacent views nor sole owners."""
    if not compat.can_prove_exclusive():
        pytest.skip(NO_REBIND)
    return _bad_input("overlapping_slots", pools)


def _slot_memory(pools: Any) -> Counter:
    """A fresh slot moved to shared memory, on gloo's single-tensor route (async), elision on:
    the rebind it would take is refused. (On the broadcast route such slots are filled
    where they lie instead, which leaves their memory where it is: nothing is counted.)"""
    if not compat.can_prove_exclusive():
        pytest.skip(NO_REBIND)
    if not compat.gloo_has_single_tensor():
        pytest.skip("this torch's gloo has no single-tensor call: async calls stay with torch (backend)")
    return _same_outcome(unwrap(pools(2, **EAGER).run(compare_slot_memory, "shared_memory_slot", True)))


def _peer_fallback(pools: Any) -> Counter:
    return _same_outcome(_one_strided_rank(pools))


def _uneven_ranks(pools: Any) -> Counter:
    return _same_outcome(_dtypes_disagree(pools))


def _not_initialized(pools: Any) -> Counter:
    """No process group in this (the test) process: memgather raises what torch raises."""
    assert not dist.is_initialized()
    with pytest.raises(Exception) as torch_error:  # ValueError on torch 2.13, RuntimeError on 2.0.1
        dist.all_gather([torch.empty(3)], torch.ones(3))
    memgather.reset_stats()
    with pytest.raises(torch_error.type) as ours:
        memgather.all_gather([torch.empty(3)], torch.ones(3))
    assert str(ours.value) == str(torch_error.value)
    return Counter(memgather.stats().fallbacks)


def _run_script(body: str) -> Any:
    """Run ``body`` in a fresh interpreter; it prints one JSON line last."""
    prelude = textwrap.dedent(
        """
        import json, warnings
        warnings.simplefilter("ignore")
        import torch, torch.distributed as dist
        """
    )
    # As run_on_fake: torch cannot wrap the fake backend for TORCH_DISTRIBUTED_DEBUG=DETAIL.
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TORCH_DISTRIBUTED_DEBUG": "OFF"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _skip_without_fake_backend() -> None:
    """The skip of ``requires_fake_backend``, for a function that is not itself a test."""
    if requires_fake_backend.args[0]:
        pytest.skip(requires_fake_backend.kwargs["reason"])


def _coalescing(pools: Any) -> Counter:
    """Inside _coalescing_manager: left to torch, which queues the op.
    gloo refuses coalescing outright; torch's no-op "fake" backend queues ops."""
    _skip_without_fake_backend()
    return Counter(_run_script(
        """
        import memgather
        from torch.distributed.distributed_c10d import _coalescing_manager
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        with _coalescing_manager(device=torch.device("cpu")):
            memgather.all_gather([torch.empty(3) for _ in range(2)], torch.ones(3))
        print(json.dumps(dict(memgather.stats().fallbacks)))
        """
    ))


def _compiling(pools: Any) -> Counter:
    """A function compiled with torch.compile: left to torch (Dynamo maps the call itself)."""
    _skip_without_fake_backend()
    return Counter(_run_script(
        """
        import memgather
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        def f(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            memgather.all_gather(slots, t)
            return slots
        torch.compile(f, backend="eager")(torch.ones(3))
        print(json.dumps(dict(memgather.stats().fallbacks)))
        """
    ))


def _vmap() -> Callable[..., Any]:
    """functorch's vmap: torch.func's (torch 2.0 on), else the functorch package's (torch 1.13,
    whose torch.vmap is an older transform that makes no functorch wrappers)."""
    if hasattr(torch, "func"):
        return torch.func.vmap
    import functorch

    return functorch.vmap


def vmapped_gathers(ctx: Any) -> Dict[str, Any]:
    """all_gather inside torch.vmap, by torch then by memgather: the outcome (values or error)."""

    def outcome(call: Callable[..., Any]) -> Any:
        def gather(x: torch.Tensor) -> torch.Tensor:
            slots = [torch.empty_like(x) for _ in range(ctx.world)]
            call(slots, x)
            return torch.stack(slots)

        try:
            return ["ok", _vmap()(gather)(torch.arange(6.0).reshape(2, 3) + 10 * ctx.rank).tolist()]
        except Exception as error:  # noqa: BLE001 - the error is the outcome compared
            return ["raise", type(error).__name__, str(error)]

    want = outcome(dist.all_gather)
    memgather.reset_stats()
    got = outcome(memgather.all_gather)
    return {"same": got == want, "torch": want, "fallbacks": dict(memgather.stats().fallbacks)}


def _functorch(pools: Any) -> Counter:
    """Inside torch.vmap the input and slots are BatchedTensors without storage: torch's own error."""
    if not hasattr(torch._C, "_functorch"):
        pytest.skip("this torch has no torch._C._functorch to tell its wrappers by")
    results = unwrap(pools(2, **EAGER).run(vmapped_gathers))
    for result in results:
        assert result["same"], result
    return Counter(results[0]["fallbacks"])


def dual_level_gathers(ctx: Any) -> Dict[str, Any]:
    """An async gather (a rebind's route) in a forward-AD dual level, into a slot that carries a tangent
    (an in-place copy of a dual tensor) and a plain one, by torch then by memgather."""
    import torch.autograd.forward_ad as forward_ad

    def outcome(call: Callable[..., Any]) -> Any:
        with forward_ad.dual_level():
            carrying = torch.zeros(BIG)
            carrying.copy_(forward_ad.make_dual(torch.zeros(BIG), torch.ones(BIG)))
            slots = [carrying, torch.zeros(BIG)]
            try:
                call(slots, torch.full((BIG,), float(ctx.rank)), async_op=True).wait()
            except Exception as error:  # noqa: BLE001 - the error is the outcome compared
                return ["raise", type(error).__name__, str(error)]
            tangent = forward_ad.unpack_dual(slots[0]).tangent
            return [[s[0].item() for s in slots], [s._version for s in slots], tangent is None or tangent.sum().item()]

    want = outcome(dist.all_gather)
    memgather.reset_stats()
    got = outcome(memgather.all_gather)
    return {"same": got == want, "torch": want, "got": got, "fallbacks": dict(memgather.stats().fallbacks)}


def _forward_ad(pools: Any) -> Counter:
    """In a dual level a slot may carry a tangent, which forward AD carries through torch's copies."""
    results = unwrap(pools(2, **EAGER).run(dual_level_gathers))
    for result in results:
        assert result["same"], result
    return Counter(results[0]["fallbacks"])


def _no_primitive(pools: Any) -> Counter:
    """A torch without any single-tensor all-gather: torch's list call gathers, memgather says why.

    torch < 1.9 lacks all three primitives and does not install on Python >= 3.9;
    removing them from this torch reaches the same code path.
    """
    got = _run_script(
        """
        for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
            if hasattr(dist, name):  # all_gather_single arrived in 2.13
                delattr(dist, name)
        import memgather
        import tempfile  # a file rendezvous: torch 2.0 reads tcp port 0 as a missing port
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        slots = [torch.empty(3)]
        memgather.all_gather(slots, torch.arange(3.0))
        print(json.dumps({"fallbacks": dict(memgather.stats().fallbacks),
                          "reason": memgather.primitive().reason, "data": slots[0].tolist()}))
        # gloo's threads left running at exit abort the interpreter now and then ("terminate called
        # without an active exception"): a fresh-clone CI run on a loaded machine hit it once
        dist.destroy_process_group()
        """
    )
    assert "has none of" in got["reason"]
    assert got["data"] == [0.0, 1.0, 2.0]
    return Counter(got["fallbacks"])


def _cannot_prove_exclusive(pools: Any) -> Counter:
    """Fresh slots that would need a rebind, on a torch without the storage use count.

    torch 1.13.1 and 2.0.1 have no torch._C._storage_Use_Count (docs/torch-releases.md):
    there overlapping slots reach it on real gloo ranks. Where torch has
    it, removing it reaches the same path; the "fake" backend gives a group of 2 in
    one process, so fresh slots need a rebind (legacy NCCL's route, which the script gives
    the fake backend as benchmarks/overhead.py does, has no fill in place).
    """
    if not compat.can_prove_exclusive():
        return _bad_input("overlapping_slots", pools)
    _skip_without_fake_backend()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return Counter(_run_script(
        f"""
        import sys
        sys.path.append({root!r})  # for benchmarks.overhead
        del torch._C._storage_Use_Count
        import os
        os.environ["MEMGATHER_NCCL_MIN_BYTES"] = "0"  # the fake backend given legacy NCCL's route: its threshold
        import memgather
        from benchmarks.overhead import treat_fake_as_legacy_nccl
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        treat_fake_as_legacy_nccl()  # memgather has no route for the fake backend
        memgather.all_gather([torch.empty(3) for _ in range(2)], torch.arange(3.0))
        print(json.dumps(dict(memgather.stats().fallbacks)))
        """
    ))


def _on_nccl(reason: str, backend: str, outcome: str) -> Counter:
    """``outcome(gather)`` (script text) under torch, then under memgather, on two ranks of
    ``backend`` sharing a CUDA device (tests/nccl_ranks.py), every call over the NCCL threshold;
    on every rank both must observe the same. Rank 0's fallbacks. Skips without CUDA: ``reason``
    is reachable only there."""
    if not nccl_ranks.available():
        pytest.skip(f"{reason} is reachable only on NCCL with a CUDA device")
    ranks = nccl_ranks.run("".join(textwrap.dedent(part) for part in (
        """
        import memgather
        """,
        outcome,
        """
        want = outcome(dist.all_gather)
        memgather.reset_stats()
        got = outcome(memgather.all_gather)
        print(json.dumps({"fallbacks": dict(memgather.stats().fallbacks), "same": got == want}))
        """,
    )), backend, env={"MEMGATHER_NCCL_MIN_BYTES": "0"})
    assert all(got["same"] for got in ranks), ranks
    return Counter(ranks[0]["fallbacks"])


def _input_not_contiguous(pools: Any) -> Counter:
    """A transposed input on NCCL (the route that reads the input as raw memory), two ranks.
    Only NCCL's route requires a contiguous input; test_routes.py checks the route table on CPU."""
    return _on_nccl("input_not_contiguous", "nccl", """
        def outcome(gather):
            given = (torch.arange(6.0, device="cuda") + RANK).view(2, 3).t()  # a transposed view: not contiguous
            slots = [torch.zeros(3, 2, device="cuda") for _ in range(WORLD)]
            try:
                gather(slots, given)
            except Exception as error:  # torch's NCCL may refuse a non-contiguous input: so must memgather
                return ["raise", type(error).__name__]
            torch.cuda.synchronize()
            return ["ok", [slot.tolist() for slot in slots]]
        """)


def _nccl2(pools: Any) -> Counter:
    """A gather on a ProcessGroupNCCL2 group (backend "nccl2", torch 2.14 on), twice: the first
    call describes the group (full path), the second is settled at once."""
    if compat.torch_release() < compat.NCCL2_OPT_IN_SINCE:
        pytest.skip(f"torch {torch.__version__} has no ProcessGroupNCCL2")
    counted = _on_nccl("nccl2", "nccl2", """
        def outcome(gather):
            results = []
            for _ in range(2):
                slots = list(torch.zeros(WORLD, 6, device="cuda").unbind(0))  # views of one buffer
                gather(slots, torch.arange(6.0, device="cuda") + RANK)
                results.append([slot.tolist() for slot in slots])
            return results
        """)
    assert counted == Counter({"nccl2": 2}), counted
    return counted


_BAD_ARGUMENTS = """
    import json
    exec(compile('import torch.distributed as dist\\n'
                 'def surplus(s, t): dist.all_gather(s, t, None, False, "surplus")\\n'
                 'def unknown(s, t): dist.all_gather(s, t, check=True)\\n'
                 'def twice(s, t): dist.all_gather(s, t, tensor=t)\\n'
                 'def missing(s, t): dist.all_gather(s)\\n'
                 'def not_a_group(s, t): dist.all_gather(s, t, 5)\\n', '<user>', 'exec'), user)
    def errors():
        seen = []
        for name in ("surplus", "unknown", "twice", "missing", "not_a_group"):
            try:
                user[name]([torch.empty(4), torch.empty(4)], torch.ones(4))
            except Exception as error:
                seen.append(f"{type(error).__name__}: {error}")
        return seen
    torchs = errors()
    memgather.patch(["user_code"], check=CHECK)
    print(json.dumps([torchs, errors(), dict(memgather.stats().fallbacks)]))
"""


def _bad_arguments(pools: Any) -> Counter:
    """Arguments torch's all_gather does not take, from a target (check off and on): torch's own
    TypeError, word for word; and a group that is not a process group, torch's own error."""
    _skip_without_fake_backend()
    counted: Counter = Counter()
    for check in (False, True):
        torchs, memgathers, fallbacks = json.loads(run_on_fake(_BAD_ARGUMENTS.replace("CHECK", str(check))))
        assert len(torchs) == 5 and memgathers == torchs
        counted.update(fallbacks)
    return counted


def _slot_written(pools: Any) -> Counter:
    """A CUDA slot something wrote since it was made (a graph's static tensor could be one): left to
    torch, whose call writes where the slot lies. Only CUDA asks; tests/test_cuda_memory.py decides it."""
    return _on_nccl("slot_written", "nccl", """
        def outcome(gather):
            slots = [torch.empty(6, device="cuda").fill_(-1.0) for _ in range(WORLD)]
            where = [slot.data_ptr() for slot in slots]
            gather(slots, torch.arange(6.0, device="cuda") + RANK)
            torch.cuda.synchronize()
            return [[slot.tolist(), slot.data_ptr() == at, slot._version] for slot, at in zip(slots, where)]
        """)


def _cuda_graphs(pools: Any) -> Counter:
    """Fresh CUDA slots in a process that captured a CUDA graph: left to torch (a graph's static
    tensors may be fresh too, and a replay would write into a freed block)."""
    return _on_nccl("cuda_graphs", "nccl", """
        static = torch.ones(4, device="cuda")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.mul_(2)
        def outcome(gather):
            slots = [torch.empty(6, device="cuda") for _ in range(WORLD)]
            where = [slot.data_ptr() for slot in slots]
            gather(slots, torch.arange(6.0, device="cuda") + RANK)
            torch.cuda.synchronize()
            return [[slot.tolist(), slot.data_ptr() == at] for slot, at in zip(slots, where)]
        """)


def _graph_capture(pools: Any) -> Counter:
    """A gather captured into a CUDA graph: left to torch, whose call capture records. Replayed,
    the graph must leave the slots as torch's captured call does."""
    return _on_nccl("graph_capture", "nccl", """
        def outcome(gather):
            given = torch.zeros(1 << 20, device="cuda")
            slots = [torch.empty_like(given) for _ in range(WORLD)]
            gather(slots, given)  # warm-up outside capture, as CUDA graphs require of NCCL
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                gather(slots, given)
            given.fill_(7.0 + RANK)
            graph.replay()
            torch.cuda.synchronize()
            return [slot.sum().item() for slot in slots]
        """)


def kept_by_a_mode(ctx: Any) -> Dict[str, Any]:
    """A gather on the broadcast route inside a TorchDispatchMode, torch's then memgather's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    def run(gather: Any) -> Any:
        slots = [torch.empty(BIG) for _ in range(ctx.world)]
        with Watching():
            gather(slots, torch.full((BIG,), float(ctx.rank)))
        return [s[0].item() for s in slots]

    want = run(dist.all_gather)
    memgather.reset_stats()
    got = run(memgather.all_gather)
    return {"same": got == want, "fallbacks": dict(memgather.stats().fallbacks)}


def _dispatch_mode(pools: Any) -> Counter:
    results = unwrap(pools(2).run(kept_by_a_mode))
    assert all(result["same"] for result in results), results
    return Counter(results[0]["fallbacks"])


def replaced_helper(ctx: Any) -> Dict[str, Any]:
    """A user's patch of one of torch's object-collective helpers: torch's own call runs it."""
    c10d = dist.distributed_c10d
    original = c10d._tensor_to_object
    seen: List[int] = []

    def patched(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return original(*args, **kwargs)

    c10d._tensor_to_object = patched
    try:
        memgather.reset_stats()
        out: List[Any] = [None] * ctx.world
        memgather.all_gather_object(out, {"rank": ctx.rank})
        return {"same": out == [{"rank": r} for r in range(ctx.world)], "ran_the_patch": len(seen) == ctx.world,
                "fallbacks": dict(memgather.stats().fallbacks)}
    finally:
        c10d._tensor_to_object = original


def _replaced(pools: Any) -> Counter:
    results = unwrap(pools(2).run(replaced_helper))
    assert all(result["same"] and result["ran_the_patch"] for result in results), results
    return Counter(results[0]["fallbacks"])


REACHES: Dict[Reason, Callable[[Any], Counter]] = {
    Reason.NOT_INITIALIZED: _not_initialized,
    Reason.NOT_IN_GROUP: _not_in_group,
    Reason.UNREGISTERED_GROUP: _unregistered_group,
    Reason.COMPILING: _compiling,
    Reason.COALESCING: _coalescing,
    Reason.GRAPH_CAPTURE: _graph_capture,
    Reason.SLOT_WRITTEN: _slot_written,
    Reason.CUDA_GRAPHS: _cuda_graphs,
    Reason.NO_PRIMITIVE: _no_primitive,
    Reason.BACKEND: partial(_bad_input, "meta_device"),
    Reason.NCCL2: _nccl2,
    Reason.BELOW_THRESHOLD: _below_threshold,
    Reason.UNSUPPORTED_DTYPE: partial(_bad_input, "refused_dtype"),
    Reason.TORCH_FUNCTION: partial(_bad_input, "input_torch_function"),
    Reason.DISPATCH_MODE: _dispatch_mode,
    Reason.FUNCTORCH: _functorch,
    Reason.FORWARD_AD: _forward_ad,
    Reason.BAD_ARGUMENTS: _bad_arguments,
    Reason.NOT_A_LIST: partial(_bad_input, "not_a_list"),
    Reason.WRONG_LENGTH: partial(_bad_input, "wrong_length"),
    Reason.NOT_A_TENSOR: partial(_bad_input, "input_not_a_tensor"),
    Reason.SLOT_SUBCLASS: partial(_bad_input, "slot_subclass"),
    Reason.UNSUPPORTED_LAYOUT: partial(_bad_input, "sparse_input"),
    Reason.EMPTY: _empty,
    Reason.DTYPE_MISMATCH: partial(_bad_input, "dtype_mismatch"),
    Reason.DEVICE_MISMATCH: partial(_bad_input, "device_mismatch"),
    Reason.UNEVEN_SLOTS: partial(_bad_input, "uneven_slots"),
    Reason.SLOT_REQUIRES_GRAD: partial(_bad_input, "slot_requires_grad"),
    Reason.INFERENCE_TENSOR: partial(_bad_input, "inference_slots"),
    Reason.DUPLICATE_SLOT: partial(_bad_input, "duplicate_slot"),
    Reason.INPUT_OVERLAPS_OUTPUT: partial(_bad_input, "input_is_other_rank_view"),
    Reason.INPUT_NOT_CONTIGUOUS: _input_not_contiguous,
    Reason.SLOT_NOT_CONTIGUOUS: partial(_bad_input, "permuted_slots"),
    Reason.SLOTS_SHARED: _slots_shared,
    Reason.SLOT_MEMORY: _slot_memory,
    Reason.CANNOT_PROVE_EXCLUSIVE: _cannot_prove_exclusive,
    Reason.PEER_FALLBACK: _peer_fallback,
    Reason.UNEVEN_RANKS: _uneven_ranks,
    Reason.REPLACED: _replaced,
}


@pytest.mark.parametrize("reason", list(Reason), ids=lambda reason: reason.value)
def test_every_reason_is_reached(pools: Any, reason: Reason) -> None:
    """Parametrized over the enum itself, so a reason added without an input fails here by name."""
    assert reason in REACHES, f"no input reaches {reason.value}: add one to REACHES, or drop the reason"
    counted = REACHES[reason](pools)
    assert counted[reason.value] >= 1, f"{reason.value} was not counted; memgather counted {dict(counted)}"
