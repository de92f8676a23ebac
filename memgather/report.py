"""``MEMGATHER_REPORT``: this process's statistics, written to stderr at exit."""

from __future__ import annotations

import atexit
import os
import sys

_installed_mode = "off"


def install(mode: str) -> None:
    """Register the exit report ("off", "rank0" or "all"); the latest mode wins."""
    global _installed_mode
    if _installed_mode == "off" and mode != "off":
        atexit.register(_report)
    _installed_mode = mode


def _report() -> None:
    if _installed_mode == "off":
        return
    rank = _rank()
    if _installed_mode == "rank0" and rank != 0:
        return
    from memgather.counters import stats

    # Written, not logged: the user asked for this report by setting MEMGATHER_REPORT.
    sys.stderr.write(f"[memgather rank {rank}] {stats()}\n")
    sys.stderr.flush()


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - at exit, torch may be half torn down
        pass
    return int(os.environ.get("RANK", "0") or 0)
