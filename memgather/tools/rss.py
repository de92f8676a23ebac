"""Resident-set size of this process, and its high-water mark (Linux).

The peak is reset by writing 5 to ``/proc/self/clear_refs``; only touched
pages count, so untouched ``torch.empty`` memory costs nothing here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_CLEAR_REFS = "/proc/self/clear_refs"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_TRACKED = 64 << 10  # from this size on, every allocation is mapped afresh and unmapped on free
_STEADY = 32 << 20  # what glibc's own adaptive threshold grows to (its maximum on 64-bit)


def available() -> bool:
    """Whether this system lets the peak be reset (Linux with /proc)."""
    return os.path.exists(_CLEAR_REFS)


def reset_peak() -> None:
    """Make the high-water mark equal to the current resident set."""
    with open(_CLEAR_REFS, "w") as clear:
        clear.write("5")


def current_bytes() -> int:
    """Resident set now (VmRSS)."""
    return _status_kib("VmRSS") * 1024


def peak_bytes() -> int:
    """Resident-set high-water mark since the last reset (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def track_allocations(on: bool) -> bool:
    """Make freed memory leave the resident set at once (``on``), or settle back.

    glibc raises its mmap threshold each time a large block is freed, and from
    then on serves blocks of up to 32 MiB from a heap that keeps freed pages
    resident, so a high-water mark would miss every later call's temporaries.
    On, the heap's free pages are returned first, then each block of 64 KiB
    or more is mapped when allocated and unmapped when freed. Off, the threshold
    is pinned where glibc's own would settle.
    Returns False where the C library has no ``mallopt`` (not glibc).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    threshold = _TRACKED if on else _STEADY
    mallopt(_M_MMAP_THRESHOLD, threshold)
    mallopt(_M_TRIM_THRESHOLD, 2 * threshold)
    if on:
        libc.malloc_trim(0)  # free pages the heap kept would serve the next blocks unseen
    return True


def trim() -> bool:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``), so that the resident set
    holds what is live. Small blocks freed inside the heap (a pickler's many small copies) otherwise stay
    resident until reused. Returns False where the C library has no ``malloc_trim``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
