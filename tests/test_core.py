"""memgather.all_gather / gather on real gloo ranks: check mode, gather(), async,
failure, memory, statistics."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import memgather
from memgather import compat
from memgather.tools import rss
from tests.conftest import EAGER, unwrap
from tests.ranks import as_bytes, call_each, filled, group_for, make_input, storage_bytes
from tests.releases import EMPTY_KILLS_GLOO, gloo_gathers_empty_tensors

BIG = 655360  # float32 elements: 2.5 MiB per rank, gloo's broadcast route

# What an async gloo call of fresh slots becomes on this torch (see test_releases):
# rebound where gloo has the single-tensor call and a slot can be proven to be
# its storage's only holder; left to torch otherwise.
ASYNC_FRESH = {"rebind": 1} if compat.gloo_has_single_tensor() and compat.can_prove_exclusive() else {"fallback": 1}
# A synchronous gloo call with elision asked for: rebound where that can be proven
# safe, else filled where the slots lie (the broadcasts write there either way).
ELIDED_FRESH = {"rebind": 1} if compat.can_prove_exclusive() else {"in_slots": 1}


@pytest.mark.parametrize("numel", [3, BIG], ids=["single-route", "broadcast-route"])
def test_check_raises_on_every_rank_naming_each_shape(pools: Any, numel: int) -> None:
    results = unwrap(pools(3).run(uneven_check, [numel, numel + 1, numel]))
    for result in results:
        assert result["raised"] and result["is_value_error"]
        assert result["shapes"] == [
            ([numel], "torch.float32"),
            ([numel + 1], "torch.float32"),
            ([numel], "torch.float32"),
        ]
        for rank, size in enumerate([numel, numel + 1, numel]):
            assert f"rank {rank}: ({size},) float32" in result["message"]


@pytest.mark.parametrize("subgroup", [(0, 1, 2), (0, 2)])
def test_small_gloo_calls_pass_through_before_and_after_the_group_is_known(pools: Any, subgroup: Any) -> None:
    for rank, result in enumerate(unwrap(pools(3).run(small_calls_twice, subgroup))):
        if rank in subgroup:
            assert result == {"member": True, "same": True, "fallbacks": {"below_threshold": 2}}
        else:
            assert result == {"member": False}


def test_check_passes_even_shapes_and_still_rewires(pools: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(uneven_check, [5, 5])):
        assert result == {"raised": False, "strategy": {"in_slots": 1}, "correct": True}


@pytest.mark.parametrize(
    "shape,dtype,subgroup",
    [
        ((), "float32", None),
        ((4, 3), "bfloat16", None),
        ((BIG,), "float32", None),
        ((2, 5), "int64", (0, 2)),
        ((0, 2), "float32", None),
    ],
)
def test_gather_equals_cat_of_all_gather(pools: Any, shape: Any, dtype: str, subgroup: Any) -> None:
    if 0 in shape and not gloo_gathers_empty_tensors():
        pytest.skip(EMPTY_KILLS_GLOO)
    for result in unwrap(pools(3).run(gather_result, shape, dtype, subgroup)):
        if result["member"] and "raised" in result:  # this torch's gloo refuses the dtype
            assert result["raised"][0] is not None and result["raised"][0] == result["raised"][1], result
        elif result["member"]:
            assert result["shape"] == result["want_shape"]
            assert result["equal"]
            if compat.can_set_version():  # a new tensor, as cat's: torch 1.13.1 cannot set it back
                assert result["versions"] == [0, 0], result
            # Small gathers take torch's single-tensor call where gloo has one (else torch's
            # list call, which records no route); big ones the broadcasts.
            small = {"single_staged": 1} if compat.gloo_has_single_tensor() else {}
            assert result["routes"] == ({"broadcast": 1} if shape == (BIG,) else small), result
            if small and shape != (BIG,):  # torch's single-tensor call into gather's own result
                assert result["strategies"] == {"into_result": 1}, result
        else:
            assert "not a member" in result["message"]


def test_gather_of_scalars_has_shape_world(pools: Any) -> None:
    for result in unwrap(pools(3).run(gather_result, (), "int32", None)):
        assert result["shape"] == [3]


@pytest.mark.parametrize("numel", [6, BIG], ids=["small", "broadcast"])
def test_gather_of_an_input_that_requires_grad_gives_what_cat_gives(pools: Any, numel: int) -> None:
    """torch.cat of torch's list never has a history; gather()'s small call once gave its result one
    (an in-place write under grad mode) and, now and then, autograd's in-place error from gloo's wait."""
    for result in unwrap(pools(2).run(gather_with_grad, numel, 60 if numel == 6 else 2)):
        assert result["errors"] == [] and result["history"] == [] and result["equal"], result
        small = "into_result" if compat.gloo_has_single_tensor() else "fallback"
        assert set(result["strategies"]) == {small if numel == 6 else "direct"}, result


def test_async_returns_torch_work_and_wait_completes(pools: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(async_work, 1000)):
        assert result == {"is_work": True, "completed": True, "strategy": ASYNC_FRESH, "correct": True}


def test_failed_collective_leaves_slots_valid(pools: Any) -> None:
    """A peer that never arrives: the error propagates, the slots stay allocated and shaped."""
    first, second = unwrap(pools(2, **EAGER).run(failure_after_rebind, 1000, timeout_s=120))
    assert second["skipped"]
    assert first["raised"] == "RuntimeError"
    # Where rebound, the storages were released before the failure. Under TORCH_DISTRIBUTED_DEBUG=DETAIL
    # the ranks agree on the single route first: that fails first, before a rebind.
    assert first["strategy"] == ({} if compat.collectives_checked() else ASYNC_FRESH)
    assert first["identity_kept"] and first["allocated"]
    assert first["shapes"] == [[1000], [1000]]


def test_direct_writes_in_place(pools: Any) -> None:
    for result in unwrap(pools(3, **EAGER).run(direct_in_place, 1000)):
        assert result == {"strategy": {"direct": 1}, "pointers_kept": True, "same_storage": True, "correct": True}


MIB = 1 << 20
MEMORY_NUMEL = 12 * MIB  # 48 MiB float32 per rank: beyond glibc's mmap threshold, so frees reach the OS


@pytest.mark.parametrize("elide", [True, False], ids=["rebind", "in-slots"])
def test_rebind_never_holds_old_slots_and_buffer_at_once(pools: Any, elide: bool) -> None:
    """Zero-filled (resident) slots: were they alive when the buffer is filled, RSS would grow by
    the gathered size; released first, it barely moves. (With elision asked for, the slots are
    rebound to one buffer; without, gloo's broadcasts fill them where they lie.)"""
    for result in unwrap(pools(2).run(peak_growth, MEMORY_NUMEL, "zeros_like", True, elide)):
        assert result["correct"] and result["strategy"] == (ELIDED_FRESH if elide else {"in_slots": 1})
        assert result["growth"] < 0.25 * result["gathered"], result


def test_rebind_peak_growth_is_the_gathered_size(pools: Any) -> None:
    """Fresh empty_like slots: torch grows by about 2x the gathered size, memgather by 1x."""
    ours = unwrap(pools(2).run(peak_growth, MEMORY_NUMEL, "empty_like", True, True))
    torchs = unwrap(pools(2).run(peak_growth, MEMORY_NUMEL, "empty_like", False, False))
    for mine, theirs in zip(ours, torchs):
        assert mine["correct"] and theirs["correct"]
        assert mine["route"] == {"broadcast": 1} and mine["strategy"] == ELIDED_FRESH
        assert mine["growth"] <= 1.05 * mine["gathered"], mine
        assert theirs["growth"] >= 1.5 * theirs["gathered"], theirs


def test_stats_are_typed_printable_and_reset() -> None:
    memgather.reset_stats()
    empty = memgather.stats()
    assert isinstance(empty, memgather.Stats)
    assert (empty.calls, empty.rewired, empty.bytes_saved) == (0, 0, 0)
    with pytest.raises(Exception) as torchs:
        torch.distributed.all_gather([torch.empty(1)], torch.ones(1))  # no process group in this process
    with pytest.raises(torchs.type):  # ValueError on torch 2.13, RuntimeError on 2.0
        memgather.all_gather([torch.empty(1)], torch.ones(1))
    snapshot = memgather.stats()
    assert snapshot.calls == 1 and snapshot.fallbacks == {"not_initialized": 1}
    assert "1 calls, 0 rewired" in str(snapshot) and "not_initialized=1" in str(snapshot)
    with pytest.raises(TypeError):
        snapshot.fallbacks["x"] = 1  # a snapshot, not a live view
    memgather.reset_stats()
    assert memgather.stats().calls == 0


def test_primitive_is_reported_with_its_reason() -> None:
    chosen = memgather.primitive()
    assert chosen.name == compat.single_tensor_primitive().name and chosen.name in chosen.reason
    assert chosen.torch_version == torch.__version__


@pytest.mark.parametrize("env", [{}, EAGER], ids=["default-threshold", "every-gloo-call-rewired"])
def test_no_warning_from_memgathers_own_calls(pools: Any, env: Any) -> None:
    """all_gather_into_tensor and _all_gather_base warn on torch 2.13: memgather must not call them.
    Every warning is recorded (FutureWarning and DeprecationWarning included), on every route."""
    for caught in unwrap(pools(2, **env).run(warnings_raised)):
        assert caught == []


@pytest.mark.parametrize(
    "shapes,dtypes,named",
    [
        ([[4, 3], [5, 3]], ["float32", "float32"], ["rank 0: (4, 3) float32", "rank 1: (5, 3) float32"]),
        ([[4, 3], [4, 2]], ["float32", "float32"], ["rank 0: (4, 3) float32", "rank 1: (4, 2) float32"]),
        ([[4, 3], [4, 3]], ["float32", "int32"], ["rank 0: (4, 3) float32", "rank 1: (4, 3) int32"]),
    ],
    ids=["first-dim", "trailing-dim", "dtype"],
)
def test_check_names_every_kind_of_unevenness(pools: Any, shapes: Any, dtypes: Any, named: Any) -> None:
    for result in unwrap(pools(2).run(uneven_inputs, shapes, dtypes, timeout_s=60)):
        assert result["raised"] and result["elapsed"] < 10
        for part in named:
            assert part in result["message"]


# Run on every rank of a pool (tests/pool.py): each takes the rank's context first and
# returns plain data for the test above to assert on.


def uneven_check(ctx: Any, numel_by_rank: List[int]) -> Dict[str, Any]:
    """memgather with check=True where rank i passes numel_by_rank[i] elements."""
    numel = numel_by_rank[ctx.rank]
    slots = [torch.zeros(numel) for _ in range(ctx.world)]
    memgather.reset_stats()
    try:
        memgather.all_gather(slots, filled(ctx.rank, (numel,)), check=True)
    except memgather.UnevenShapesError as error:
        return {
            "raised": True,
            "message": str(error),
            "shapes": [(list(s), str(d)) for s, d in error.shapes],
            "is_value_error": isinstance(error, ValueError),
        }
    return {
        "raised": False,
        "strategy": dict(memgather.stats().by_strategy),
        "correct": all(torch.equal(s, filled(r, (numel,))) for r, s in enumerate(slots)),
    }


def gather_with_grad(ctx: Any, numel: int, calls: int) -> Dict[str, Any]:
    """``calls`` gathers of a leaf that requires grad, under grad mode: errors, results with a history."""
    t = torch.arange(numel, dtype=torch.float32).add_(ctx.rank).requires_grad_()
    want = torch.cat([torch.arange(numel, dtype=torch.float32).add_(r) for r in range(ctx.world)])
    memgather.reset_stats()
    errors, history, equal = [], [], True
    for _ in range(calls):
        try:
            got = memgather.gather(t)
        except RuntimeError as error:
            errors.append(str(error)[:200])
            continue
        if got.requires_grad or got.grad_fn is not None:
            history.append(str(got.grad_fn))
        equal = equal and torch.equal(got.detach(), want)
    return {"errors": errors, "history": history, "equal": equal, "strategies": dict(memgather.stats().by_strategy)}


def gather_result(ctx: Any, shape: Tuple[int, ...], dtype_name: str, subgroup: Optional[Tuple[int, ...]]) -> Any:
    """memgather.gather vs torch.cat of torch's all_gather."""
    group = group_for(subgroup)
    if subgroup is not None and ctx.rank not in subgroup:
        try:
            memgather.gather(torch.ones(shape), group=group)
        except ValueError as error:
            return {"member": False, "message": str(error)}
        return {"member": False, "message": None}
    world = dist.get_world_size(group)
    t = make_input(getattr(torch, dtype_name), shape, 7 + ctx.rank)
    ref = [torch.empty_like(t) for _ in range(world)]
    _, ref_raised = call_each(dist.all_gather, ref, t, group, False)
    want = torch.stack(ref) if t.dim() == 0 else torch.cat(ref)
    memgather.reset_stats()
    try:
        got = memgather.gather(t, group=group)
    except Exception as error:  # noqa: BLE001 - where torch refuses the dtype, memgather must too
        return {"member": True, "raised": [ref_raised, type(error).__name__]}
    if ref_raised:
        return {"member": True, "raised": [ref_raised, None]}
    return {
        "member": True,
        "shape": list(got.shape),
        "want_shape": list(want.shape),
        "equal": as_bytes(got) == as_bytes(want),
        "routes": dict(memgather.stats().by_route),
        "strategies": dict(memgather.stats().by_strategy),
        "versions": [got._version, want._version],
    }


def async_work(ctx: Any, numel: int) -> Dict[str, Any]:
    """The returned work of an async rewired call, and the slots after wait()."""
    slots = [torch.zeros(numel) for _ in range(ctx.world)]
    memgather.reset_stats()
    work = memgather.all_gather(slots, filled(ctx.rank, (numel,)), async_op=True)
    is_work = isinstance(work, dist.Work)
    work.wait()
    return {
        "is_work": is_work,
        "completed": work.is_completed(),
        "strategy": dict(memgather.stats().by_strategy),
        "correct": all(torch.equal(s, filled(r, (numel,))) for r, s in enumerate(slots)),
    }


def failure_after_rebind(ctx: Any, numel: int) -> Dict[str, Any]:
    """Rank 0 gathers on a 2 s group that rank 1 never joins the gather of."""
    from datetime import timedelta

    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if ctx.rank != 0:
        return {"skipped": True}
    slots = [torch.zeros(numel) for _ in range(2)]
    ids = [id(s) for s in slots]
    memgather.reset_stats()
    try:  # async: the single route, where the slots are rebound before the collective runs
        memgather.all_gather(slots, torch.ones(numel), group=group, async_op=True).wait()
    except RuntimeError as error:
        raised = type(error).__name__
    else:
        raised = None
    return {
        "skipped": False,
        "raised": raised,
        "strategy": dict(memgather.stats().by_strategy),
        "identity_kept": [id(s) for s in slots] == ids,
        "shapes": [list(s.shape) for s in slots],
        "allocated": all(storage_bytes(s) >= s.numel() * s.element_size() for s in slots),
    }


def peak_growth(ctx: Any, numel: int, slots_kind: str, use_memgather: bool, elide: bool = False) -> Dict[str, Any]:
    """Peak RSS growth (bytes) during one gather, the peak reset right before it."""
    import gc

    t = torch.rand(numel)
    slots = [torch.empty_like(t) if slots_kind == "empty_like" else torch.zeros_like(t) for _ in range(ctx.world)]
    gc.collect()
    dist.barrier()
    rss.reset_peak()
    before = rss.current_bytes()
    memgather.reset_stats()
    if use_memgather:
        memgather.all_gather(slots, t, elide=elide)
    else:
        dist.all_gather(slots, t)
    growth = rss.peak_bytes() - before
    correct = torch.equal(slots[ctx.rank], t)
    del slots, t
    gc.collect()
    dist.barrier()
    return {
        "growth": growth,
        "gathered": numel * 4 * ctx.world,
        "correct": correct,
        "strategy": dict(memgather.stats().by_strategy),
        "route": dict(memgather.stats().by_route),
    }


def direct_in_place(ctx: Any, numel: int) -> Dict[str, Any]:
    """Adjacent views of one buffer, the input in its own slot: written where they lie."""
    buffer = torch.zeros(ctx.world * numel)
    slots = list(buffer.view(ctx.world, numel).unbind(0))
    slots[ctx.rank].copy_(filled(ctx.rank, (numel,)))
    pointers = [s.data_ptr() for s in slots]
    buffer_ptr = compat.storage_ptr(buffer)
    memgather.reset_stats()
    memgather.all_gather(slots, slots[ctx.rank])
    return {
        "strategy": dict(memgather.stats().by_strategy),
        "pointers_kept": [s.data_ptr() for s in slots] == pointers,
        "same_storage": compat.storage_ptr(buffer) == buffer_ptr,
        "correct": all(torch.equal(buffer.view(ctx.world, numel)[r], filled(r, (numel,))) for r in range(ctx.world)),
    }


def warnings_raised(ctx: Any) -> List[str]:
    """Warnings memgather's own calls trigger on every route (torch's FutureWarnings included)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Small calls (passthrough by default), the broadcast route, the single route (async).
        for numel, async_op in ((3, False), (3, True), (1 << 20, False), (1 << 20, True)):
            slots = [torch.empty(numel) for _ in range(ctx.world)]
            work = memgather.all_gather(slots, torch.ones(numel), async_op=async_op, check=not async_op)
            if work is not None:
                work.wait()
            memgather.gather(torch.ones(numel))
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def uneven_inputs(ctx: Any, shapes: List[List[int]], dtypes: List[str]) -> Dict[str, Any]:
    """check=True where rank i passes shapes[i] / dtypes[i] and its slots expect its own shape."""
    import time

    shape, dtype = tuple(shapes[ctx.rank]), getattr(torch, dtypes[ctx.rank])
    slots = [torch.zeros(shape, dtype=dtype) for _ in range(ctx.world)]
    started = time.monotonic()
    try:
        memgather.all_gather(slots, torch.ones(shape, dtype=dtype), check=True)
    except memgather.UnevenShapesError as error:
        return {"raised": True, "message": str(error), "elapsed": time.monotonic() - started}
    return {"raised": False}


def small_calls_twice(ctx: Any, subgroup: Tuple[int, ...]) -> Dict[str, Any]:
    """Two small gloo calls on a group memgather has not seen yet: the first takes the
    full path (and describes the group), the second the passthrough shortcut."""
    group = dist.new_group(list(subgroup))  # every rank calls new_group; a new one each time
    if ctx.rank not in subgroup:
        return {"member": False}
    world = dist.get_world_size(group)
    memgather.reset_stats()
    got = []
    for _ in range(2):
        slots = [torch.zeros(3) for _ in range(world)]
        memgather.all_gather(slots, filled(ctx.rank, (3,)), group=group)
        got.append([s.tolist() for s in slots])
    want = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(want, filled(ctx.rank, (3,)), group=group)
    return {
        "member": True,
        "same": got == [[s.tolist() for s in want]] * 2,
        "fallbacks": dict(memgather.stats().fallbacks),
    }


@pytest.mark.parametrize(
    "shape, layout",
    [((2, 3, 4, 5), torch.contiguous_format), ((2, 3, 1, 1), torch.contiguous_format), ((2, 3, 1, 1), torch.channels_last)],
)
def test_a_rebind_whose_buffer_cannot_be_allocated_gives_each_slot_its_shape_and_strides_back(
    monkeypatch: pytest.MonkeyPatch, shape: Tuple[int, ...], layout: torch.memory_format
) -> None:
    from memgather.engine import slots as slots_module

    made = [torch.empty(shape).to(memory_format=layout) for _ in range(2)]  # contiguous, as a rebind takes them
    before = [(s.shape, s.dtype, s.stride()) for s in made]
    empty, calls = torch.empty, []

    def out_of_memory_once(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("out of memory (the flat buffer)")
        return empty(*args, **kwargs)

    monkeypatch.setattr(slots_module.torch, "empty", out_of_memory_once)
    with pytest.raises(RuntimeError, match="the flat buffer"):
        slots_module.rebind(made)
    monkeypatch.undo()
    assert [(s.shape, s.dtype, s.stride()) for s in made] == before
    assert len({compat.storage_ptr(s) for s in made}) == 2  # a storage each, usable: written and read back
    for index, slot in enumerate(made):
        slot.fill_(index)
    assert [s.sum().item() for s in made] == [0.0, float(made[1].numel())]
