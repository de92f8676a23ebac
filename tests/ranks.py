"""What the per-rank bodies of several test modules share (see tests/pool.py).

Each test module keeps its own rank bodies beside its tests; here are the
helpers they share, and ``differential``, the body of the differential tests
(test_differential, test_soundness, test_fallbacks, test_releases, programs).
Inputs are built deterministically from (seed, rank), so every rank can also
rebuild what the others sent.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import memgather
from memgather import compat, cow

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
        slots = (
            [chunk.view(t.shape) for chunk in flat[: world * t.numel()].chunk(world)]
            if t.numel()
            else [torch.empty(t.shape, dtype=t.dtype) for _ in range(world)]
        )
        if kind == "views_input_in_slot" and t.numel():
            slots[rank].copy_(t)
            return slots, slots[rank]
        return slots, t
    raise ValueError(kind)


_is_cow = getattr(torch._C, "_is_cow_tensor", None)


def handed_out(result: torch.Tensor, slot: torch.Tensor) -> bool:
    """Whether an elided cat gave ``result``: a copy-on-write snapshot of the buffer ``slot`` lies in
    (both sides still copy-on-write: nothing has written either), or, where that is not served,
    the buffer itself. Read without a slot's hook (which a pointer read sets off) and without
    reading a pointer of a copy-on-write tensor (which copies it)."""
    with torch._C.DisableTorchFunctionSubclass():
        if _is_cow is not None and _is_cow(result):
            return bool(_is_cow(slot))
        return result.numel() > 0 and result.data_ptr() == slot.data_ptr()


@contextlib.contextmanager
def without_cow() -> Iterator[None]:
    """Elision in this process as where torch's copy-on-write does not serve (CUDA, an older torch):
    the buffer itself handed out, the slots watched until first used (``GivenSlot``)."""
    saved = cow._WHY_NOT
    cow._WHY_NOT = "switched off by a test"
    try:
        yield
    finally:
        cow._WHY_NOT = saved


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
    ref_return, ref_raised = call_each(dist.all_gather, ref_slots, ref_input, group, case["async"])

    slots, given = make_slots(case["slots"], t, world, grank)
    ids = [id(s) for s in slots]
    versions = [s._version for s in slots]
    before = [as_bytes(s) for s in slots]
    memgather.reset_stats()
    got_return, got_raised = call_each(memgather.all_gather, slots, given, group, case["async"])
    snapshot = memgather.stats()
    if ref_raised or got_raised:
        return {"member": member, "raised": [ref_raised, got_raised]}
    answers = [work_answers(ref_return, ref_slots), work_answers(got_return, slots)]
    # A rank outside the group must find its slots untouched (their bytes may
    # be uninitialised, so they cannot be compared with the reference's).
    expected_bytes = [as_bytes(a) for a in ref_slots] if member else before
    return {
        "member": member,
        "raised": [None, None],
        "equal": expected_bytes == [as_bytes(b) for b in slots],
        "meta_equal": [(a.shape, a.dtype, a.stride()) for a in ref_slots]
        == [(b.shape, b.dtype, b.stride()) for b in slots],
        "return_kind": (_kind(ref_return), _kind(got_return)),
        "work_answers": answers,
        "identity_kept": [id(s) for s in slots] == ids,
        "versions_bumped": all(s._version > v for s, v in zip(slots, versions)),
        "strategy": dict(snapshot.by_strategy),
        "route": dict(snapshot.by_route),
        "fallbacks": dict(snapshot.fallbacks),
        "one_buffer": len({compat.storage_ptr(s) for s in slots}) == 1,
    }


def _kind(returned: Any) -> str:
    # memgather's work object is a subclass of torch's (its result() answers with the slots)
    return "Work" if isinstance(returned, dist.Work) else type(returned).__name__


def work_answers(work: Any, slots: List[torch.Tensor]) -> Any:
    """What an async call's work answers, as a program can observe it: whether ``result()`` and the
    future's value are the slot objects themselves, and whose version a write through them steps."""
    if not isinstance(work, dist.Work):
        return None
    result, value = work.result(), work.get_future().wait()
    before = [s._version for s in slots]
    for tensor in result:
        tensor.copy_(tensor)  # a write through the result: the slot's own counter steps under torch
    return {
        "result_is_slots": [a is b for a, b in zip(result, slots)] + [len(result) == len(slots)],
        "value_is_slots": [a is b for a, b in zip(value, slots)] + [len(value) == len(slots)],
        "versions_stepped": [s._version - v for s, v in zip(slots, before)],
    }


def call_each(
    fn: Any, slots: List[torch.Tensor], given: torch.Tensor, group: Any, async_op: bool
) -> Tuple[Any, Optional[str]]:
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


def filled(rank: int, shape: Tuple[int, ...] = (3,), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape) + 100 * rank).to(dtype)


class OpRecorder(TorchDispatchMode):
    """A dispatch mode that records the name of every aten op it sees (a program's observation)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
