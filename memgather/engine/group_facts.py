"""What calls on one group with tensors of one device type take, worked out once and kept.

A group's backend, size and NCCL flavour never change, and neither do the
thresholds between two ``configure()``: so the threshold a call is measured
against, the routes it may take and the dtypes its backend gathers are worked
out once per (group, device type) and kept. ``planner.plan`` asks on every call,
and a small one, the most frequent kind, finds here all it needs in one lookup.

An entry is kept beside a weak reference to its group, as ``groups`` keeps a
group's description: it goes with its group, and a new group that takes a freed
one's id is not mistaken for it. ``configure()`` empties the table, since the
thresholds may change.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Dict, FrozenSet, NamedTuple, Optional, Tuple

import torch

from memgather import compat, config
from memgather.engine import groups, routes
from memgather.engine.reasons import Reason


class GroupFacts(NamedTuple):
    """What calls with tensors of one device type on one group take."""

    group: Callable[[], Any]  # a weak reference to the group: tells a group freed and its id reused
    info: groups.GroupInfo
    limit: int  # gathered bytes under which a call goes to torch (0: none does)
    synchronous: Optional[routes.Route]  # the route of a call at or above the limit (routes.choose)
    single: Optional[routes.Route]  # the single-tensor route (async calls, gather()): routes.single_route
    elided: Optional[routes.Route]  # the route of a call whose cat is elided, where it differs: routes.elided_route
    unelided: Optional[Reason]  # why every call without elision goes to torch at once (NCCL2), if it does
    dtypes: Optional[FrozenSet[torch.dtype]]  # what the backend's collectives take (None: any): routes.dtypes_taken


# (MEMGATHER_GLOO_MIN_BYTES, MEMGATHER_NCCL_MIN_BYTES); a new tuple each configure().
_thresholds: Tuple[Optional[int], Optional[int]] = (None, None)
# (id of a process group, a device type) -> its facts. Read without a lock: _lock keeps
# configure() and work_out's store apart.
_table: Dict[Tuple[int, str], GroupFacts] = {}
_lock = threading.Lock()


# The entry kept under a key of ``_table``, or None: a kept plan's check that its facts are still
# what ``lookup`` gives (``memgather.engine.kept``), with nothing worked out. (``configure()`` empties
# the table in place: this stays its method.)
entry = _table.get


def configure(settings: config.Settings) -> None:
    """Take the thresholds of ``settings`` and forget every entry worked out under the old ones."""
    global _thresholds
    with _lock:
        _thresholds = (settings.gloo_min_bytes, settings.nccl_min_bytes)
        _table.clear()


def thresholds() -> Tuple[Optional[int], Optional[int]]:
    """The thresholds facts are worked out under now: a new object each ``configure()``."""
    return _thresholds


def lookup(group: Any, tensor: torch.Tensor, info: Optional[groups.GroupInfo]) -> Optional[GroupFacts]:
    """The facts of calls with ``tensor``'s device type on ``group`` (None: the default group).

    Worked out here if not kept yet, from ``info`` (the group's description) or the one
    ``groups`` holds; None where neither is there, that is, before any call on the group
    was planned in full. Calls nothing in torch.distributed when the entry is kept.
    """
    pg = group if group is not None else compat.default_group()
    kind = "cpu" if tensor.is_cpu else ("cuda" if tensor.is_cuda else tensor.device.type)
    facts = _table.get((id(pg), kind))
    if facts is not None and facts.group() is pg:
        return facts
    info = info or groups.known(group)
    return None if info is None else work_out(pg, info, kind)


def work_out(pg: Any, info: groups.GroupInfo, device_type: str) -> GroupFacts:
    """Work out what calls with tensors of ``device_type`` on the process group ``pg`` take, and keep it."""
    thresholds = _thresholds  # one pair for the whole entry
    backend, device = routes.backend_on(info.backend, device_type), torch.device(device_type)
    limit = routes.gathered_limit(backend, device_type, info.nccl, info.world, *thresholds)
    gloo_single = compat.gloo_has_single_tensor()
    synchronous = routes.choose(backend, device, False, gloo_single, info.nccl)
    single = routes.single_route(backend, device, gloo_single, info.nccl)
    elided = routes.elided_route(backend, device, info.nccl)
    unelided = Reason.NCCL2 if elided is not None and synchronous is None and single is None else None
    if compat.collectives_checked(pg, device):
        # The single call meets torch's list call on the wire, but not torch's check of every
        # rank's collectives: a rank that falls back takes the others along.
        synchronous, single = routes.agreed(synchronous), routes.agreed(single)
    dtypes = routes.dtypes_taken(backend, device_type)
    key = (id(pg), device_type)
    try:
        # The callback holds the table and the function it needs: a group freed at interpreter exit,
        # after this module's globals are gone (a kept plan holds these facts until then), finds them.
        reference = weakref.ref(pg, functools.partial(_forget, _table, key))
    except TypeError:  # a group object that takes no weak reference: worked out every time
        return GroupFacts(lambda: pg, info, limit, synchronous, single, elided, unelided, dtypes)
    facts = GroupFacts(reference, info, limit, synchronous, single, elided, unelided, dtypes)
    with _lock:
        # A configure() since the thresholds were read: this call goes by them, the next ones by the new.
        if _thresholds is thresholds:
            _table[key] = facts
    return facts


def kept() -> int:
    """How many (group, device type) entries are kept: each goes with its group."""
    return len(_table)


def _forget(table: Dict[Tuple[int, str], GroupFacts], key: Tuple[int, str], reference: Any) -> None:
    """Drop the entry of a group just freed (its weak reference's callback; no lock: a collection
    may run it inside work_out's). Only if the entry is still that group's."""
    facts = table.get(key)
    if facts is not None and facts.group is reference:
        table.pop(key, None)
