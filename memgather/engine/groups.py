"""What memgather needs to know of a process group, looked up once per group.

Every call needs the group's size, this rank's place in it and its backend,
and small calls are the ones where memgather's own time shows. A process
group's size, rank and backend never change, so they are read once per group
object and kept beside a weak reference to it (a
destroyed group is not kept alive, and its id cannot be mistaken for a new
group's). The entry goes with its group: a job that destroys and creates
groups again and again leaves nothing behind.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch.distributed as dist

from memgather import compat
from memgather.engine import report


class GroupInfo(NamedTuple):
    world: int
    rank: int
    backend: str  # as torch.distributed.get_backend gives it, e.g. "gloo" or "cpu:gloo,cuda:nccl"
    nccl: Optional[str] = None  # the flavour of its NCCL backend, if any: "legacy" or "nccl2" (compat.nccl_flavour)


_known: Dict[int, Tuple[Any, GroupInfo]] = {}


def known(group: Any) -> Optional[GroupInfo]:
    """``describe(group)`` if it was described before and still lives, else None.

    Costs one dict lookup and calls nothing in torch.distributed, so it is safe
    before any check that the group is usable: a group is only described once
    a call on it has passed them.
    """
    pg = _process_group(group)
    entry = _known.get(id(pg))
    if entry is not None and entry[0]() is pg:
        return entry[1]
    return None


def describe(group: Any) -> GroupInfo:
    """Size, this rank's index and backend of ``group`` (None: the default group)."""
    info = known(group)
    if info is not None:
        return info
    pg = _process_group(group)
    backend = str(dist.get_backend(group))
    flavour = compat.nccl_flavour(pg) if "nccl" in backend.lower() else None
    info = GroupInfo(dist.get_world_size(group), dist.get_rank(group), backend, flavour)
    if pg is dist.GroupMember.WORLD:
        # A default group seen for the first time may be a new one, after destroy_process_group():
        # this process's rank in it is the one its exit report must name.
        report.note_rank(info.rank)
    key = id(pg)
    try:
        _known[key] = (weakref.ref(pg, lambda ref: _forget(key, ref)), info)
    except TypeError:  # a group object that takes no weak reference: look it up every time
        pass
    return info


def _forget(key: int, ref: "weakref.ref[Any]") -> None:
    """Drop the entry of a group that has just been freed (called by its weak reference).

    Only if the entry is still that group's: the callback runs before the group's
    memory (and so its id) can be reused, but a thread may have replaced the entry.
    """
    entry = _known.get(key)
    if entry is not None and entry[0] is ref:
        _known.pop(key, None)


def _process_group(group: Any) -> Any:
    return group if group is not None else dist.GroupMember.WORLD
