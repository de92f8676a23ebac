"""Resident-set size of this process, and its high-water mark (Linux).

The peak is reset by writing 5 to ``/proc/self/clear_refs``; only touched
pages count, so untouched ``torch.empty`` memory costs nothing here.
"""

from __future__ import annotations

import os

_CLEAR_REFS = "/proc/self/clear_refs"


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
