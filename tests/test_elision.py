"""Cat / stack elision on real gloo ranks: the buffer (or its copy-on-write snapshot), only when exactly right.

Each case runs twice where this torch has a copy-on-write clone (``memgather.cow``): as on
the CPU, where the result is a snapshot and the slots are plain at once, and as on CUDA
(``tests.ranks.without_cow``), where the result is the buffer itself and the slots are watched.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import memgather
from memgather import cow
from memgather.engine.elision import GivenSlot
from memgather.tools import rss
from tests.conftest import EAGER, unwrap
from tests.pool import RankPool
from tests.ranks import FunctionTensor, filled, handed_out, without_cow

# How an elided result is made: a copy-on-write snapshot where this torch has one, and the buffer itself.
HAND_OUTS = [True, False] if cow.works() else [False]

# What reading a slot's metadata may touch and still leave it armed, written out here (not read from
# memgather's tables, which a fault in them would change along with the cases).
METADATA_METHODS = ("dim", "size", "numel", "nelement", "ndimension", "element_size", "is_contiguous", "stride",
                    "storage_offset", "get_device", "__len__", "is_floating_point", "is_complex", "is_signed",
                    "is_inference", "is_conj", "is_neg")
METADATA_PROPERTIES = ("shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf", "grad_fn", "grad",
                       "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_sparse_csr", "is_quantized",
                       "is_mkldnn", "is_nested", "is_xpu", "is_mps", "itemsize", "nbytes", "output_nr", "_version")
_READ = METADATA_METHODS + tuple(a for a in METADATA_PROPERTIES if hasattr(torch.empty(0), a))
ELIDED = {f"cat_after_{name}" for name in _READ} | {"cat", "cat_dim0_kw", "cat_negative_dim", "concat", "concatenate", "cat_tuple", "stack", "stack_negative_dim",
          "cat_after_read", "stack_scalars", "cat_pooled", "stack_pooled"}
# Not exactly the slots, in order, along dim 0 into a new tensor; or a slot was used
# (written) first, which turns every slot back into a plain tensor.
COPIED = {"cat_dim1", "stack_dim1", "cat_dim1_kw", "stack_dim1_kw", "cat_after_a_data_alias", "cat_reversed", "cat_subset", "cat_out", "other_op", "cat_after_add",
          # Slots with other strides on dims of size 1 (channels_last (N, C, 1, 1)): torch's result has strides
          # of their kind, the buffer its shape's.
          "cat_pooled_channels_last", "stack_pooled_channels_last"}


@pytest.fixture(scope="module", params=HAND_OUTS, ids=lambda on: "copy_on_write" if on else "buffer")
def cases(pools: Any, request: Any) -> Any:
    return request.param, unwrap(pools(2, **EAGER).run(elision_cases, request.param))


@pytest.mark.parametrize("name", sorted(ELIDED | COPIED))
def test_same_values_as_torch_and_zero_copy_only_where_exact(cases: Any, name: str) -> None:
    copy_on_write, results = cases
    for result in results:
        got = result[name]
        assert got["equal"] and got["plain_result"], got
        assert got["zero_copy"] is (name in ELIDED), got
        assert got["version"] == 0 or name not in ELIDED, got  # a new tensor, as torch.cat's and torch.stack's
        # Slots sharing the handed-out buffer itself are watched (copied when next used); slots whose
        # buffer was snapshot copy-on-write are plain at once, as all the others are.
        assert got["slots_given"] if name in ELIDED and not copy_on_write else got["slots_plain"], got


def test_cat_of_scalars_raises_what_torch_raises(cases: Any) -> None:
    for result in cases[1]:
        assert result["cat_scalars"] == {"raised": True}
        assert result["cat_three_positional"] == {"raised": True}  # (out= is keyword-only: torch's TypeError)


def test_off_unless_asked(pools: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(elision_off_by_default)):
        assert result == {"plain": True, "copy": True}


def test_any_other_op_returns_plain_tensors_and_disarms(pools: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(elision_other_op_disarms_group)):
        assert result == {"plain_result": True, "all_plain": True, "cat_copies": True}


# Slots whose buffer a copy-on-write result shares are plain adjacent views: gathered into where they lie
# (their side gets memory of its own first, as on any write); slots watched for the result are rebound.
_AGAIN = {"direct": 1} if cow.works() else {"rebind": 1}


@pytest.mark.parametrize("second_call,strategy", [("memgather", _AGAIN), ("memgather_elide", _AGAIN),
                                                  ("memgather_fallback", {"fallback": 1})])
def test_result_keeps_its_values_when_the_slots_are_reused(pools: Any, second_call: str, strategy: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(elision_reuse, second_call)):
        assert result["result_kept"] and result["slots_new"], result
        assert result["strategy"] == strategy, result


def test_gather_plus_cat_peak_is_the_gathered_size(pools: Any) -> None:
    """48 MiB per rank: with elision the cat adds nothing; without it, a second gathered size."""
    on = unwrap(pools(2).run(elision_memory, 12 << 20, True))
    off = unwrap(pools(2).run(elision_memory, 12 << 20, False))
    for elided, copied in zip(on, off):
        assert elided["correct"] and copied["correct"]
        assert elided["growth"] <= 1.05 * elided["gathered"], elided
        assert copied["growth"] >= 1.8 * copied["gathered"], copied


def kept_slot_after_result_dies(ctx: Any, numel: int) -> Dict[str, Any]:
    """Keep one slot, drop the list and the elided result, use the slot: then only its memory stays, as under torch."""
    import gc

    import torch

    import memgather
    from memgather.tools import rss

    gc.collect()
    tracked = rss.track_allocations(True)  # freed blocks leave the resident set at once, whatever ran before
    before = rss.current_bytes()
    slots = [torch.empty(numel) for _ in range(ctx.world)]
    with without_cow():
        memgather.all_gather(slots, torch.full((numel,), float(ctx.rank)), elide=True)
        result = torch.cat(slots)
    elided = handed_out(result, slots[0])
    mine = slots[ctx.rank]
    del slots, result
    gc.collect()
    pinned = rss.current_bytes() - before  # the untouched slot still holds the whole buffer
    value = bool((mine == ctx.rank).all())  # its first use gives it its own copy: the buffer goes
    kept = _settled_growth(before, bound=int(1.5 * numel * 4))
    if tracked:
        rss.track_allocations(False)
    return {"elided": elided, "pinned": pinned, "kept": kept, "slot": numel * 4, "value": value}


def _settled_growth(before: int, bound: int) -> int:
    """Resident-set growth since ``before``, read until it is under ``bound`` or 2 s have passed:
    gloo's worker thread lets go of a finished call's tensors a moment late on a loaded machine."""
    import gc
    import time

    from memgather.tools import rss

    deadline = time.monotonic() + 2.0
    while True:
        gc.collect()
        grown = rss.current_bytes() - before
        if grown < bound or time.monotonic() > deadline:
            return grown
        time.sleep(0.01)


def test_a_kept_slot_holds_the_whole_buffer_until_first_used() -> None:
    """16 MiB per rank: the documented cost of forced elision where the result is the buffer itself
    (docs/elision.md), and where it ends.

    Ranks of their own: in the shared pool, what an earlier test's gloo calls free late
    (or keep) moved this process's resident set by several MiB during the measurement."""
    pool = RankPool(2, env=EAGER)
    try:
        results = unwrap(pool.run(kept_slot_after_result_dies, 4 << 20))
    finally:
        pool.close()
    for result in results:
        assert result["elided"] and result["value"], result
        assert result["pinned"] >= 1.8 * result["slot"], result
        assert result["kept"] < 1.5 * result["slot"], result


def gathered_again_then_cat(ctx: Any) -> Dict[str, Any]:
    """Slots rebound by one gather, used (so plain again), gathered into again, then concatenated."""
    import torch

    import memgather

    slots = [torch.empty(4, 3) for _ in range(ctx.world)]
    memgather.all_gather(slots, torch.full((4, 3), float(ctx.rank)), elide=True)
    first = [s.sum().item() for s in slots]  # uses the slots: no cat to elide this time
    memgather.reset_stats()
    memgather.all_gather(slots, torch.full((4, 3), float(ctx.rank + 10)), elide=True)
    result = torch.cat(slots)
    want = torch.cat([torch.full((4, 3), float(r + 10)) for r in range(ctx.world)])
    return {"first": first, "strategy": dict(memgather.stats().by_strategy), "equal": torch.equal(result, want),
            "zero_copy": handed_out(result, slots[0])}


def test_slots_that_alone_tile_their_buffer_are_armed_again(pools: Any) -> None:
    """The second gather writes where the slots lie (direct) and its cat still returns that buffer."""
    for result in unwrap(pools(2, **EAGER).run(gathered_again_then_cat)):
        assert result["strategy"] == {"direct": 1} and result["equal"] and result["zero_copy"], result


def test_every_cat_right_after_a_gather_is_elided(pools: Any) -> None:
    """torch keeps a Python list of a tensor it broadcast until gloo's worker lets go of the work:
    the route waits for that too, or about one cat in 200 found the buffer held once too often."""
    for result in unwrap(pools(2, **EAGER).run(gathers_then_cats, 1000)):
        assert result == {"elided": 1000}, result


# Run on every rank of a pool (tests/pool.py): each takes the rank's context first and
# returns plain data for the test above to assert on.


def gathers_then_cats(ctx: Any, calls: int) -> Dict[str, int]:
    elided = 0
    for _ in range(calls):
        slots, _want = _gathered(ctx)
        elided += handed_out(torch.cat(slots), slots[0])
    return {"elided": elided}


def _gathered(
    ctx: Any, shape: Tuple[int, ...] = (4, 3), elide: bool = True, offset: int = 0, layout: Any = torch.contiguous_format
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(slots after an elision-armed memgather gather, the values torch would give), of ``layout``."""
    slots = [torch.empty(shape).to(memory_format=layout) for _ in range(ctx.world)]
    memgather.all_gather(slots, filled(ctx.rank + offset, shape), elide=elide)
    return slots, [filled(r + offset, shape).to(memory_format=layout) for r in range(ctx.world)]


def elision_cases(ctx: Any, copy_on_write: bool) -> Dict[str, Any]:
    """What cat/stack and friends return on armed slots, against plain torch."""
    import contextlib

    with contextlib.nullcontext() if copy_on_write else without_cow():
        return _elision_cases(ctx)


def _elision_cases(ctx: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}

    def record(
        name: str, call: Any, reference: Any, shape: Tuple[int, ...] = (4, 3), layout: Any = torch.contiguous_format
    ) -> None:
        slots, want = _gathered(ctx, shape, layout=layout)
        try:
            got = call(slots)
        except Exception as error:  # noqa: BLE001
            try:
                reference(want)
            except Exception as expected:  # noqa: BLE001
                out[name] = {"raised": type(error).__name__ == type(expected).__name__}
                return
            raise
        want_result = reference(want)
        out[name] = {
            "equal": torch.equal(got, want_result) and (got.shape, got.stride()) == (want_result.shape, want_result.stride()),
            "zero_copy": handed_out(got, slots[0]),
            "plain_result": type(got) is torch.Tensor,
            "version": got._version,
            "slots_plain": all(type(s) is torch.Tensor for s in slots),
            "slots_given": all(type(s) is GivenSlot for s in slots),
        }

    record("cat", lambda s: torch.cat(s), lambda w: torch.cat(w))
    record("cat_dim0_kw", lambda s: torch.cat(tensors=s, dim=0), lambda w: torch.cat(w, 0))
    record("cat_negative_dim", lambda s: torch.cat(s, -2), lambda w: torch.cat(w, -2))
    record("concat", lambda s: torch.concat(s), lambda w: torch.concat(w))
    record("concatenate", lambda s: torch.concatenate(s, 0), lambda w: torch.concatenate(w, 0))
    record("cat_tuple", lambda s: torch.cat(tuple(s)), lambda w: torch.cat(tuple(w)))
    record("stack", lambda s: torch.stack(s), lambda w: torch.stack(w))
    record("stack_negative_dim", lambda s: torch.stack(s, -3), lambda w: torch.stack(w, -3))
    record("cat_dim1", lambda s: torch.cat(s, 1), lambda w: torch.cat(w, 1))
    record("stack_dim1", lambda s: torch.stack(s, 1), lambda w: torch.stack(w, 1))
    record("cat_dim1_kw", lambda s: torch.cat(s, dim=1), lambda w: torch.cat(w, 1))
    # .data is an alias, not metadata: read, it disarms the gather, so the alias never shares the result.
    record("cat_after_a_data_alias", lambda s: (lambda a: (torch.cat(s), a.add_(1))[0])(s[0].data),
           lambda w: (lambda a: (torch.cat(w), a.add_(1))[0])(w[0].data))
    record("cat_three_positional", lambda s: torch.cat(s, 0, torch.empty(0)), lambda w: torch.cat(w, 0, torch.empty(0)))
    record("stack_dim1_kw", lambda s: torch.stack(s, dim=1), lambda w: torch.stack(w, 1))
    record("cat_reversed", lambda s: torch.cat(s[::-1]), lambda w: torch.cat(w[::-1]))
    record("cat_subset", lambda s: torch.cat(s[:1]), lambda w: torch.cat(w[:1]))
    record("cat_out", lambda s: torch.cat(s, out=torch.empty(ctx.world * 4, 3)), lambda w: torch.cat(w))
    record("cat_after_add", lambda s: (s[0].add_(1), torch.cat(s))[1], lambda w: (w[0].add_(1), torch.cat(w))[1])
    record("cat_after_read", lambda s: (s[0].shape, torch.cat(s))[1], lambda w: torch.cat(w))
    for method in METADATA_METHODS:
        record(f"cat_after_{method}", lambda s, m=method: (getattr(s[0], m)(), torch.cat(s))[1], torch.cat)
    for attribute in [a for a in METADATA_PROPERTIES if hasattr(torch.empty(0), a)]:  # ("names": gone in torch 2.13)
        record(f"cat_after_{attribute}", lambda s, a=attribute: (getattr(s[-1], a), torch.cat(s))[1], torch.cat)
    record("cat_scalars", lambda s: torch.cat(s), lambda w: torch.cat(w), shape=())
    record("stack_scalars", lambda s: torch.stack(s), lambda w: torch.stack(w), shape=())
    record("other_op", lambda s: s[1] * 2, lambda w: w[1] * 2)
    pooled, channels_last = (2, 3, 1, 1), torch.channels_last
    record("cat_pooled", lambda s: torch.cat(s), lambda w: torch.cat(w), shape=pooled)
    record("stack_pooled", lambda s: torch.stack(s), lambda w: torch.stack(w), shape=pooled)
    record("cat_pooled_channels_last", lambda s: torch.cat(s), lambda w: torch.cat(w), pooled, channels_last)
    record("stack_pooled_channels_last", lambda s: torch.stack(s), lambda w: torch.stack(w), pooled, channels_last)
    return out


def elision_off_by_default(ctx: Any) -> Dict[str, Any]:
    slots = [torch.empty(3) for _ in range(ctx.world)]
    memgather.all_gather(slots, filled(ctx.rank))
    return {"plain": all(type(s) is torch.Tensor for s in slots), "copy": torch.cat(slots).data_ptr() != slots[0].data_ptr()}


def elision_other_op_disarms_group(ctx: Any) -> Dict[str, Any]:
    slots, want = _gathered(ctx)
    first = slots[0].sum()
    return {"plain_result": type(first) is torch.Tensor, "all_plain": all(type(s) is torch.Tensor for s in slots),
            "cat_copies": torch.cat(slots).data_ptr() != slots[0].data_ptr()}


def elision_reuse(ctx: Any, second_call: str) -> Dict[str, Any]:
    """A result obtained by elision keeps its values when the same slots are gathered into again."""
    slots, want = _gathered(ctx)
    result = torch.cat(slots)
    kept = result.clone()
    memgather.reset_stats()
    new_input = filled(ctx.rank + 50, (4, 3))
    if second_call == "memgather":
        memgather.all_gather(slots, new_input)
    elif second_call == "memgather_fallback":  # a fallback: torch writes into the slots themselves
        memgather.all_gather(slots, new_input.as_subclass(FunctionTensor))
    elif second_call == "memgather_elide":
        memgather.all_gather(slots, new_input, elide=True)
        torch.cat(slots)
    return {
        "result_kept": torch.equal(result, kept),
        "slots_new": all(torch.equal(s, filled(r + 50, (4, 3))) for r, s in enumerate(slots)),
        "strategy": dict(memgather.stats().by_strategy),
        "fallbacks": dict(memgather.stats().fallbacks),
    }


def elision_memory(ctx: Any, numel: int, elide: bool) -> Dict[str, Any]:
    """Peak RSS growth of gather + torch.cat, with elision on or off."""
    import gc

    t = torch.rand(numel)
    gc.collect()
    dist.barrier()
    rss.reset_peak()
    before = rss.current_bytes()
    slots = [torch.empty_like(t) for _ in range(ctx.world)]
    memgather.all_gather(slots, t, elide=elide)
    result = torch.cat(slots)
    del slots
    growth = rss.peak_bytes() - before
    correct = torch.equal(result[ctx.rank * numel:(ctx.rank + 1) * numel], t)
    del result
    gc.collect()
    dist.barrier()
    return {"growth": growth, "gathered": numel * 4 * ctx.world, "correct": correct}


def observers_after_the_cat(ctx: Any, elide: bool) -> Dict[str, Any]:
    """What code that outlives the cat sees of the slots: a callee that reads its caller's locals, a
    function mode around the cat that keeps its inputs, and DLPack and numpy exports of a slot, each
    after a write into the result (and, for the exports, a write through them)."""
    import sys

    from torch.overrides import TorchFunctionMode

    class Keeping(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.kept: List[Any] = []

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.cat:
                self.kept.append(list(args[0]))
            return func(*args, **(kwargs or {}))

    def callee_reading_the_caller() -> List[torch.Tensor]:
        return list(sys._getframe(1).f_locals["slots"])

    out: Dict[str, Any] = {}
    slots = [torch.empty(3) for _ in range(ctx.world)]
    memgather.all_gather(slots, filled(ctx.rank, (3,)), elide=elide)
    mode = Keeping()
    with mode:
        result = torch.cat(slots)
    out["elided"] = handed_out(result, slots[0])
    seen = callee_reading_the_caller()
    result.mul_(10)
    out["callee"] = [s.tolist() for s in seen]
    out["mode"] = [s.tolist() for s in mode.kept[0]]
    numpy_view = slots[0].numpy()
    numpy_view[:] = -1.0
    dlpack_view = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(slots[1]))
    dlpack_view.fill_(-2.0)
    out["result"] = result.tolist()
    out["slots"] = [s.tolist() for s in slots]
    return out


@pytest.mark.skipif(not cow.works(), reason="this torch has no copy-on-write clone")
def test_code_that_outlives_the_cat_sees_torchs_values(pools: Any) -> None:
    """Where the result is copy-on-write, each observer sees exactly what it sees without elision
    (the second run: memgather's gather, torch's cat copy), whatever was written where."""
    results = unwrap(pools(2, **EAGER).run(observers_after_the_cat, True))
    plain = unwrap(pools(2, **EAGER).run(observers_after_the_cat, False))
    for got, want in zip(results, plain):
        assert got["elided"] and not want["elided"], (got, want)
        assert {k: v for k, v in got.items() if k != "elided"} == {k: v for k, v in want.items() if k != "elided"}
        assert want["result"][:3] == [0.0, 10.0, 20.0] and want["slots"][0] == [-1.0] * 3, want


def grown_after_the_cat(ctx: Any, how: str, write_first: bool) -> Dict[str, Any]:
    """An elided cat's result grown afterwards, as torch lets a program grow any tensor: resized, an
    ``out=`` of another size, its storage freed and allocated again (as FSDP does with its buffers);
    ``write_first``: written once before it is grown."""
    import warnings

    from tests.sites import returned_lists

    memgather.patch(["tests.sites.returned_lists"])
    try:
        t = filled(ctx.rank, (4096,))
        memgather.reset_stats()
        result = returned_lists.gather_cat(t)
        elided = memgather.stats().elided
        try:
            if write_first:
                result.add_(0)
            if how == "resize":
                result.resize_(result.numel() + 3)
                result[-3:] = 7.0
            elif how == "same_size":
                result.untyped_storage().resize_(result.untyped_storage().nbytes())
            elif how == "out":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch warns that it resizes a non-empty out=
                    torch.add(torch.ones(3 * 4096), 1, out=result)
            else:
                nbytes = result.untyped_storage().nbytes()
                result.untyped_storage().resize_(0)
                result.untyped_storage().resize_(nbytes)
                result.fill_(3.0)
            result.add_(1)
        except RuntimeError as error:
            return {"elided": elided, "raised": str(error).splitlines()[0]}
        return {"elided": elided, "raised": None, "values": result.tolist()}
    finally:
        memgather.unpatch()


def grown_after_the_cat_under_torch(ctx: Any, how: str, write_first: bool) -> Dict[str, Any]:
    with memgather.disabled():
        return grown_after_the_cat(ctx, how, write_first)


@pytest.mark.parametrize("write_first", [True, False], ids=["written_first", "grown_first"])
@pytest.mark.parametrize("how", ["resize", "out", "storage", "same_size"])
def test_a_result_grown_after_the_cat(pools: Any, how: str, write_first: bool) -> None:
    """Written first, an elided result grows as torch's does. Grown before any write, on a torch whose
    copy-on-write cannot grow (2.12, 2.13: ``cow.grows()``), its next write fails torch's own assertion:
    the difference docs/elision.md names."""
    results = unwrap(pools(2, **EAGER).run(grown_after_the_cat, how, write_first))
    plain = unwrap(pools(2, **EAGER).run(grown_after_the_cat_under_torch, how, write_first))
    for got, want in zip(results, plain):
        assert got["elided"] == int(cow.works()) and want["elided"] == 0 and want["raised"] is None, (got, want)
        if write_first or cow.grows() or not cow.works():
            assert got == {**want, "elided": got["elided"]}
        else:
            assert got["raised"] and "ctx != nullptr" in got["raised"], got


def _cat_of_returned(x: torch.Tensor) -> Tuple[torch.Tensor, List[str]]:
    from tests.sites import returned_lists

    return torch.cat(returned_lists.gather_all(x)), []  # the returned list goes straight to one cat


def _slots_read_first(x: torch.Tensor) -> Tuple[torch.Tensor, List[str]]:
    from tests.sites import returned_lists

    gathered = returned_lists.gather_all(x)
    kinds = [type(slot).__name__ for slot in gathered]
    return torch.cat([slot * 1 for slot in gathered]), kinds


def returned_list_uses(ctx: Any, calls: int, cat: bool) -> Dict[str, Any]:
    """``calls`` gathers through a function that returns its list; the caller concatenates it (``cat``),
    or reads each slot first. Which strategy each call took, and what the caller got."""
    memgather.patch(["tests.sites.returned_lists"])
    try:
        taken, values, kinds = [], [], []
        for _ in range(calls):
            memgather.reset_stats()
            result, seen = (_cat_of_returned if cat else _slots_read_first)(filled(ctx.rank, (1 << 19,)))
            stats = memgather.stats()
            taken.append((dict(stats.by_strategy), stats.elided))
            values.append(float(result.sum()))
            kinds.append(seen)
        return {"taken": taken, "values": values, "kinds": kinds}
    finally:
        memgather.unpatch()


@pytest.mark.skipif(not cow.works(), reason="this torch has no copy-on-write clone")
def test_a_returned_list_is_armed_only_for_a_caller_proven_to_concatenate_it(pools: Any) -> None:
    """Rebound and its cat elided where the caller's code hands the returned list straight to one cat;
    where the caller reads the slots first, they are never armed: filled where they lie, plain tensors."""
    with_cat = unwrap(pools(2, **EAGER).run(returned_list_uses, 4, True))
    without = unwrap(pools(2, **EAGER).run(returned_list_uses, 4, False))
    for catted, read in zip(with_cat, without):
        assert catted["taken"] == [({"rebind": 1}, 1)] * 4, catted
        assert read["taken"] == [({"in_slots": 1}, 0)] * 4, read
        assert read["kinds"] == [["Tensor", "Tensor"]] * 4, read
        assert catted["values"] == read["values"]


def given_slots_lifecycle(ctx: Any, elide: bool) -> Dict[str, Any]:
    """Where the result is the buffer itself (CUDA's way: ``without_cow``), each thing a program may do to
    the slots after the cat: write one (its own memory first, its version as torch's), gather into them
    with torch (a caller memgather does not rewire), again with memgather, inference tensors, the result's
    storage freed, and the slots dropped (memgather forgets them)."""
    import gc

    from memgather.engine import elision

    out: Dict[str, Any] = {}
    memgather.patch(["tests.sites.no_such_module"])  # memgather's wrapper in place; this module not a target
    try:
        with without_cow():
            t = filled(ctx.rank, (4,))
            slots = [torch.empty(4) for _ in range(ctx.world)]
            memgather.all_gather(slots, t, elide=elide)
            before = [s._version for s in slots]
            result = torch.cat(slots)
            out["given"] = [type(s).__name__ for s in slots]
            out["watching"] = elision.watching()
            memgather.reset_stats()
            others = [torch.empty(4) for _ in range(ctx.world)]  # fresh slots, while the given ones live
            memgather.all_gather(others, t, elide=False)
            out["fresh_while_given"] = dict(memgather.stats().by_strategy)
            slots[0].add_(1)
            out["written"] = (result.tolist(), slots[0].tolist(), slots[0]._version - before[0],
                              type(slots[0]).__name__, elision.is_given(slots[0]))
            dist.all_gather(slots, t * 2)  # torch writes in place: never into the result
            out["torch_again"] = (result.tolist(), [s.tolist() for s in slots], [s._version - v for s, v in
                                                                                zip(slots, before)])
            memgather.reset_stats()
            memgather.all_gather(slots, t * 3, elide=elide)
            out["strategy_again"] = dict(memgather.stats().by_strategy)
            again = torch.cat(slots)
            out["memgather_again"] = (result.tolist(), again.tolist(), [s.tolist() for s in slots])
            with torch.inference_mode():
                frozen = [torch.empty(4) for _ in range(ctx.world)]
                memgather.all_gather(frozen, t, elide=elide)
                kept = torch.cat(frozen)
                frozen[1].mul_(5)
                out["inference"] = (kept.tolist(), frozen[1].tolist(), frozen[1].is_inference())
            # Given slots gathered into by memgather at once: rebound (nothing reaches the result), plain again.
            held = [torch.empty(4) for _ in range(ctx.world)]
            memgather.all_gather(held, t, elide=elide)
            first = torch.cat(held)
            memgather.reset_stats()
            memgather.all_gather(held, t * 5, elide=False)
            out["regathered_given"] = (first.tolist(), [s.tolist() for s in held], [type(s).__name__ for s in held],
                                       dict(memgather.stats().by_strategy), [elision.is_given(s) for s in held])
            lost = [torch.empty(4) for _ in range(ctx.world)]
            memgather.all_gather(lost, t, elide=elide)
            freed = torch.cat(lost)
            freed.untyped_storage().resize_(4)  # (shrunk, not emptied: one float left of the first slot's four)
            try:
                lost[0].add_(1)
                out["freed"] = ("returned", lost[0].tolist())
            except RuntimeError as error:
                out["freed"] = ("raised", str(error).split(";")[0])
            del slots, again, frozen, lost, result, kept, freed, others, held, first
            gc.collect()
            out["forgotten"] = not elision.watching()
    finally:
        memgather.unpatch()
    return out


def test_given_slots_keep_their_values_and_versions_as_torchs(pools: Any) -> None:
    """The result is the buffer (as on CUDA): every later use of a slot sees torch's values and versions."""
    elided = unwrap(pools(2, **EAGER).run(given_slots_lifecycle, True))
    plain = unwrap(pools(2, **EAGER).run(given_slots_lifecycle, False))
    for got, want in zip(elided, plain):
        assert got["given"] == ["GivenSlot", "GivenSlot"] and got["watching"], got
        assert want["given"] == ["Tensor", "Tensor"] and not want["watching"], want
        assert got["written"][3:] == ("Tensor", False), got
        # (The strategy of a gather into these slots depends on what the process kept of earlier calls at
        # this line: memgather's own, whichever it is, never torch's.)
        rewired = {"rebind", "parked_rebind", "direct", "in_slots"}
        assert got["regathered_given"][2] == ["Tensor", "Tensor"] and got["regathered_given"][4] == [False, False], got
        assert set(got["regathered_given"][3]) <= rewired and set(want["regathered_given"][3]) <= rewired, (got, want)
        for key in ("written", "torch_again", "memgather_again", "inference", "regathered_given"):
            assert got[key][:3] == want[key][:3], (key, got[key], want[key])
        assert want["freed"][0] == "returned", want
        assert got["freed"] == ("raised", "memgather: this slot shared its memory with the result of an elided "
                                          "torch.cat, and that result's storage was freed (resized)"), got
        assert got["forgotten"] and want["forgotten"], (got, want)
        # Fresh slots beside given ones are filled where they lie, as with none given.
        assert got["fresh_while_given"] == want["fresh_while_given"] == {"in_slots": 1}, (got, want)
        assert set(got["strategy_again"]) <= rewired and set(want["strategy_again"]) <= rewired, (got, want)


def gathered_again_before_the_cat(ctx: Any, copy_on_write: bool) -> Dict[str, Any]:
    """Armed slots gathered into again (by memgather) before any cat: the cat sees the second gather's
    values, as torch's does, and a stack of them too."""
    import contextlib

    with contextlib.nullcontext() if copy_on_write else without_cow():
        slots, _ = _gathered(ctx)
        memgather.reset_stats()
        memgather.all_gather(slots, filled(ctx.rank + 10, (4, 3)), elide=True)
        again = dict(memgather.stats().by_strategy)
        want = [filled(r + 10, (4, 3)) for r in range(ctx.world)]
        stacked = torch.stack(slots)
        return {"values": torch.equal(stacked, torch.stack(want)), "slots": all(torch.equal(s, w) for s, w in
                                                                                zip(slots, want)),
                "again": again, "elided": memgather.stats().elided}


@pytest.mark.parametrize("copy_on_write", HAND_OUTS, ids=lambda on: "copy_on_write" if on else "buffer")
@pytest.mark.parametrize("world", [1, 2])
def test_armed_slots_gathered_into_again_hold_the_second_gather(pools: Any, world: int, copy_on_write: bool) -> None:
    for got in unwrap(pools(world, **EAGER).run(gathered_again_before_the_cat, copy_on_write)):
        # Disarmed first, the slots are plain adjacent views of the first gather's buffer: gathered into
        # where they lie (direct), and the stack of them elided again.
        assert got == {"values": True, "slots": True, "again": {"direct": 1}, "elided": 1}, got


@pytest.mark.parametrize("copy_on_write", HAND_OUTS, ids=lambda on: "copy_on_write" if on else "buffer")
def test_a_world_of_one_gets_what_torch_gives(pools: Any, copy_on_write: bool) -> None:
    """One slot, the whole output: every cat and stack of it as torch's."""
    for results in unwrap(pools(1, **EAGER).run(elision_cases, copy_on_write)):
        for name, got in results.items():
            if "raised" in got:
                assert got["raised"], name
                continue
            assert got["equal"] and got["plain_result"], (name, got)


def own_entry_replaced(ctx: Any, change: str) -> Dict[str, Any]:
    """torchmetrics' way: the rank's own entry replaced by the gather's input before the cat. Elided
    only while that input still holds the bytes gathered from it, in the slot's shape."""
    t = filled(ctx.rank, (4, 3))
    slots = [torch.empty(4, 3) for _ in range(ctx.world)]
    memgather.all_gather(slots, t, elide=True)
    slots[ctx.rank] = t
    if change == "written":
        t.add_(1)
    elif change == "resized":
        t.resize_(2, 3)
    reference = [filled(r, (4, 3)) for r in range(ctx.world)]
    reference[ctx.rank] = t.clone()
    memgather.reset_stats()
    result = torch.cat(slots)
    return {"equal": torch.equal(result, torch.cat(reference)), "elided": memgather.stats().elided}


@pytest.mark.skipif(not cow.works(), reason="the input stands in for its slot only where the result is copy-on-write")
@pytest.mark.parametrize("change", ["none", "written", "resized"])
def test_an_own_entry_replaced_by_the_input_is_elided_only_while_it_holds_what_was_gathered(
    pools: Any, change: str
) -> None:
    for got in unwrap(pools(2, **EAGER).run(own_entry_replaced, change)):
        assert got == {"equal": True, "elided": 1 if change == "none" else 0}, (change, got)
