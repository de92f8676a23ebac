"""The caller's output slots: viewing them as one region, or rebinding them to one.

Both functions return the flat ``(world * d0, *rest)`` tensor the collective
writes into (``(world,)`` for 0-d inputs); afterwards ``stacked(flat)[i]`` is
exactly the memory of slot ``i``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from memgather import compat
from memgather.engine import cuda_memory, pages


def flat_shape(shape: torch.Size, world: int) -> Tuple[int, ...]:
    """Shape of the single-tensor output: ranks concatenated along dim 0."""
    dims = len(shape)
    if dims == 1:  # the most frequent, built without slicing a Size: on every rebind
        return (world * shape[0],)
    if dims == 0:
        return (world,)
    return (world * shape[0], *shape[1:])


def stacked(flat: torch.Tensor, world: int, shape: torch.Size) -> torch.Tensor:
    """``flat`` seen as ``(world, *shape)``: one view per rank."""
    return flat.view(world, *shape)


def views(flat: torch.Tensor, world: int, shape: torch.Size) -> List[torch.Tensor]:
    """``stacked(flat)`` as a list: rank i's part of the buffer, a view each."""
    return list(stacked(flat, world, shape).unbind(0))


def region(slots: List[torch.Tensor]) -> torch.Tensor:
    """The flat tensor over the region that adjacent slots already tile."""
    first = slots[0]
    # Not a view of the first slot: a view would share its version counter, and an
    # async collective's write would bump it after memgather has set it as torch leaves it.
    return tensor_over(first, int(first.storage_offset()), flat_shape(first.shape, len(slots)))


def tensor_over(holder: torch.Tensor, offset: int, shape: Tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor of its own (not a view: its own version counter) over ``holder``'s storage."""
    tensor = holder.new()  # empty, of holder's dtype and device; never requires grad, so set_ records nothing
    tensor.set_(holder.untyped_storage(), offset, shape, contiguous_strides(shape))
    return tensor


def rebind(slots: List[torch.Tensor], parked: bool = False) -> torch.Tensor:
    """Replace the slots' storages by views of one new flat buffer.

    The old storages are released before the buffer is allocated, so the two
    never exist at once. If the release, the allocation or anything up to the
    slots' being its views fails, every slot gets a fresh tensor of its shape
    back before the exception propagates.

    ``parked``: the slots are plain CPU tensors of ``PARKING_KEYS`` (``parkable``), each released by
    pointing it at an empty tensor of its dtype (``.data =``), which leaves its version counter
    where it was; else by ``set_()``, which steps it.
    """
    first = slots[0]
    shape, dtype, device = first.shape, first.dtype, first.device
    # A contiguous slot has its shape's strides but on dims of size 1, where any stride is contiguous
    # (empty_like of a channels_last (N, C, 1, 1) keeps (C, 1, C, C)): each keeps its own, as under torch.
    own = [slot.stride() for slot in slots] if 1 in shape else None
    if first.is_cuda:  # before set_(): after it, the new storage would be recorded
        cuda_memory.release_on_current_stream(slots)
    try:
        if parked:
            park = _parks[dtype]  # (made by parkable(), which the plan asked)
            assert park is not None
            for slot in slots:
                slot.data = park  # drops the only reference to its storage: freed here
        else:
            for slot in slots:
                slot.set_()  # type: ignore[call-overload]  # drops the only reference to its storage: freed here
        flat = torch.empty(flat_shape(shape, len(slots)), dtype=dtype, device=device)
        total = flat.numel()
        if total * flat.element_size() >= pages.MIN_BYTES:  # (most rebinds are small: no call for them)
            pages.advise(flat)
        storage = flat.untyped_storage()
        strides = flat.stride() if len(shape) else ()  # a slot is flat's rows d0 at a time: same strides
        step = total // len(slots)
        for index, slot in enumerate(slots):
            slot.set_(storage, index * step, shape, strides if own is None else own[index])
    except BaseException:  # no slot is left released (nor parked): memory of its own, its shape's
        _reallocate(slots, shape, dtype, device, own)
        raise
    return flat


# Parking: a slot released by ``slot.data = park``, an empty tensor of its dtype, drops its storage as
# ``set_()`` does, but ``.data =`` is no in-place operation: the slot's version counter stays where it
# was. The one ``set_`` into the buffer that follows then steps each slot's counter once, as torch's
# list call does with its one copy into each slot (a counter two slots share, twice), and the counters
# need no setting back (``mark_written``). ``.data =`` also gives the slot the park's dispatch keys:
# only slots whose keys are the park's (``PARKING_KEYS``: a plain dense CPU tensor, not an inference
# tensor) are parked. Parks are memgather's own, one per dtype, and every slot parked in any call
# shares its park's storage while it is parked: code that runs in that window (a finalizer of a
# released storage, a tracer, another thread) could touch it. So a park's storage is one that
# cannot grow: 0 bytes that torch did not allocate (a DLPack import of an empty tensor), which
# refuses a resize as memory lent from elsewhere does; nothing can be written into it.
_parks: Dict[torch.dtype, Optional[torch.Tensor]] = {}


def _make_park(dtype: torch.dtype) -> Optional[torch.Tensor]:
    """An empty CPU tensor of ``dtype`` over a 0-byte storage that refuses to be resized; None where
    this torch makes none (a dtype DLPack does not carry)."""
    try:
        with torch.inference_mode(False), compat.outside_modes():  # plain, whatever mode the caller is in
            park = from_dlpack(to_dlpack(torch.empty(0, dtype=dtype, device="cpu")))
    except (RuntimeError, TypeError, BufferError, ValueError):
        return None
    storage = park.untyped_storage()
    return park if park.dtype == dtype and storage.nbytes() == 0 and not storage.resizable() else None


def _new_park(dtype: torch.dtype) -> Optional[torch.Tensor]:
    park = _make_park(dtype)
    keys = compat.dispatch_keys
    if park is None or keys is None or PARKING_KEYS is None:
        return None
    return park if keys(park) == PARKING_KEYS else None


def _parking_keys() -> Optional[Any]:
    """A plain CPU tensor's dispatch keys, where this torch parks as ``rebind`` relies on (probed: the
    counter left alone by ``.data =``, the keys kept, one step from the ``set_`` into a buffer); None
    where it does not, or has no read of dispatch keys: nothing is parked there."""
    keys = compat.dispatch_keys
    if keys is None:
        return None
    try:
        with torch.inference_mode(False), compat.outside_modes():
            probe, park, buffer = torch.ones(2), _make_park(torch.float32), torch.empty(2)
            if park is None:
                return None
            plain, before = keys(probe), probe._version
            probe.data = park
            parked = probe._version == before and keys(probe) == plain and probe.untyped_storage().nbytes() == 0
            probe.set_(buffer.untyped_storage(), 0, (2,), (1,))
            stepped = probe._version == before + 1 and keys(probe) == plain
    except (AttributeError, RuntimeError, TypeError):  # (torch 1.13 has no untyped storage: nor any rebind)
        return None
    return plain if parked and stepped else None


PARKING_KEYS = _parking_keys()


def parking(dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The empty tensor slots of ``dtype`` are parked on (made once per dtype; None: not parked)."""
    if dtype not in _parks:
        _parks.setdefault(dtype, _new_park(dtype))
    return _parks[dtype]


def parkable(slots: List[torch.Tensor]) -> bool:
    """Whether ``rebind(slots, parked=True)`` may park every slot: each has ``PARKING_KEYS``, and their
    dtype a park."""
    keys = compat.dispatch_keys
    if keys is None or PARKING_KEYS is None or not slots or not all(keys(slot) == PARKING_KEYS for slot in slots):
        return False
    return parking(slots[0].dtype) is not None


def fill_from(slots: List[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy rank i's part of ``flat`` into slot i, where the slot lies (any strides, any overlap, in
    rank order), as torch's list call leaves it."""
    with compat.subclass_hooks_off():  # memgather writing its own bytes: no subclass hook runs
        for slot, part in zip(slots, views(flat, len(slots), slots[0].shape)):
            # .data: the same memory with a version counter of its own, so that a copy made after the
            # call returned (an async call's) leaves the counters where mark_written put them
            slot.data.copy_(part)


def tile_their_storage(slots: List[torch.Tensor]) -> bool:
    """Adjacent slots that are, together, the whole of their storage and its only holders.

    Then the region they tile is a buffer as a rebind's is: starting at the
    storage's first byte, ending at its last, seen by nothing but the slots.
    """
    first = slots[0]
    size = len(slots) * first.numel() * first.element_size()
    return (
        compat.can_prove_alias_free()
        and compat.default_private_memory(first)  # as a rebind's buffer is: the result may not be shared, pinned...
        and first.storage_offset() == 0
        and first.untyped_storage().nbytes() == size
        and compat.storage_holders(first) == len(slots)
        and all(compat.held_only_by_python(slot) for slot in slots)
    )


def versions(slots: List[torch.Tensor]) -> List[int]:
    """The slots' version counters, read before memgather touches them (-1: an inference tensor has none)."""
    return [-1 if slot.is_inference() else slot._version for slot in slots]


def mark_written(slots: List[torch.Tensor], before: List[int]) -> None:
    """Leave the slots' version counters as the original all_gather does: one bump per slot.

    torch's list call copies into each slot in turn, so a counter that several
    slots share (views of one tensor, or a ``detach()`` set to a storage of its own)
    moves once per slot. memgather's own ``set_`` and copies bump the counters too;
    those are not writes torch would make, so the counters are first set back to
    ``before`` where torch allows it. Where this thread excludes the dispatch key
    that counts writes (``compat.writes_counted``), torch's call leaves them there.
    """
    if -1 in before:  # inference tensors among them: they have no counter to set or bump
        counted = [(slot, version) for slot, version in zip(slots, before) if version >= 0]
        slots, before = [slot for slot, _ in counted], [version for _, version in counted]
    compat.set_versions(slots, before)  # (does nothing where torch cannot)
    if compat.writes_counted():
        compat.increment_versions(slots)


def _reallocate(
    slots: List[torch.Tensor],
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    own: Optional[List[Tuple[int, ...]]],
) -> None:
    """Give each slot a fresh tensor of its shape back, with its own strides (``own``; None: its shape's),
    made and set outside any mode or transform (no ``torch.device`` mode may make them elsewhere)."""
    with compat.outside_modes():
        for index, slot in enumerate(slots):
            fresh = (
                torch.empty(shape, dtype=dtype, device=device)
                if own is None
                else torch.empty_strided(shape, own[index], dtype=dtype, device=device)
            )
            try:
                slot.set_(fresh)  # type: ignore[call-overload]  # set_(Tensor) exists; the stubs omit it
            except Exception:  # noqa: BLE001 - whatever refused set_ (forward AD, on a slot with a tangent)
                slot.data = fresh  # not dispatched: no slot is left without memory of its own


def contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The strides torch gives a new tensor of ``shape`` (``torch.empty(shape).stride()``)."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
