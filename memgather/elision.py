"""Cat / stack elision: after a rebind, ``torch.cat(slots, 0)`` is the buffer itself.

After a rebind the slots are adjacent views of a buffer memgather allocated,
so concatenating them along dim 0 would only copy that buffer. When elision
is on for a call, the slots get the ``ElidableSlot`` class (same objects,
only ``__class__`` changes) whose ``__torch_function__`` recognises exactly
``torch.cat`` / ``torch.concat`` / ``torch.concatenate`` (dim 0) and
``torch.stack`` (dim 0, a view) of those slots, in order, still laid out as
memgather left them, and returns the buffer instead of a copy. Any other
operation turns the slots back into plain tensors first and runs as usual;
so does the elided call itself.

The hazard: the result now shares memory with the slots. That is why
elision is on only for callers audited to drop the list after concatenating
it. A later memgather gather into slots whose buffer was handed out never
writes into it: those slots are rebound to a new buffer, or detached
(copied) before a fallback lets torch write into them.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Set

import torch

_GROUP = "_memgather_elision"
_CONCATS = (torch.cat, torch.concat, torch.concatenate)
_given: Set[int] = set()  # ids of live slots whose buffer a result now shares
# Metadata reads leave the slots armed (as do property reads like .shape):
# code commonly looks at its slots before concatenating them.
_READS = frozenset(
    getattr(torch.Tensor, name)
    for name in ("data_ptr", "dim", "size", "numel", "nelement", "ndimension", "element_size",
                 "is_contiguous", "stride", "storage_offset", "get_device", "__len__")
)


class _Group:
    """The slots of one rebind and the buffer they tile."""

    __slots__ = ("flat", "ids", "refs", "live")

    def __init__(self, flat: torch.Tensor, slots: List[torch.Tensor]) -> None:
        self.flat = flat
        self.ids = [id(slot) for slot in slots]
        self.refs = [weakref.ref(slot) for slot in slots]  # no cycle: slots hold the group, not back
        self.live = True

    def disarm(self) -> None:
        """Every slot of the group back to a plain tensor; no elision any more."""
        self.live = False
        for ref in self.refs:
            slot = ref()
            if slot is not None:
                _disarm(slot)


class ElidableSlot(torch.Tensor):
    """A slot just rebound by memgather; plain ``torch.Tensor`` again once used."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func in _CONCATS or func is torch.stack:
            result = _elide(func, args, kwargs)
            if result is not None:
                return result
        if func not in _READS and getattr(func, "__name__", "") != "__get__":
            _disarm_all(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def arm(slots: List[torch.Tensor], flat: torch.Tensor) -> None:
    """Let a later cat/stack of ``slots`` return ``flat`` (call right after a rebind)."""
    group = _Group(flat, slots)
    for slot in slots:
        slot.__dict__[_GROUP] = group
        slot.__class__ = ElidableSlot


def any_given(slots: Sequence[torch.Tensor]) -> bool:
    """Whether any slot shares its buffer with a result handed out by elision."""
    return bool(_given) and any(id(slot) in _given for slot in slots)


def is_given(slot: torch.Tensor) -> bool:
    return id(slot) in _given


def forget(slots: Sequence[torch.Tensor]) -> None:
    """The slots no longer share memory with a handed-out result (rebound or copied)."""
    if not _given:
        return
    for slot in slots:
        _given.discard(id(slot))


def detach(slots: Sequence[torch.Tensor]) -> None:
    """Give slots that share a handed-out buffer memory of their own (a copy) before torch writes into them."""
    for slot in slots:
        if isinstance(slot, torch.Tensor) and id(slot) in _given:
            slot.set_(slot.clone())  # type: ignore[call-overload]  # set_(Tensor) exists; the stubs omit it
            _given.discard(id(slot))


def _elide(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    with torch._C.DisableTorchFunctionSubclass():  # inspecting the slots must not re-enter
        return _elide_plain(func, args, kwargs)


def _elide_plain(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    if len(args) > 2 or set(kwargs) - {"tensors", "dim"}:  # out=, or anything unexpected
        return None
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not tensors or not isinstance(dim, int):
        return None
    group = getattr(tensors[0], "__dict__", {}).get(_GROUP)
    if group is None or not group.live or [id(t) for t in tensors] != group.ids or not _in_place(group, tensors):
        return None
    ndim = tensors[0].dim()
    if func is torch.stack:
        if dim not in (0, -(ndim + 1)):
            return None
        result = group.flat.view(len(tensors), *tensors[0].shape)
    else:
        if ndim == 0 or dim not in (0, -ndim):  # torch.cat refuses 0-d tensors: let it say so
            return None
        result = group.flat
    _hand_out(group, tensors)
    return result


def _in_place(group: _Group, tensors: Sequence[torch.Tensor]) -> bool:
    """Each slot still is its view of the buffer: nobody has set_/resized it."""
    flat = group.flat
    step = tensors[0].numel() * flat.element_size()
    base = flat.data_ptr()
    shape = tensors[0].shape
    return all(
        t.data_ptr() == base + index * step and t.shape == shape and t.dtype == flat.dtype and t.is_contiguous()
        for index, t in enumerate(tensors)
    )


def _hand_out(group: _Group, tensors: Sequence[torch.Tensor]) -> None:
    group.disarm()
    for slot in tensors:
        _given.add(id(slot))
        weakref.finalize(slot, _given.discard, id(slot))
    group.flat = None  # type: ignore[assignment]  # the caller owns it now


def _disarm_all(args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, ElidableSlot):
            _disarm_group(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, ElidableSlot):
                    _disarm_group(item)


def disarm(slot: torch.Tensor) -> None:
    """Turn an armed slot (and the rest of its group) back into a plain tensor."""
    _disarm_group(slot)


def _disarm_group(slot: torch.Tensor) -> None:
    group = slot.__dict__.get(_GROUP)
    if group is not None:
        group.disarm()
    _disarm(slot)


def _disarm(slot: torch.Tensor) -> None:
    slot.__dict__.pop(_GROUP, None)
    slot.__class__ = torch.Tensor
