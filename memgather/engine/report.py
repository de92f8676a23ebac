"""``MEMGATHER_REPORT``: this process's statistics, written to stderr at exit."""

from __future__ import annotations

import atexit
import os
import sys
from typing import Optional

_mode = "off"
_rank: Optional[int] = None


def install(mode: str) -> None:
    """Register the exit report ("off", "rank0" or "all"); the latest mode wins."""
    global _mode
    if _mode == "off" and mode != "off":
        atexit.register(_report)
    _mode = mode


def remember_rank() -> None:
    """Note this process's global rank while a process group exists (it may not at exit)."""
    global _rank
    if _rank is None:
        import torch.distributed as dist

        if dist.is_initialized():
            _rank = dist.get_rank()


def note_rank(rank: int) -> None:
    """This process's global rank in a default group memgather has just met: after
    ``destroy_process_group()`` and a new ``init_process_group()`` it may differ from the
    first group's, and the report names the latest."""
    global _rank
    _rank = rank


def _report() -> None:
    rank = _live_rank()
    if rank is None:
        rank = _rank if _rank is not None else _rank_from_environment()
    # A process that never joined a group (a launcher, say) is not a rank: no line.
    if _mode == "off" or rank is None or (_mode == "rank0" and rank != 0):
        return
    from memgather.engine.counters import stats

    # Written, not logged: the user asked for this report by setting MEMGATHER_REPORT.
    sys.stderr.write(f"[memgather rank {rank}] {stats()}\n")
    sys.stderr.flush()


def _live_rank() -> Optional[int]:
    """This process's rank in the default group that exists at exit, if one does: after
    ``destroy_process_group()`` and a new ``init_process_group()`` it is the latest."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist.get_rank() if dist is not None and dist.is_available() and dist.is_initialized() else None
    except (RuntimeError, ValueError):
        return None


def _rank_from_environment() -> Optional[int]:
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else None
