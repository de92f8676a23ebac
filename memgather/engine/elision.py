"""Cat / stack elision: after a rebind, ``torch.cat(slots, 0)`` can be the buffer itself.

After a rebind the slots are adjacent views of a buffer memgather allocated,
so concatenating them along dim 0 would only copy that buffer. When elision
is on for a call, the slots are *armed*: they get the ``ElidableSlot`` class
(same objects, only ``__class__`` changes). A slot is in one of three states:

- **armed** (``ElidableSlot``): reading metadata (``.shape``, ``.dtype``,
  ``size()``, ``data_ptr()``, ...) keeps it armed. ``torch.cat`` /
  ``torch.concat`` / ``torch.concatenate`` (dim 0) or ``torch.stack`` (dim 0)
  of exactly the gathered slots, in order, returns the buffer instead of a
  copy when ``_invisible`` proves the difference cannot be seen. Any other
  operation, and a cat that is not proven, turns every slot of the gather
  back into a plain tensor and then runs as torch would run it (other
  subclasses' ``__torch_function__`` included).
- **given** (``GivenSlot``): its buffer was handed out as a result. The first
  operation on it (other than reading metadata) gives it a private copy of its
  current values, outside every mode and transform, so writing into a slot
  after the cat, or keeping one for backward, never reaches the result.
  memgather's own gathers into given slots rebind them or copy them first.
- **plain** ``torch.Tensor``.

The rule checked at the cat (``_invisible``): the slots are still where the
rebind put them, none requires grad (torch.cat would record history), inference
mode is as it was at the gather, no dispatch mode is watching, and nothing but
the slots holds the buffer or the slots themselves (the storage's use count and
the Python count of its storage object; each slot's own C++ use count, which a
DLPack export, a saved tensor or a view's base raises).

What stays visible, and is why elision is on by default only at call sites
whose code is proven to drop the list (``memgather.patching.proof``): while the result lives, it and the not-yet-touched
slots share memory, so a write into the result (or freeing its storage) shows
in such a slot; so does a write into a slot by code that bypasses torch's
Python dispatch (a C extension, a raw pointer, TorchScript, a collective whose
``__torch_function__`` check looks only at its input). docs/elision.md
lists them.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten

from memgather import compat, cow
from memgather.engine import counters
from memgather.engine import slots as _slots

_GROUP = "_memgather_elision"
_CONCATS = (torch.cat, torch.concat, torch.concatenate)
# ids of live slots whose buffer a result now shares -> the finalizer that forgets them when they die
_given: Dict[int, "weakref.finalize"] = {}

# Reading these neither writes nor makes an alias: code commonly looks at its
# slots before concatenating them.
_METADATA_METHODS = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "dim",
        "size",
        "numel",
        "nelement",
        "ndimension",
        "element_size",
        "is_contiguous",
        "stride",
        "storage_offset",
        "get_device",
        "__len__",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "is_inference",
        "is_conj",
        "is_neg",
    )
)
_METADATA_PROPERTIES = frozenset(
    (
        "shape",
        "dtype",
        "device",
        "ndim",
        "layout",
        "requires_grad",
        "is_leaf",
        "grad_fn",
        "grad",
        "names",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_sparse_csr",
        "is_quantized",
        "is_mkldnn",
        "is_nested",
        "is_xpu",
        "is_mps",
        "itemsize",
        "nbytes",
        "output_nr",
        "_version",
    )
)


class _Group:
    """The slots of one rebind, the buffer they tile, and the gather's input.

    ``cow``: the cat's result will be a copy-on-write snapshot of the buffer (``memgather.cow``),
    so the slots are plain tensors again as soon as it is made, and one of them may have been
    replaced in the list by the gather's own input (``source``) where that input still holds the
    very bytes gathered from it.
    """

    __slots__ = ("flat", "refs", "parts", "live", "cow", "source")

    def __init__(self, flat: torch.Tensor, slots: List[torch.Tensor], tensor: Optional[torch.Tensor]) -> None:
        self.flat = flat
        self.refs = [weakref.ref(slot) for slot in slots]  # no cycle: slots hold the group, not back
        # Each slot's place in the buffer, in elements from its start, its shape and that shape's strides,
        # as armed: the slots of an even gather all have one shape (its strides worked out once), an
        # uneven gather's parts each their own rows.
        strides: Dict[Any, Any] = {}
        self.parts = []
        for slot in slots:
            if slot.shape not in strides:
                strides[slot.shape] = _slots.contiguous_strides(tuple(slot.shape))
            self.parts.append((slot.storage_offset() - flat.storage_offset(), slot.shape, strides[slot.shape]))
        self.live = True
        self.cow = cow.serves(flat)
        self.source = weakref.ref(tensor) if self.cow and type(tensor) is torch.Tensor else None

    def disarm(self) -> None:
        """Every slot of the group back to a plain tensor; no elision any more."""
        self.live = False
        self.flat = None  # type: ignore[assignment]  # memgather's hold on the buffer ends here
        for ref in self.refs:
            slot = ref()
            if slot is not None and type(slot) is ElidableSlot:
                _make_plain(slot)


class _WatchedSlot(torch.Tensor):
    """A slot memgather watches: metadata reads pass, anything else settles it first."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        if _is_metadata(func):
            with compat.subclass_hooks_off():
                return func(*args, **kwargs)
        if func in _CONCATS or func is torch.stack:
            result = _elide(func, args, kwargs)
            if result is not None:
                return result
        settle(tree_flatten((args, kwargs))[0])
        # The watched slots are plain now: dispatch afresh, as torch would have
        # dispatched the call, other subclasses' __torch_function__ included.
        return func(*args, **kwargs)


class ElidableSlot(_WatchedSlot):
    """A slot just rebound by memgather, armed for a cat; plain ``torch.Tensor`` again once used."""


class GivenSlot(_WatchedSlot):
    """A slot whose buffer an elided cat handed out; gets a private copy when first used."""


def arm(slots: List[torch.Tensor], flat: torch.Tensor, tensor: Optional[torch.Tensor] = None) -> None:
    """Let a later cat/stack of ``slots`` return ``flat`` (or, on the CPU, a copy-on-write snapshot of
    it): call right after a rebind, or a direct gather into slots that alone tile ``flat``'s whole
    storage. ``tensor``: the gather's input, which may stand in the cat for its own rank's slot."""
    if not compat.can_prove_alias_free():
        return  # this torch cannot show that nothing else holds the buffer: cat copies
    global _armed_ever
    _armed_ever = True
    group = _Group(flat, slots, tensor)
    for slot in slots:
        slot.__dict__[_GROUP] = group
        slot.__class__ = ElidableSlot


# Whether any slot was ever armed in this process: until then no slot can need settling.
_armed_ever = False


def may_need_settling() -> bool:
    """Whether some slot could be armed or given (cheap: the fallback path asks it on every call)."""
    return _armed_ever or bool(_given)


def watching() -> bool:
    """Whether any given slot is alive (cheap: the hot path asks it on every call)."""
    return bool(_given)


def any_given(slots: Sequence[torch.Tensor]) -> bool:
    """Whether any slot shares its buffer with a result handed out by elision."""
    return bool(_given) and any(id(slot) in _given for slot in slots)


def is_given(slot: torch.Tensor) -> bool:
    return id(slot) in _given


def release(slots: Sequence[torch.Tensor]) -> None:
    """Given slots become plain without a copy: the caller is about to rebind them (no write into the result)."""
    if not _given:
        return
    for slot in slots:
        if id(slot) in _given:
            _forget(slot)
            _make_plain(slot)


def settle(values: Iterable[Any]) -> None:
    """Make every watched slot among ``values`` plain before something else uses it.

    Armed slots take their whole gather along (no elision any more); given
    slots first get a private copy, so a write into them never reaches the result.
    """
    for value in values:
        if type(value) is ElidableSlot:
            disarm(value)
        elif type(value) is GivenSlot:
            _copy_out(value)


def settle_list(tensor_list: Any) -> None:
    """``settle`` the slots of an all_gather call, whatever the caller passed."""
    if isinstance(tensor_list, (list, tuple)):
        settle(tensor_list)


def disarm_reused(tensor_list: Any) -> None:
    """Armed slots gathered into again before any cat: plain again, and their gather's elision off.

    Done before a call is planned, so that the plan reads plain slots, and no hold of an
    earlier gather's buffer counts against the slots' own.
    """
    if _armed_ever and type(tensor_list) is list:
        for slot in tensor_list:
            if type(slot) is ElidableSlot:
                disarm(slot)


def disarm(slot: torch.Tensor) -> None:
    """Turn an armed slot (and the rest of its group) back into a plain tensor."""
    group = slot.__dict__.get(_GROUP)
    if group is not None:
        group.disarm()
    _make_plain(slot)


def _copy_out(slot: torch.Tensor) -> None:
    """Memory of its own for a given slot, same values, same version as before.

    Done outside every mode and transform: the copy is memgather's doing, not an
    operation of the program that a dispatch mode, a functorch transform or a
    tracer should see.
    """
    # An inference tensor may be set_ only in inference mode, whatever mode its next use runs in.
    with compat.outside_modes(), torch.no_grad(), torch.inference_mode(slot.is_inference()):
        if slot.untyped_storage().nbytes() < (slot.storage_offset() + slot.numel()) * slot.element_size():
            raise RuntimeError(
                "memgather: this slot shared its memory with the result of an elided torch.cat, and that "
                "result's storage was freed (resized); the slot's values are gone. Turn cat elision off "
                "for this caller (MEMGATHER_ELIDE=0, or patch(elide=False))"
            )
        version = -1 if slot.is_inference() else slot._version
        slot.set_(slot.clone())  # type: ignore[call-overload]  # set_(Tensor) exists; the stubs omit it
        if version >= 0:
            compat.set_version(slot, version)
    _forget(slot)
    _make_plain(slot)


def _forget(slot: torch.Tensor) -> None:
    finalizer = _given.pop(id(slot), None)
    if finalizer is not None:
        finalizer.detach()  # no finalizer piles up on slot objects that are gathered into again and again


def _is_metadata(func: Any) -> bool:
    if func in _METADATA_METHODS:
        return True
    owner = getattr(func, "__self__", None)  # a property getter: Tensor.<name>.__get__
    return getattr(func, "__name__", "") == "__get__" and getattr(owner, "__name__", "") in _METADATA_PROPERTIES


def _elide(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    with compat.subclass_hooks_off():  # inspecting the slots must not re-enter
        return _elide_plain(func, args, kwargs)


def _elide_plain(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    if len(args) > 2 or set(kwargs) - {"tensors", "dim"}:  # out=, or anything unexpected
        return None
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not tensors or type(dim) is not int:
        return None
    armed = next((t for t in tensors if type(t) is ElidableSlot), None)
    group = armed.__dict__.get(_GROUP) if armed is not None else None
    if group is None or not group.live or len(tensors) != len(group.refs):
        return None
    swapped = _swapped(group, tensors)
    if swapped is None:
        return None
    ndim = tensors[0].dim()
    if func is torch.stack:
        if dim not in (0, -(ndim + 1)) or any(shape != group.parts[0][1] for _, shape, _ in group.parts):
            return None  # torch.stack of parts of different rows raises: let it say so
    elif ndim == 0 or dim not in (0, -ndim):  # torch.cat refuses 0-d tensors: let it say so
        return None
    if not _invisible(group, tensors, swapped):
        return None
    return _hand_out(group, tensors, stacked=func is torch.stack)


# ``_swapped``'s answer where every tensor of the cat is its own slot.
_NONE_SWAPPED = -1


def _swapped(group: _Group, tensors: Sequence[torch.Tensor]) -> Optional[int]:
    """Where the cat's tensors are the group's slots in order: the index at which the gather's input
    stands instead of its slot (``_NONE_SWAPPED`` where none does); None where they are not."""
    swapped = _NONE_SWAPPED
    for index, (ref, tensor) in enumerate(zip(group.refs, tensors)):
        if ref() is tensor:
            continue
        source = group.source() if group.source is not None else None
        if swapped != _NONE_SWAPPED or source is None or tensor is not source:
            return None
        swapped = index
    return swapped


def _invisible(group: _Group, tensors: Sequence[torch.Tensor], swapped: int) -> bool:
    """Whether returning the buffer instead of torch.cat's copy can be told apart by anything at all."""
    return (
        _in_place(group, tensors, swapped)
        and not any(t.requires_grad for t in tensors)  # torch.cat would record autograd history
        and group.flat.is_inference() == torch.is_inference_mode_enabled()
        and not compat.dispatch_mode_active()  # a dispatch mode would miss the aten::cat
        and not compat.is_compiling()
        and _alias_free(group)
        and (swapped == _NONE_SWAPPED or _holds_what_was_gathered(group, tensors[swapped], swapped))
    )


def _in_place(group: _Group, tensors: Sequence[torch.Tensor], swapped: int = _NONE_SWAPPED) -> bool:
    """Each slot still is its view of the buffer (nobody has set_/resized it), with its shape's strides.

    torch.cat and torch.stack of tensors with their shape's strides give a result with its
    shape's strides, as the buffer has. Slots that are contiguous with other strides on dims
    of size 1 (channels_last (N, C, 1, 1)) give a result with strides of their kind: torch's
    copy makes it. The input standing in for its slot (``swapped``) must have the slots' dtype,
    device, shape and strides, as a plain tensor whose bytes are its values (no conjugate or
    negative bit).
    """
    flat = group.flat
    base = flat.data_ptr()
    for index, (t, (offset, shape, strides)) in enumerate(zip(tensors, group.parts)):
        if t.shape != shape or t.dtype != flat.dtype or t.stride() != strides:
            return False
        if index == swapped:
            if t.device != flat.device or t.is_conj() or t.is_neg():
                return False
        elif t.numel() == 0:  # an empty view has no data pointer: its place is its offset in the one storage
            if t.storage_offset() != flat.storage_offset() + offset or not _same_storage(t, flat):
                return False
        elif t.data_ptr() != base + offset * flat.element_size():
            return False
    return True


def _same_storage(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    return bool(tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr())


def _holds_what_was_gathered(group: _Group, source: torch.Tensor, index: int) -> bool:
    """Whether the gather's input, standing in the cat for its own slot, still holds the bytes the
    gather copied from it into the buffer: then the buffer is the concatenation, bit for bit.

    Compared as bytes (NaNs and signed zeros included), not trusted from a version counter, which
    ``.data`` writes, numpy and raw pointers leave alone. One read of twice a rank's part: no copy.
    """
    offset, shape, _ = group.parts[index]
    try:
        gathered = group.flat.view(-1)[offset : offset + shape.numel()]
        given = source.reshape(-1)
        for word in _WORDS:  # the widest integer both can be seen as: one pass, as fast as the memory reads
            try:
                return bool(torch.equal(gathered.view(word), given.view(word)))
            except RuntimeError:  # a size or an offset that is no multiple of the word: a narrower one
                continue
        return False
    except RuntimeError:  # a dtype that cannot be seen as bytes: the cat copies
        return False


# Integer dtypes to compare bytes as, widest first (every view of bytes as integers compares them exactly).
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _alias_free(group: _Group) -> bool:
    """Nothing but memgather's buffer tensor and the live slots holds the storage, and no C++ handle
    holds a slot (the one the input replaced in the list too, while it lives)."""
    live = [slot for slot in (ref() for ref in group.refs) if slot is not None]
    return compat.storage_holders(group.flat) == len(live) + 1 and all(compat.held_only_by_python(t) for t in live)


def _hand_out(group: _Group, tensors: Sequence[torch.Tensor], stacked: bool) -> Optional[torch.Tensor]:
    flat = group.flat
    if stacked:  # a tensor of its own over the buffer, as torch.stack's result is, not a view of flat
        result = _slots.tensor_over(flat, 0, (len(tensors), *tensors[0].shape))
    else:
        result = flat
    if group.cow:
        # A copy-on-write snapshot: a semantic copy, as torch.cat's result is. The slots are plain
        # again at once: whatever is done with them, or with the result, copies first where both live.
        try:
            with torch._C.DisableTorchFunction():  # memgather's doing: no mode sees it
                result = cow.snapshot(result)
        except RuntimeError:  # memory torch cannot share lazily (shared memory, another owner's): cat copies
            return None
    counters.record_elided()
    group.disarm()
    if group.cow:
        return result
    compat.set_version(result, 0)  # a fresh result, as torch.cat's
    for slot in tensors:
        slot.__class__ = GivenSlot
        _given[id(slot)] = _finalizer(slot, _given.pop, id(slot), None)
    return result


def _finalizer(obj: Any, callback: Any, *args: Any) -> "weakref.finalize":
    finalizer = weakref.finalize(obj, callback, *args)
    finalizer.atexit = False  # at interpreter exit there is nothing left to keep apart
    return finalizer


def _make_plain(slot: torch.Tensor) -> None:
    slot.__dict__.pop(_GROUP, None)
    slot.__class__ = torch.Tensor
