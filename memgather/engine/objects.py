"""torch's object collectives, each rank's pickled bytes moved at their own size, one part at a time.

The call path (every rank of the group makes the same collectives, decided from what all
of them hold after step 2)::

    1. pickle          each rank pickles its object with torch's ``_pickler`` into a BytesIO,
                       whose own buffer is the tensor that is sent (``object_bytes.Pickled``)
    2. agree           one all_reduce of a table of int64, one entry per rank: its byte count,
                       or PICKLE_FAILED, or TORCH_S_WAY (a Python mode on that rank would see
                       memgather's operations, not torch's)
    3. decide          any PICKLE_FAILED: every rank raises (the one that failed, its own
                       error), where torch would leave the others waiting for ever; any
                       TORCH_S_WAY: every rank makes torch's own call; else by parts
    4. by parts        for each rank in order: a broadcast from that rank into a buffer of
                       its size (its own bytes on that rank), the part read back by torch's
                       ``_unpickler`` from a view of that buffer, the buffer dropped
    5. hand over       the objects into the caller's list, in order, as torch assigns them

Memory (host, per rank): the objects read so far plus one part's bytes, and the rank's own
pickled bytes until its own part is read; torch holds every rank's bytes padded to the
largest, and copies each part twice more (``.numpy().tobytes()``, a slice) to read it. On
CUDA (NCCL) a part goes through device memory at its own size, one part at a time: the device
holds at most the largest part, where torch holds the world times the largest.

Collectives: one all_reduce and one broadcast per rank, where torch makes two all_gathers: the
same number at 2 ranks, more latency at many ranks with tiny objects (docs/objects.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from memgather import compat
from memgather.engine import core, counters, object_verification, routes
from memgather.engine.object_bytes import Pickled, received, unpickled
from memgather.engine.reasons import Reason, Strategy
from memgather.errors import ObjectPickleError

_log = logging.getLogger("memgather")

PICKLE_FAILED = -1
TORCH_S_WAY = -2

_c10d = dist.distributed_c10d
# torch's own functions, as imported: the fallbacks; and the helpers whose replacement (a mock, a
# user's patch) sends a call to torch's own function, which runs the replacement.
TORCH_ALL_GATHER_OBJECT = _c10d.all_gather_object
TORCH_GATHER_OBJECT = _c10d.gather_object
TORCH_BROADCAST_OBJECT_LIST = _c10d.broadcast_object_list
_TORCH_HELPERS = (
    "_object_to_tensor",
    "_tensor_to_object",
    "all_reduce",
    "broadcast",
    "get_world_size",
    "get_rank",
)
# Where torch's own functions (and the decorators it wraps them in) are defined.
_TORCH_DISTRIBUTED = os.path.dirname(os.path.abspath(_c10d.__file__))


def _torch_s_own(function: Any) -> bool:
    """Whether ``function`` is defined in torch.distributed's own code (not a mock, not a user's
    wrapper, however it names itself): the helpers torch's object collectives call, as torch made them."""
    code = getattr(function, "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(_TORCH_DISTRIBUTED + os.sep)


def refusal(group: Any) -> Optional[Reason]:
    """Why a call on ``group`` goes to torch's own function before anything is exchanged, from
    facts every rank of the group shares (the group, its backend, this torch, its helpers)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Reason.NOT_INITIALIZED  # torch raises its own error
    if compat.not_a_group(group) or compat.unregistered_group(group):
        return Reason.BACKEND
    if compat.rank_not_in_group(group):
        return Reason.NOT_IN_GROUP  # torch warns and returns
    if compat.is_compiling():
        return Reason.COMPILING
    if compat.is_coalescing(group):
        return Reason.COALESCING
    if not all(_torch_s_own(getattr(_c10d, name, None)) for name in _TORCH_HELPERS):
        return Reason.REPLACED
    if _device_type(group) not in ("cpu", "cuda"):
        return Reason.BACKEND
    return None


def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
    """``torch.distributed.all_gather_object``, each rank's bytes moved at their own size, one at a time.

    The same objects in ``object_list`` as torch's (each read back by torch's ``_unpickler``, this
    rank's own from its own pickled bytes), the same errors where torch raises; where an object
    fails to pickle on some rank, every rank raises (``ObjectPickleError`` on the others) where
    torch leaves them waiting.
    """
    why = refusal(group)
    if why is not None:
        counters.record_fallback(why.value)
        return TORCH_ALL_GATHER_OBJECT(object_list, obj, group)
    return _all_gather_object(object_list, obj, group)


def _all_gather_object(object_list: List[Any], obj: Any, group: Any) -> None:
    device = _device(group)
    world = _c10d.get_world_size(group)
    me = _c10d.get_rank(group)
    own, failure = _pickled(obj)
    sizes = _agree(own, failure, me, world, device, group)
    if TORCH_S_WAY in sizes and PICKLE_FAILED not in sizes:
        own = None
        counters.record_fallback(Reason.DISPATCH_MODE.value)
        return TORCH_ALL_GATHER_OBJECT(object_list, obj, group)
    _raise_on_failure(sizes, failure, "all_gather_object")
    assert own is not None
    placing = _Placing(object_list)
    if max(sizes) < _threshold():
        _padded(own, sizes, me, device, group, placing)
        counters.record(Strategy.OBJECT_PADDED.value, route="single_staged")
    else:
        _by_parts(own, sizes, me, device, group, placing)
        counters.record(Strategy.OBJECT_PARTS.value, route="broadcast")
    if core.settings().verify:

        def theirs() -> List[Any]:
            listed: List[Any] = [None] * world
            TORCH_ALL_GATHER_OBJECT(listed, obj, group)
            return listed

        _verify("all_gather_object", placing, theirs, me, world, device, group)
    placing.done()


def gather_object(
    obj: Any,
    object_gather_list: Optional[List[Any]] = None,
    dst: Optional[int] = None,
    group: Any = None,
    group_dst: Optional[int] = None,
) -> None:
    """``torch.distributed.gather_object``, each rank's bytes moved to ``dst`` at their own size, one at a time.

    As ``all_gather_object``, the objects read back on the destination alone; the other ranks
    hold their own bytes and, under NCCL, one part's bytes at a time on the device.
    """
    why = refusal(group) or _refusal_to_place(group)
    if why is not None:
        counters.record_fallback(why.value)
        return TORCH_GATHER_OBJECT(obj, object_gather_list, dst, group, group_dst)
    named, root = _root(group, dst, group_dst)
    if root is None:
        counters.record_fallback(Reason.BAD_ARGUMENTS.value)
        return TORCH_GATHER_OBJECT(obj, object_gather_list, dst, group, group_dst)
    group, group_dst = named, root
    me = group.rank()
    _c10d._validate_output_list_for_rank(me, group_dst, object_gather_list)  # torch's errors, before any collective
    device = _device(group)
    own, failure = _pickled(obj)
    sizes = _agree(own, failure, me, group.size(), device, group)
    if TORCH_S_WAY in sizes and PICKLE_FAILED not in sizes:
        own = None
        counters.record_fallback(Reason.DISPATCH_MODE.value)
        return TORCH_GATHER_OBJECT(obj, object_gather_list, None, group, group_dst)
    _raise_on_failure(sizes, failure, "gather_object")
    assert own is not None
    placing = _Placing(object_gather_list if me == group_dst else None)
    _by_parts(own, sizes, me, device, group, placing, to=group_dst)
    counters.record(Strategy.OBJECT_PARTS.value, route="broadcast")
    if core.settings().verify:

        def theirs() -> Optional[List[Any]]:
            listed: Optional[List[Any]] = [None] * group.size() if me == group_dst else None
            TORCH_GATHER_OBJECT(obj, listed, None, group, group_dst)
            return listed

        _verify("gather_object", placing, theirs, me, group.size(), device, group)
    placing.done()


def broadcast_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_src: Optional[int] = None,
) -> None:
    """``torch.distributed.broadcast_object_list``, one object's bytes at a time.

    The source pickles every object (the sizes go first, as torch's do), then sends them one by
    one, each dropped once sent; the others read each back from a buffer of its size, dropped
    before the next arrives. torch concatenates the source's bytes into one more copy and holds
    them all on every rank, on the device under NCCL, while it reads them back.
    """
    why = refusal(group) or _refusal_to_place(group) or (Reason.EMPTY if not object_list else None)
    if why is not None:
        counters.record_fallback(why.value)
        return TORCH_BROADCAST_OBJECT_LIST(object_list, src, group, device, group_src)
    named, root = _root(group, src, group_src)
    if root is None:
        counters.record_fallback(Reason.BAD_ARGUMENTS.value)
        return TORCH_BROADCAST_OBJECT_LIST(object_list, src, group, device, group_src)
    group, group_src = named, root
    me, world, count = group.rank(), group.size(), len(object_list)
    place = _device(group, device)
    parts: List[Pickled] = []
    failure: Optional[Exception] = None
    vetoed = _python_mode_on()
    if me == group_src and not vetoed:
        try:
            parts = [Pickled(obj) for obj in object_list]
        except Exception as raised:  # noqa: BLE001 - raised again after every rank has heard of it
            failure = raised
    mine = {count + me: TORCH_S_WAY if vetoed else 0}
    if me == group_src and not vetoed:
        mine.update((i, PICKLE_FAILED if failure is not None else parts[i].size) for i in range(count))
    entries = _exchanged(count + world, mine, place, group)
    sizes, marks = entries[:count], entries[count:]
    if PICKLE_FAILED not in sizes and TORCH_S_WAY in marks:
        parts = []
        counters.record_fallback(Reason.DISPATCH_MODE.value)
        return TORCH_BROADCAST_OBJECT_LIST(object_list, None, group, device, group_src)
    if failure is not None:
        raise failure
    if PICKLE_FAILED in sizes:
        raise ObjectPickleError("broadcast_object_list", [group_src])
    given = list(object_list) if core.settings().verify else []
    placing = _Placing(object_list if me != group_src else None)
    for first, last in _batches(sizes, _threshold()):
        batch = sizes[first:last]
        if me == group_src:
            view, part = _part(parts[first], batch[0]) if len(batch) == 1 else _joined(parts[first:last])
        else:
            view, part = received(sum(batch))
        _move(part, sum(batch), me == group_src, place, group, group_src, None)
        del part
        at = 0
        for size in batch:
            if me != group_src:
                placing.read(view[at : at + size])
            at += size
        del view
    counters.record(Strategy.OBJECT_PARTS.value, route="broadcast")
    if core.settings().verify:

        def theirs() -> Optional[List[Any]]:
            listed = given if me == group_src else [None] * count
            TORCH_BROADCAST_OBJECT_LIST(listed, None, group, device, group_src)
            return None if me == group_src else listed

        _verify("broadcast_object_list", placing, theirs, me, world, place, group)
    placing.done()


def _verify(
    collective: str, placing: "_Placing", theirs: Any, me: int, world: int, device: torch.device, group: Any
) -> None:
    """Verify mode: torch's own call made again, and what this rank received compared with it on
    every rank (``object_verification``); nothing compared where memgather's call raised, or where
    this rank receives nothing."""
    mine = placing.objects if placing.target is not None and placing.error is None else None
    object_verification.verify(collective, mine, theirs, me, world, device, group, _c10d.all_reduce)


def _root(group: Any, rank: Optional[int], group_rank: Optional[int]) -> "tuple[Any, Optional[int]]":
    """The group and its root's group rank, as torch's own call names them (rank 0 where neither is
    given; torch's ValueError where both are); None for a root outside the group, whose own
    collective torch's call then refuses on every rank."""
    group = _c10d._group_or_default_group(group)
    if rank is None and group_rank is None:
        rank = 0
    root = _c10d._canonicalize_group_rank(group, rank, group_rank, return_global=False)
    return group, root if 0 <= root < group.size() else None


def _refusal_to_place(group: Any) -> Optional[Reason]:
    """Why a rooted object collective goes to torch: this torch names its root other than memgather reads it."""
    needed = ("_group_or_default_group", "_canonicalize_group_rank", "_validate_output_list_for_rank")
    return Reason.NO_PRIMITIVE if not all(hasattr(_c10d, name) for name in needed) else None


def _pickled(obj: Any) -> "tuple[Optional[Pickled], Optional[Exception]]":
    """``obj`` pickled, or the error pickling it raised; TORCH_S_WAY's mark where a Python mode
    is on (it would see memgather's operations where torch's make the call)."""
    if _python_mode_on():
        return None, None
    try:
        return Pickled(obj), None
    except Exception as error:  # noqa: BLE001 - raised again after every rank has heard of it
        return None, error


def _python_mode_on() -> bool:
    """A Python mode that would see memgather's operations where torch's make the call; torch's own
    default-device mode (``torch.set_default_device``) is not one: every tensor here names its device."""
    return compat.dispatch_mode_active() or (compat.function_mode_active() and not compat.device_modes_only())


def _agree(
    own: Optional[Pickled], failure: Optional[Exception], me: int, world: int, device: torch.device, group: Any
) -> List[int]:
    """Every rank's entry (its byte count, PICKLE_FAILED or TORCH_S_WAY), by one all_reduce, which
    no mode sees (a rank whose mode sends every rank torch's way shows the mode torch's call alone)."""
    entry = own.size if own is not None else (PICKLE_FAILED if failure is not None else TORCH_S_WAY)
    return _exchanged(world, {me: entry}, device, group)


def _exchanged(length: int, entries: "dict[int, int]", device: torch.device, group: Any) -> List[int]:
    """A table of ``length`` int64, this rank's ``entries`` written in, summed over the group."""
    with compat.outside_modes():
        table = torch.zeros(length, dtype=torch.int64)
        for index, value in entries.items():
            table[index] = value
        table = table.to(device)
        _c10d.all_reduce(table, group=group)
        return table.tolist()


def _raise_on_failure(sizes: List[int], failure: Optional[Exception], what: str) -> None:
    if failure is not None:
        raise failure
    failed = [rank for rank, size in enumerate(sizes) if size == PICKLE_FAILED]
    if failed:
        raise ObjectPickleError(what, failed)


def _by_parts(
    own: Pickled,
    sizes: List[int],
    me: int,
    device: torch.device,
    group: Any,
    placing: "_Placing",
    to: Optional[int] = None,
) -> None:
    """Each rank's part moved in rank order (to every rank, or to group rank ``to`` alone) and read
    back where it arrives (``placing``; after its first error the remaining parts still move: the
    other ranks are waiting for them)."""
    arrives = to is None or to == me
    for rank, size in enumerate(sizes):
        view, part = _part(own, size) if rank == me else received(size) if arrives else (None, None)
        _move(part, size, rank == me, device, group, rank, to)
        del part
        if view is not None and arrives:
            placing.read(view)
        del view


def _padded(own: Pickled, sizes: List[int], me: int, device: torch.device, group: Any, placing: "_Placing") -> None:
    """Small parts (the largest under the threshold): one gather of every rank's bytes padded to the
    largest, as torch's, then each part read back from a view of the one host buffer."""
    largest, world = max(sizes), len(sizes)
    view, flat = received(world * largest)
    with compat.outside_modes():
        padded = torch.zeros(largest, dtype=torch.uint8)
        if own.tensor is not None:
            padded[: own.size] = own.tensor
        own.release()
        gathered = flat if device.type == "cpu" else torch.empty(world * largest, dtype=torch.uint8, device=device)
        slots = list(gathered.split(largest)) if largest else []
        if largest:
            core.original_all_gather()(slots, padded.to(device), group=group)
        if gathered is not flat:
            flat.copy_(gathered)
        del padded, gathered, slots, flat
    for rank, size in enumerate(sizes):
        placing.read(view[rank * largest : rank * largest + size])


def _threshold() -> int:
    """Bytes of the largest part from which each rank's part moves on its own (``MEMGATHER_GLOO_MIN_BYTES``,
    gloo's threshold, on every backend: under it one padded gather of small parts costs less time)."""
    return routes.gloo_threshold(core.settings().gloo_min_bytes)


def _part(own: Optional[Pickled], size: int) -> "tuple[memoryview, torch.Tensor]":
    """A part's bytes on the host: ``own``'s (which lets go of them here), or a new buffer of ``size``."""
    if own is None:
        return received(size)
    view, tensor = own.view, own.tensor
    own.release()
    assert view is not None
    return view, tensor if tensor is not None else torch.empty(0, dtype=torch.uint8, device="cpu")


def _move(
    part: Optional[torch.Tensor],
    size: int,
    sending: bool,
    device: torch.device,
    group: Any,
    root: int,
    to: Optional[int],
) -> None:
    """Group rank ``root``'s ``size`` bytes from its ``part`` into every other rank's ``part`` (None: a
    rank that does not keep it, ``to`` being another's), by one broadcast; through device memory on
    CUDA, one part at a time. Nothing moves where ``to`` is the root itself (its own part)."""
    if size == 0 or (to is not None and root == to):
        return  # nothing to move; a destination's own part stays where it is
    if device.type == "cpu":
        # A broadcast even where one rank alone keeps the part: point-to-point sends step only their two
        # ranks' sequence numbers, which torch's collective checks (TORCH_DISTRIBUTED_DEBUG=DETAIL) then
        # find out of step on the others.
        into = part if part is not None else torch.empty(size, dtype=torch.uint8, device="cpu")
        _c10d.broadcast(into, src=_global_rank(group, root), group=group)
        return
    sent = part.to(device) if sending and part is not None else torch.empty(size, dtype=torch.uint8, device=device)
    _c10d.broadcast(sent, src=_global_rank(group, root), group=group)
    if not sending and part is not None:
        part.copy_(sent)


class _Placing:
    """The objects read back, each placed into the caller's list (``target``; None: a rank that keeps
    nothing) as soon as it is read, as torch's loop reads and places them in rank order: the first
    error, reading or placing, ends the reading there; ``done`` raises it once every part has moved."""

    def __init__(self, target: Optional[Any]) -> None:
        self.target = target
        self.objects: List[Any] = []
        self.error: Optional[BaseException] = None

    def read(self, view: memoryview) -> None:
        if self.error is not None or self.target is None:
            return
        try:
            value = unpickled(view)
            self.objects.append(value)
            self.target[len(self.objects) - 1] = value
        except Exception as raised:  # noqa: BLE001 - raised by done(), once every part has moved
            self.error = raised

    def done(self) -> None:
        if self.error is not None:
            raise self.error


def _batches(sizes: List[int], limit: int) -> List["tuple[int, int]"]:
    """Consecutive objects taken together while their bytes stay under ``limit`` (one broadcast each
    batch); an object of ``limit`` or more goes alone."""
    batches: List["tuple[int, int]"] = []
    first, total = 0, 0
    for index, size in enumerate(sizes):
        if index > first and total + size > limit:
            batches.append((first, index))
            first, total = index, 0
        total += size
    batches.append((first, len(sizes)))
    return batches


def _joined(parts: List[Pickled]) -> "tuple[memoryview, torch.Tensor]":
    """Small parts' bytes in one new buffer (each part let go of as it is copied)."""
    view, tensor = received(sum(part.size for part in parts))
    at = 0
    for part in parts:
        view[at : at + part.size] = part.view if part.view is not None else b""
        at += part.size
        part.release()
    return view, tensor


def _device_type(group: Any) -> str:
    return str(_c10d._get_object_coll_device(group)).split(":")[0]


def _device(group: Any, given: Any = None) -> torch.device:
    """The device torch's object collectives use for ``group`` (``given``, where the caller names one),
    a CUDA device without an index being the current one, as torch's ``.to("cuda")`` takes it."""
    device = torch.device(given if given is not None else _c10d._get_object_coll_device(group))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _global_rank(group: Any, rank: int) -> int:
    if group is None or group is compat.default_group():
        return rank
    return dist.get_global_rank(group, rank)
