"""torch's own copy-on-write (``torch._lazy_clone``), as this torch behaves when probed at import.

A lazy clone shares its source's memory until either side is written: the first
write through torch copies the storage for the writer while the other side is
alive, and copies nothing once the other side is gone (the last holder takes the
memory over). Reads do not copy; anything that hands out a writable pointer
(``data_ptr()``, ``.numpy()``, a DLPack export) copies first where both sides live.

Cat elision returns such a snapshot of the gathered buffer in place of
``torch.cat``'s copy: a semantic copy, so nothing done after the cat, to the
result or to the slots, can show that they began as one memory
(``memgather.engine.elision``). It is used only where the probe below saw every
one of those properties on this torch, on the CPU; on CUDA torch's rules add
streams and graph capture, and elision keeps its watched slots there.

The probe runs once, at import, on a few bytes, outside every mode: a torch that
lacks the function or behaves otherwise in any respect probed gets ``works()``
False, and elision then never relies on it.

One more fact is probed apart, when first asked (``grows``): whether a
copy-on-write storage that is resized (``resize_`` past its size, an ``out=`` of
another size, a storage freed and allocated again, even resized to its own size)
can be written afterwards. On torch 2.12 and 2.13 it cannot: its next write, and
anything that hands out a pointer to it, fails an internal assertion of torch's
(``ctx != nullptr``, COW.cpp) unless it was written before the resize, even once
the other side is gone. Nothing memgather can do from Python takes the memory over at the right
moment (a storage's finalizer runs while its memory is still shared), so this
stays a difference of an elided cat's result, said in docs/elision.md and by
``memgather doctor``.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

_log = logging.getLogger("memgather")

_lazy_clone: Optional[Callable[[torch.Tensor], torch.Tensor]] = getattr(torch, "_lazy_clone", None)
_is_cow: Optional[Callable[[torch.Tensor], bool]] = getattr(torch._C, "_is_cow_tensor", None)


def _probe() -> str:
    """Why this torch's lazy clone is not the copy-on-write elision needs ("" where it is)."""
    if _lazy_clone is None or _is_cow is None:
        return "this torch has no torch._lazy_clone"
    # The buffer and its slots (views) on one side, the clone on the other, as at an elided cat.
    buffer = torch.arange(8, dtype=torch.float32)
    slots = [buffer[0:4], buffer[4:8]]
    start = buffer.untyped_storage().data_ptr()
    clone = _lazy_clone(buffer)
    if not (_is_cow(clone) and _is_cow(slots[0])):
        return "torch._lazy_clone did not make a copy-on-write pair"
    if clone._base is not None or clone._version != 0 or clone.grad_fn is not None or clone.shape != buffer.shape:
        return "torch._lazy_clone's result is not a fresh tensor of the source's shape"
    if not torch.equal(clone, buffer):
        return "torch._lazy_clone's result differs from its source"
    # A write into one slot copies for the slots' side alone; the clone keeps the values.
    slots[0].add_(1)
    if clone[0].item() != 0 or slots[0][0].item() != 1 or _is_cow(slots[1]):
        return "a write into the source reached the clone"
    own = buffer.untyped_storage().data_ptr()  # the slots' side has memory of its own now: no copy made here
    # A write into the clone copies for the clone alone.
    other = _lazy_clone(buffer)
    other.add_(10)
    if buffer[4].item() != 4 or other[4].item() != 14:
        return "a write into the clone reached the source"
    # A pointer handed out while both sides live is to a copy of its own.
    pointed = _lazy_clone(buffer)
    if pointed.data_ptr() == own:
        return "data_ptr() of a clone whose source lives shares the source's memory"
    # Once the other side is gone, the clone takes the memory over without a copy.
    del slots, buffer, other, pointed
    clone.add_(1)
    if clone.untyped_storage().data_ptr() != start or clone[0].item() != 1:
        return "a clone whose source is gone copied on its first write"
    return ""


def _grows() -> bool:
    """Whether a copy-on-write storage grown before any write can be written (torch 2.13: no)."""
    assert _lazy_clone is not None  # asked only where the probe passed
    clone = _lazy_clone(torch.zeros(4))
    try:
        clone.resize_(8)
        clone.fill_(1)
    except RuntimeError:
        return False
    return bool(clone.sum().item() == 8)


def _probed() -> str:
    try:
        with torch.inference_mode(False), torch._C.DisableTorchFunction(), torch.no_grad():
            return _probe()
    except Exception as error:  # noqa: BLE001 - a torch that fails the probe simply has no copy-on-write
        return f"the probe failed: {type(error).__name__}: {error}"


def _probed_growth() -> bool:
    if _WHY_NOT:
        return False
    try:
        with torch.inference_mode(False), torch._C.DisableTorchFunction(), torch.no_grad():
            return _grows()
    except Exception:  # noqa: BLE001 - a probe that fails says the storage cannot be grown safely
        return False


_WHY_NOT = _probed()
if _WHY_NOT:
    _log.debug("memgather: no copy-on-write elision: %s", _WHY_NOT)
# Probed when first asked (doctor, the tests), not at import: on a torch that fails it, torch raises
# its internal assertion, which TORCH_SHOW_CPP_STACKTRACES=1 makes slow to build and prints about.
_GROWS: Optional[bool] = None


def works() -> bool:
    """Whether this torch's lazy clone is copy-on-write as probed (on the CPU)."""
    return not _WHY_NOT


def why_not() -> str:
    """Why ``works()`` is False ("" where it is True): for ``memgather doctor``."""
    return _WHY_NOT


def serves(tensor: torch.Tensor) -> bool:
    """Whether a snapshot of ``tensor`` can be a lazy clone: the probe passed, and it lies in CPU memory."""
    return not _WHY_NOT and tensor.device.type == "cpu"


def grows() -> bool:
    """Whether a copy-on-write storage can be resized before it is written (torch 2.12 and 2.13: no)."""
    global _GROWS
    if _GROWS is None:
        _GROWS = _probed_growth()
    return _GROWS


def snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A copy-on-write clone of ``tensor`` (only where ``serves(tensor)``): a new tensor, not a view,
    version 0, no autograd history, sharing the memory until either side is written."""
    assert _lazy_clone is not None  # serves() said so
    return _lazy_clone(tensor)
