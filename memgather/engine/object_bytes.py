"""An object's pickled bytes as a tensor, and an object read back from a view of such bytes.

torch's object collectives pickle into an ``io.BytesIO``, copy its value into a new byte
storage, and read each part back through ``.numpy().tobytes()`` and a slice: three copies of
every part on the way. Here the tensor is the ``BytesIO``'s own buffer (``getbuffer()``, no
copy), and the unpickler reads straight from the memory a part was received into, through
``BytesView``: a read-only file over a ``memoryview``. The pickler and unpickler are torch's
module globals (``distributed_c10d._pickler`` / ``_unpickler``), looked up at each use as
torch looks them up, so a replaced unpickler (one that restricts what may be loaded) is the
one that runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import mmap
import pickle
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

# What the C unpickler asks ``peek`` for when it prefetches (``PREFETCH`` in CPython's _pickle.c).
_CHUNK = 8192 * 16
# Read bytes are handed back to the system in steps of at least this much.
_RELEASE_STEP = 4 << 20
_MADV_DONTNEED = 4  # Linux


def _find_madvise() -> Optional[Any]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _find_madvise()


class Pickled:
    """``obj`` pickled with torch's ``_pickler``: its bytes (``view``) and a uint8 tensor over them
    (``tensor``, sharing the memory). Holding either holds the bytes; ``release`` lets them go."""

    __slots__ = ("view", "tensor")

    def __init__(self, obj: Any) -> None:
        stream = io.BytesIO()
        dist.distributed_c10d._pickler(stream).dump(obj)
        self.view: Optional[memoryview] = stream.getbuffer()
        self.tensor: Optional[torch.Tensor] = torch.frombuffer(self.view, dtype=torch.uint8) if self.size else None

    @property
    def size(self) -> int:
        return 0 if self.view is None else self.view.nbytes

    def release(self) -> None:
        """Drop this object's hold on the bytes (they go once nothing else holds the tensor or view)."""
        self.view = self.tensor = None


def unpickled(view: memoryview) -> Any:
    """The object pickled in ``view``, loaded by torch's ``_unpickler`` as it is bound now.

    Where that is Python's own ``pickle.Unpickler``, which reads its file forwards only, the
    pages of ``view`` it has read are handed back to the system as it goes (``BytesView``'s
    ``release_behind``): the unpickler keeps what it read (its memo holds every tensor's bytes
    until the load ends), so a part's bytes and their copies need not be resident together.
    ``view`` reads zeros where it was released afterwards: the caller drops it.
    """
    unpickler = dist.distributed_c10d._unpickler
    return unpickler(BytesView(view, release_behind=unpickler is pickle.Unpickler)).load()


def received(size: int) -> Tuple[memoryview, torch.Tensor]:
    """``size`` bytes of new CPU memory: a memoryview of them and a uint8 tensor over them (sharing
    the memory; either holds it). A ``bytearray``'s, so that unpickling reads them without numpy."""
    raw = bytearray(size)  # (calloc: its pages are mapped when first written, by the receive)
    tensor = torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8, device="cpu")
    return memoryview(raw), tensor


class BytesView(io.RawIOBase):
    """A read-only, seekable binary file over a ``memoryview``, which it never copies whole.

    ``read`` and ``peek`` hand out copies of what they are asked for (the C unpickler asks for
    small pieces, and for ``_CHUNK`` bytes when it prefetches); ``readinto`` copies straight into
    the caller's buffer, which is how the unpickler reads a large ``bytes`` payload (a
    tensor's storage). ``getvalue`` copies everything, as ``io.BytesIO``'s does for a reader
    that asks for it.
    """

    def __init__(self, view: memoryview, release_behind: bool = False) -> None:
        super().__init__()
        self._view = view
        self._at = 0
        # release_behind: the whole pages before the position, once read, go back to the system
        # (``madvise(MADV_DONTNEED)``: they read as zeros after): for a reader that never goes back.
        self._base = 0
        self._released = 0
        if release_behind and _madvise is not None and not view.readonly and view.nbytes >= 2 * _RELEASE_STEP:
            self._anchor = ctypes.c_char.from_buffer(view)  # its address; held while this reader is
            self._base = ctypes.addressof(self._anchor)

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        self._checked()
        return self._at

    def _seek(self, offset: int, whence: int) -> int:
        self._checked()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._at = base + offset
        return self._at

    def read(self, size: Optional[int] = -1) -> bytes:
        self._checked()
        end = len(self._view) if size is None or size < 0 else min(self._at + size, len(self._view))
        data = self._view[self._at : end].tobytes() if end > self._at else b""
        self._at = max(self._at, end)
        self._release()
        return data

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        self._checked()
        target = memoryview(buffer).cast("B")
        count = max(0, min(len(target), len(self._view) - self._at))
        target[:count] = self._view[self._at : self._at + count]
        self._at += count
        self._release()
        return count

    def peek(self, size: int = 0) -> bytes:
        self._checked()
        return self._view[self._at : self._at + max(size, _CHUNK if size <= 0 else size)].tobytes()

    def readline(self, size: Optional[int] = -1) -> bytes:
        self._checked()
        limit = len(self._view) if size is None or size < 0 else min(self._at + size, len(self._view))
        end = self._at
        while end < limit:
            piece = self._view[end : min(end + _CHUNK, limit)].tobytes()
            found = piece.find(b"\n")
            if found >= 0:
                end += found + 1
                break
            end += len(piece)
        return self.read(end - self._at)

    def getvalue(self) -> bytes:
        self._checked()
        if self._released:
            raise io.UnsupportedOperation("getvalue on a reader that handed back what it read")
        return self._view.tobytes()

    def _release(self) -> None:
        """Hand back the whole pages read since the last release, in steps of ``_RELEASE_STEP``."""
        if not self._base or self._at - self._released < _RELEASE_STEP:
            return
        start = -(-(self._base + self._released) // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (self._base + self._at) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start and _madvise is not None and _madvise(start, end - start, _MADV_DONTNEED) == 0:
            self._released = end - self._base

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if self._base:
            raise io.UnsupportedOperation("seek on a reader that hands back what it read")
        return self._seek(offset, whence)

    def seekable(self) -> bool:
        return not self._base

    def _checked(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file.")
