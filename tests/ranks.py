"""Functions that run on every rank of a pool (see tests/pool.py).

Each takes a RankContext first and returns plain data the test process can
assert on. Inputs are built deterministically from (seed, rank), so every rank
can also rebuild what the others sent.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import memgather
from memgather import compat, rss
from memgather.elision import GivenSlot

_groups: Dict[Tuple[int, ...], Any] = {}


def group_for(ranks: Optional[Tuple[int, ...]]) -> Any:
    """A subgroup, created once per pool (every rank calls new_group in the same order)."""
    if ranks is None:
        return None
    if ranks not in _groups:
        _groups[ranks] = dist.new_group(list(ranks))
    return _groups[ranks]


def make_input(dtype: torch.dtype, shape: Tuple[int, ...], seed: int, layout: str = "contiguous") -> torch.Tensor:
    """Deterministic data with special values.

    ``layout``: "contiguous"; "strided" (every other element of a larger
    tensor along the last dim: not dense); "permuted" (a transposed, dense
    view, as ``x.t()`` gives).
    """
    gen = torch.Generator().manual_seed(seed)
    full = list(shape)
    if layout == "strided" and full:
        full[-1] *= 2
    if layout == "permuted":
        full = full[::-1]
    data = _random(dtype, tuple(full), gen)
    if layout == "strided" and full:
        data = data[..., ::2]
    if layout == "permuted" and len(shape) > 1:
        data = data.permute(*reversed(range(len(shape))))
    return data


def _random(dtype: torch.dtype, shape: Tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        data = torch.randn(shape, generator=gen) * 100
        flat = data.view(-1)
        for index, special in enumerate((float("nan"), float("inf"), -0.0, float("-inf"))):
            if index < flat.numel():
                flat[index] = special
        return data.to(dtype)
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)


def as_bytes(t: torch.Tensor) -> bytes:
    """The tensor's values as raw bytes (NaN payloads and -0.0 included)."""
    if t.device.type == "meta":  # no bytes to read: shape and dtype are all there is
        return repr((tuple(t.shape), t.dtype)).encode()
    # A copy: exporting the tensor's own storage to numpy would mark it not resizable,
    # which memgather reads as "this memory means something where it is".
    flat = t.detach().reshape(-1).clone(memory_format=torch.contiguous_format)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def make_slots(kind: str, t: torch.Tensor, world: int, rank: int) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Output slots as real code builds them; returns (slots, input to pass)."""
    if kind == "empty_like":
        return [torch.empty_like(t) for _ in range(world)], t
    if kind == "zeros_like":
        return [torch.zeros_like(t) for _ in range(world)], t
    if kind == "ones_like":
        return [torch.ones_like(t) for _ in range(world)], t
    if kind == "clone":
        return [t.clone() for _ in range(world)], t
    if kind in ("views", "views_input_in_slot"):
        flat = torch.zeros((world * max(t.numel(), 1),), dtype=t.dtype)
        slots = [chunk.view(t.shape) for chunk in flat[: world * t.numel()].chunk(world)] if t.numel() else [
            torch.empty(t.shape, dtype=t.dtype) for _ in range(world)
        ]
        if kind == "views_input_in_slot" and t.numel():
            slots[rank].copy_(t)
            return slots, slots[rank]
        return slots, t
    raise ValueError(kind)


def storage_of(t: torch.Tensor) -> Any:
    """The tensor's storage object (torch 1.13 has only the typed one)."""
    return t.untyped_storage() if hasattr(torch.Tensor, "untyped_storage") else t.storage()


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's storage."""
    return storage_of(t).nbytes()


def differential(ctx: Any, cases: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Run each case unpatched and through memgather; report what differs."""
    return [_one_case(ctx, case) for case in cases]


def _one_case(ctx: Any, case: Dict[str, Any]) -> Dict[str, Any]:
    group = group_for(case["group"])
    member = case["group"] is None or ctx.rank in case["group"]
    world = len(case["group"]) if case["group"] else ctx.world
    grank = case["group"].index(ctx.rank) if case["group"] and member else min(ctx.rank, world - 1)
    dtype = getattr(torch, case["dtype"])
    t = make_input(dtype, tuple(case["shape"]), case["seed"] * 100 + ctx.rank, case["layout"])

    ref_slots, ref_input = make_slots(case["slots"], t, world, grank)
    ref_return, ref_raised = _call(dist.all_gather, ref_slots, ref_input, group, case["async"])

    slots, given = make_slots(case["slots"], t, world, grank)
    ids = [id(s) for s in slots]
    versions = [s._version for s in slots]
    before = [as_bytes(s) for s in slots]
    memgather.reset_stats()
    got_return, got_raised = _call(memgather.all_gather, slots, given, group, case["async"])
    snapshot = memgather.stats()
    if ref_raised or got_raised:
        return {"member": member, "raised": [ref_raised, got_raised]}
    # A rank outside the group must find its slots untouched (their bytes may
    # be uninitialised, so they cannot be compared with the reference's).
    expected_bytes = [as_bytes(a) for a in ref_slots] if member else before
    return {
        "member": member,
        "raised": [None, None],
        "equal": expected_bytes == [as_bytes(b) for b in slots],
        "meta_equal": [(a.shape, a.dtype) for a in ref_slots] == [(b.shape, b.dtype) for b in slots],
        "return_kind": (type(ref_return).__name__, type(got_return).__name__),
        "identity_kept": [id(s) for s in slots] == ids,
        "versions_bumped": all(s._version > v for s, v in zip(slots, versions)),
        "strategy": dict(snapshot.by_strategy),
        "route": dict(snapshot.by_route),
        "fallbacks": dict(snapshot.fallbacks),
        "one_buffer": len({compat.storage_ptr(s) for s in slots}) == 1,
    }


def _call(fn: Any, slots: List[torch.Tensor], given: torch.Tensor, group: Any, async_op: bool) -> Tuple[Any, Optional[str]]:
    """(what ``fn`` returned, None) or (None, the name of the exception it raised)."""
    try:
        result = fn(slots, given, group=group, async_op=async_op)
        if async_op and result is not None:
            result.wait()
    except Exception as error:  # noqa: BLE001 - torch's refusals are part of what is compared
        return None, type(error).__name__
    return result, None


class FunctionTensor(torch.Tensor):
    """A subclass that overrides __torch_function__ (and passes everything through)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


def _filled(rank: int, shape: Tuple[int, ...] = (3,), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape) + 100 * rank).to(dtype)


def _views(world: int, rank: int) -> List[torch.Tensor]:
    return list(torch.zeros(world * 3).view(world, 3).unbind(0))


# name -> builder(rank, world) returning (tensor_list, input, keepalive).
# Each builds what a caller could really pass; the keepalive holds references
# (views, storages) the case needs alive during the call.
BAD_INPUTS: Dict[str, Any] = {
    "not_a_list": lambda r, w: (tuple(torch.empty(3) for _ in range(w)), _filled(r), None),
    "wrong_length": lambda r, w: ([torch.empty(3) for _ in range(w + 1)], _filled(r), None),
    "slot_not_a_tensor": lambda r, w: ([torch.empty(3) for _ in range(w - 1)] + [[0.0, 0.0, 0.0]], _filled(r), None),
    "input_not_a_tensor": lambda r, w: ([torch.empty(3) for _ in range(w)], [1.0, 2.0, 3.0], None),
    "slot_subclass": lambda r, w: ([torch.nn.Parameter(torch.zeros(3), requires_grad=False) for _ in range(w)], _filled(r), None),
    "input_torch_function": lambda r, w: ([torch.empty(3) for _ in range(w)], _filled(r).as_subclass(FunctionTensor), None),
    "sparse_input": lambda r, w: ([torch.empty(3) for _ in range(w)], _filled(r).to_sparse(), None),
    "conj_input": lambda r, w: ([torch.empty(3, dtype=torch.complex64) for _ in range(w)], _filled(r, dtype=torch.complex64).conj(), None),
    "dtype_mismatch": lambda r, w: ([torch.empty(3, dtype=torch.float64) for _ in range(w)], _filled(r), None),
    "device_mismatch": lambda r, w: ([torch.empty(3, device="meta") for _ in range(w)], _filled(r), None),
    "meta_device": lambda r, w: ([torch.empty(3, device="meta") for _ in range(w)], torch.empty(3, device="meta"), None),
    "uneven_slots": lambda r, w: ([torch.empty(4) for _ in range(w)], _filled(r), None),
    "slot_requires_grad": lambda r, w: ([torch.zeros(3, requires_grad=True) for _ in range(w)], _filled(r), None),
    "inference_slots": lambda r, w: (_inference_slots(w), _filled(r), None),
    "duplicate_slot": lambda r, w: ([torch.zeros(3)] * w, _filled(r), None),
    "input_is_other_rank_view": lambda r, w: _input_in_wrong_view(r, w),
    "input_is_own_fresh_slot": lambda r, w: _input_is_fresh_slot(r, w),
    "slot_view_held": lambda r, w: _slot_with_view(r, w),
    "slot_storage_held": lambda r, w: _slot_with_storage(r, w),
    "permuted_slots": lambda r, w: ([torch.empty(3, 2).t() for _ in range(w)], _filled(r, (2, 3)), None),
    "overlapping_slots": lambda r, w: (_overlapping_slots(w), _filled(r), None),
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
    other.copy_(_filled(rank))
    return slots, other.view(3), None


def _inference_slots(world: int) -> List[torch.Tensor]:
    with torch.inference_mode():
        return [torch.zeros(3) for _ in range(world)]


def _input_in_wrong_view(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    views = _views(world, rank)
    other = views[(rank + 1) % world]
    other.copy_(_filled(rank))
    return views, other, None


def _input_is_fresh_slot(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    slots = [torch.zeros(3) for _ in range(world)]
    slots[rank].copy_(_filled(rank))
    return slots, slots[rank], None


def _slot_with_view(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    slots = [torch.zeros(3) for _ in range(world)]
    return slots, _filled(rank), slots[-1][1:]


def _slot_with_storage(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    slots = [torch.zeros(3) for _ in range(world)]
    return slots, _filled(rank), storage_of(slots[0])


def _outcome(fn: Any, build: Any, rank: int, world: int, **kwargs: Any) -> Tuple[str, Any]:
    slots, given, keep = build(rank, world)
    try:
        fn(slots, given, **kwargs)
    except Exception as error:  # noqa: BLE001 - the outcome is what we compare
        return ("raise", type(error).__name__)
    seen = keep if isinstance(keep, torch.Tensor) else None
    return ("ok", [as_bytes(s) for s in slots], as_bytes(seen) if seen is not None else None)


def compare_bad_input(ctx: Any, name: str) -> Dict[str, Any]:
    """Torch's outcome and memgather's for one BAD_INPUTS case, plus memgather's stats."""
    build = BAD_INPUTS[name]
    want = _outcome(dist.all_gather, build, ctx.rank, ctx.world)
    memgather.reset_stats()
    got = _outcome(memgather.all_gather, build, ctx.rank, ctx.world)
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
        return slots, _filled(rank, (numel,)), slots[0][:1] if rank == odd_on and odd == "view" else None

    want = _outcome(_waited(dist.all_gather, async_op), build, ctx.rank, ctx.world)
    memgather.reset_stats()
    got = _outcome(_waited(memgather.all_gather, async_op), build, ctx.rank, ctx.world)
    snapshot = memgather.stats()
    return {"want": want, "got": got, "strategy": dict(snapshot.by_strategy), "fallbacks": dict(snapshot.fallbacks)}


def _waited(function: Any, async_op: bool) -> Any:
    def call(slots: Any, given: Any) -> None:
        work = function(slots, given, async_op=async_op)
        if work is not None:
            work.wait()

    return call


def compare_mixed_dtypes(ctx: Any, numel: int, check: bool) -> Dict[str, Any]:
    """Ranks pass equal byte counts of different dtypes (a broken program torch lets through)."""

    def build(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
        dtype = torch.float32 if rank == 0 else torch.int32
        return [torch.zeros(numel, dtype=dtype) for _ in range(world)], _filled(rank, (numel,), dtype), None

    want = _outcome(dist.all_gather, build, ctx.rank, ctx.world)
    memgather.reset_stats()
    got = _outcome(memgather.all_gather, build, ctx.rank, ctx.world, check=check)
    return {"want": want, "got": got, "fallbacks": dict(memgather.stats().fallbacks)}


def uneven_check(ctx: Any, numel_by_rank: List[int]) -> Dict[str, Any]:
    """memgather with check=True where rank i passes numel_by_rank[i] elements."""
    numel = numel_by_rank[ctx.rank]
    slots = [torch.zeros(numel) for _ in range(ctx.world)]
    memgather.reset_stats()
    try:
        memgather.all_gather(slots, _filled(ctx.rank, (numel,)), check=True)
    except memgather.UnevenShapesError as error:
        return {"raised": True, "message": str(error), "shapes": [(list(s), str(d)) for s, d in error.shapes],
                "is_value_error": isinstance(error, ValueError)}
    return {"raised": False, "strategy": dict(memgather.stats().by_strategy),
            "correct": all(torch.equal(s, _filled(r, (numel,))) for r, s in enumerate(slots))}


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
    _, ref_raised = _call(dist.all_gather, ref, t, group, False)
    want = torch.stack(ref) if t.dim() == 0 else torch.cat(ref)
    memgather.reset_stats()
    try:
        got = memgather.gather(t, group=group)
    except Exception as error:  # noqa: BLE001 - where torch refuses the dtype, memgather must too
        return {"member": True, "raised": [ref_raised, type(error).__name__]}
    if ref_raised:
        return {"member": True, "raised": [ref_raised, None]}
    return {"member": True, "shape": list(got.shape), "want_shape": list(want.shape), "equal": as_bytes(got) == as_bytes(want),
            "routes": dict(memgather.stats().by_route)}


def async_work(ctx: Any, numel: int) -> Dict[str, Any]:
    """The returned work of an async rewired call, and the slots after wait()."""
    slots = [torch.zeros(numel) for _ in range(ctx.world)]
    memgather.reset_stats()
    work = memgather.all_gather(slots, _filled(ctx.rank, (numel,)), async_op=True)
    is_work = isinstance(work, dist.Work)
    work.wait()
    return {"is_work": is_work, "completed": work.is_completed(), "strategy": dict(memgather.stats().by_strategy),
            "correct": all(torch.equal(s, _filled(r, (numel,))) for r, s in enumerate(slots))}


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
    return {"growth": growth, "gathered": numel * 4 * ctx.world, "correct": correct,
            "strategy": dict(memgather.stats().by_strategy), "route": dict(memgather.stats().by_route)}


def direct_in_place(ctx: Any, numel: int) -> Dict[str, Any]:
    """Adjacent views of one buffer, the input in its own slot: written where they lie."""
    buffer = torch.zeros(ctx.world * numel)
    slots = list(buffer.view(ctx.world, numel).unbind(0))
    slots[ctx.rank].copy_(_filled(ctx.rank, (numel,)))
    pointers = [s.data_ptr() for s in slots]
    buffer_ptr = compat.storage_ptr(buffer)
    memgather.reset_stats()
    memgather.all_gather(slots, slots[ctx.rank])
    return {
        "strategy": dict(memgather.stats().by_strategy),
        "pointers_kept": [s.data_ptr() for s in slots] == pointers,
        "same_storage": compat.storage_ptr(buffer) == buffer_ptr,
        "correct": all(torch.equal(buffer.view(ctx.world, numel)[r], _filled(r, (numel,))) for r in range(ctx.world)),
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


def scoped_calls(ctx: Any, targets: List[str]) -> Dict[str, Any]:
    """Which callers memgather rewires under patch(targets)."""
    from tests.sites import from_import_caller, other_caller, target_caller

    result: Dict[str, Any] = {}
    memgather.patch(targets)
    try:
        for name, module in (("target", target_caller), ("other", other_caller), ("from_import", from_import_caller)):
            memgather.reset_stats()
            slots = module.gather(_filled(ctx.rank))
            result[name] = {"rewired": memgather.stats().rewired,
                            "correct": all(torch.equal(s, _filled(r)) for r, s in enumerate(slots))}
        memgather.reset_stats()
        objects = from_import_caller.gather_objects({"rank": ctx.rank})
        result["objects"] = {"rewired": memgather.stats().rewired, "correct": objects == [{"rank": r} for r in range(ctx.world)]}
        memgather.reset_stats()
        with memgather.disabled():
            target_caller.gather(_filled(ctx.rank))
        result["disabled"] = {"calls": memgather.stats().calls}
    finally:
        memgather.unpatch()
    memgather.reset_stats()
    target_caller.gather(_filled(ctx.rank))
    result["after_unpatch"] = {"calls": memgather.stats().calls}
    return result


def _gathered(ctx: Any, shape: Tuple[int, ...] = (4, 3), elide: bool = True, offset: int = 0) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(slots after an elision-armed memgather gather, the values torch would give)."""
    slots = [torch.empty(shape) for _ in range(ctx.world)]
    memgather.all_gather(slots, _filled(ctx.rank + offset, shape), elide=elide)
    return slots, [_filled(r + offset, shape) for r in range(ctx.world)]


def elision_cases(ctx: Any) -> Dict[str, Any]:
    """What cat/stack and friends return on armed slots, against plain torch."""
    out: Dict[str, Any] = {}

    def record(name: str, call: Any, reference: Any, shape: Tuple[int, ...] = (4, 3)) -> None:
        slots, want = _gathered(ctx, shape)
        base = slots[0].data_ptr()
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
            "equal": torch.equal(got, want_result) and got.shape == want_result.shape,
            "zero_copy": got.data_ptr() == base,
            "plain_result": type(got) is torch.Tensor,
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
    record("cat_reversed", lambda s: torch.cat(s[::-1]), lambda w: torch.cat(w[::-1]))
    record("cat_subset", lambda s: torch.cat(s[:1]), lambda w: torch.cat(w[:1]))
    record("cat_out", lambda s: torch.cat(s, out=torch.empty(ctx.world * 4, 3)), lambda w: torch.cat(w))
    record("cat_after_add", lambda s: (s[0].add_(1), torch.cat(s))[1], lambda w: (w[0].add_(1), torch.cat(w))[1])
    record("cat_after_read", lambda s: (s[0].shape, torch.cat(s))[1], lambda w: torch.cat(w))
    record("cat_scalars", lambda s: torch.cat(s), lambda w: torch.cat(w), shape=())
    record("stack_scalars", lambda s: torch.stack(s), lambda w: torch.stack(w), shape=())
    record("other_op", lambda s: s[1] * 2, lambda w: w[1] * 2)
    return out


def elision_off_by_default(ctx: Any) -> Dict[str, Any]:
    slots = [torch.empty(3) for _ in range(ctx.world)]
    memgather.all_gather(slots, _filled(ctx.rank))
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
    new_input = _filled(ctx.rank + 50, (4, 3))
    if second_call == "memgather":
        memgather.all_gather(slots, new_input)
    elif second_call == "memgather_fallback":  # a fallback: torch writes into the slots themselves
        memgather.all_gather(slots, new_input.as_subclass(FunctionTensor))
    elif second_call == "memgather_elide":
        memgather.all_gather(slots, new_input, elide=True)
        torch.cat(slots)
    return {
        "result_kept": torch.equal(result, kept),
        "slots_new": all(torch.equal(s, _filled(r + 50, (4, 3))) for r, s in enumerate(slots)),
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


def repeated_gathers(ctx: Any, count: int, elide: bool) -> Dict[str, Any]:
    """RSS before and after ``count`` rewired gathers (+ cat), and whether all were rewired."""
    t = _filled(ctx.rank, (1024,))

    def once() -> None:
        slots = [torch.empty_like(t) for _ in range(ctx.world)]
        memgather.all_gather(slots, t, elide=elide)
        torch.cat(slots)

    for _ in range(200):  # warm up allocator pools and caches
        once()
    import gc

    gc.collect()
    before = rss.current_bytes()
    memgather.reset_stats()
    for _ in range(count):
        once()
    gc.collect()
    return {"growth": rss.current_bytes() - before, "rewired": memgather.stats().rewired}


def _dies_within(probe: Any, seconds: float) -> bool:
    """Whether the weakly referenced object dies within ``seconds`` (the cyclic GC stays off).

    gloo's worker thread drops its reference to a finished broadcast's tensor a moment
    after ``wait()`` returns; a reference cycle, by contrast, would never let go here.
    """
    import time

    deadline = time.monotonic() + seconds
    while probe() is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def buffers_freed_without_gc(ctx: Any, numel: int, elide: bool) -> Dict[str, Any]:
    """Whether a gathered buffer dies as soon as its last holder goes, with the cyclic GC off.

    The probe is a weak reference to the buffer's storage object: torch keeps a
    storage's Python object alive exactly as long as the storage itself.
    """
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        t = torch.rand(numel)
        slots = [torch.empty_like(t) for _ in range(ctx.world)]
        memgather.reset_stats()
        memgather.all_gather(slots, t, elide=elide)
        result = torch.cat(slots)
        # After the cat (taking it before would disarm the slots), and without setting off a
        # given slot's copy-on-use: the probe is the storage the gather wrote into.
        with torch._C.DisableTorchFunctionSubclass():
            probe = weakref.ref(slots[0].untyped_storage())
            shares = result.untyped_storage().data_ptr() == slots[0].untyped_storage().data_ptr()
        del slots
        alive_with_result = probe() is not None
        del result
        alive_after_all = not _dies_within(probe, 10.0)
    finally:
        gc.enable()
    return {"shares": shares, "alive_with_result": alive_with_result, "alive_after_all": alive_after_all,
            "strategy": dict(memgather.stats().by_strategy)}


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
                t = _filled(ctx.rank + 10 * index + call, (64,))
                if index % 2:
                    with memgather.disabled():
                        slots = target_caller.gather_on(t, groups[index])
                else:
                    slots = target_caller.gather_on(t, groups[index])
                if not all(torch.equal(s, _filled(r + 10 * index + call, (64,))) for r, s in enumerate(slots)):
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
            slots = target_caller.gather(_filled(ctx.rank + call, (64,)))
            if not torch.equal(slots[0], _filled(call, (64,))):
                problems.append(f"call {call}: wrong data")
    finally:
        stop.set()
        thread.join(30)
    memgather.unpatch()
    consistent = dist.all_gather is dist.distributed_c10d.all_gather and not memgather.is_patched()
    return {"problems": problems, "consistent": consistent,
            "original_restored": dist.all_gather is memgather.core.original_all_gather()}


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


def compiled_gather(ctx: Any, backend: str) -> Dict[str, Any]:
    """torch.compile of a target module's function that calls dist.all_gather, memgather patched."""
    from tests.sites import target_caller

    torch._dynamo.reset()
    t = _filled(ctx.rank, (1 << 19,))  # 2 MiB: rewired when not compiled
    memgather.patch(["tests.sites.target_caller"])
    try:
        memgather.reset_stats()
        compiled = torch.compile(target_caller.gather, backend=backend)
        got = compiled(t)
        snapshot = memgather.stats()
    finally:
        memgather.unpatch()
    want = [_filled(r, (1 << 19,)) for r in range(ctx.world)]
    return {"correct": all(torch.equal(a, b) for a, b in zip(got, want)), "rewired": snapshot.rewired}


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
        memgather.all_gather(slots, _filled(ctx.rank, (3,)), group=group)
        got.append([s.tolist() for s in slots])
    want = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(want, _filled(ctx.rank, (3,)), group=group)
    return {"member": True, "same": got == [[s.tolist() for s in want]] * 2,
            "fallbacks": dict(memgather.stats().fallbacks)}


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
        given = _filled(ctx.rank, shape)
        slots = build(ctx.world, ctx.rank, given)
        memgather.reset_stats()
        work = memgather.all_gather(slots, given, async_op=async_op, elide=elide, verify=True)
        if work is not None:
            work.wait()
        stats = memgather.stats()
        joined = torch.cat(slots)  # elided where armed: the gathered buffer itself
        want = torch.cat([_filled(r, shape) for r in range(ctx.world)])
        out[name] = {"correct": torch.equal(joined, want), "strategy": dict(stats.by_strategy),
                     "verified": stats.verified}
    return out


def verify_catches(ctx: Any, shape: Tuple[int, ...], async_op: bool, corrupt_rank: int) -> Dict[str, Any]:
    """A route made to write one wrong element on ``corrupt_rank``: verify mode must
    raise VerifyError on every rank. Fault injection: the real route runs first."""
    from memgather import routes

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
        given = _filled(ctx.rank, shape)
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


def gloo_single_tensor_call(ctx: Any) -> Dict[str, Any]:
    """Whether gloo carries out torch's single-tensor all-gather here, and correctly when it does."""
    primitive = memgather.primitive().function
    out = torch.zeros(ctx.world * 3)
    try:
        primitive(out, _filled(ctx.rank))
    except RuntimeError as error:
        return {"works": False, "message": str(error)}
    return {"works": True, "correct": torch.equal(out, torch.cat([_filled(r) for r in range(ctx.world)]))}


# --- Slots whose memory a rebind would move away (Reason.SLOT_MEMORY) ---

def _shared_memory_slots(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    """Fresh slots, one moved to shared memory (``share_memory_()``, as DataLoader workers' tensors are)."""
    slots = [torch.zeros(3) for _ in range(world)]
    slots[0].share_memory_()
    return slots, _filled(rank), None


def _numpy_slots(rank: int, world: int) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
    """Fresh slots, the last over a NumPy array's memory; the keepalive, a second tensor over
    that array, shows whether the gathered bytes landed there, as they do under torch."""
    import numpy

    array = numpy.zeros(3, dtype=numpy.float32)
    slots = [torch.zeros(3) for _ in range(world - 1)] + [torch.from_numpy(array)]
    return slots, _filled(rank), torch.from_numpy(array)


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
