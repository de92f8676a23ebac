"""Per-process counters of what memgather did (step 5 of docs/calls.md)."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Dict, Mapping, Optional, Tuple

# Re-entrant: a signal handler runs on the thread it interrupts, and one that reads
# ``memgather.stats()`` (a progress dump on SIGUSR1) may land inside a block that holds the lock.
_lock = threading.RLock()


class _Tally:
    """A count that many threads add to without a lock, exactly.

    ``add`` is an ``itertools.count``'s ``__next__``: one step in C, which no
    other thread can interleave (a Python ``n += 1`` is atomic by no contract, and
    loses steps on free-threaded builds). Fallbacks are the most frequent calls,
    and the ones whose path to torch must stay short: they take no lock.
    ``value`` reads the count from its repr, ``count(n)``, without a step of its own:
    one C call too, so any thread or signal handler may read at any moment.
    """

    __slots__ = ("add", "_count")

    def __init__(self) -> None:
        self._count = itertools.count()
        self.add = self._count.__next__

    def value(self) -> int:
        """Steps taken by ``add`` so far."""
        return int(repr(self._count)[6:-1])  # "count(n)"; pickling, the other way to read it, goes in Python 3.14


# Every count is a _Tally, added to without a lock. A fallback adds to the tally of its reason. A
# rewired call adds one step to the tally of its kind, (strategy, route, bytes saved): a snapshot,
# which sums the kinds, sees the call whole or not at all, and no lock is taken on the path of a
# call. The lock guards the creation of a tally (its place in the table), reading and resetting.
_kinds: Dict[Tuple[str, Optional[str], int], _Tally] = {}  # (strategy, route, bytes saved) -> calls
# Kinds held at most: a process that gathers ever new sizes counts the calls of kinds past them
# under the lock, into _beyond (strategy -> calls, route -> calls, and the bytes saved).
_MAX_KINDS = 4096
_beyond: Dict[str, int] = {}
_beyond_routes: Dict[str, int] = {}
_order: Dict[str, None] = {}  # the strategies, in the order they first came ("fallback" among them)
_fallbacks: Dict[Optional[str], _Tally] = {}  # reason (None: unknown) -> fallback calls
_bytes_saved = 0
_verified = 0
_elided = 0


@dataclass(frozen=True)
class Stats:
    """A snapshot of this process's counters since start or ``reset_stats()``.

    ``by_strategy`` counts calls per strategy ("direct", "rebind", "in_slots", "staged", "unpadded",
    "into_result", "object_parts", "object_padded", "fallback"), ``by_route`` calls memgather
    carried out per collective ("single_staged", "single_in_place", "single_every_rank", "broadcast", "ring"),
    ``fallbacks`` fallback calls per reason, ``elided``
    ``torch.cat`` / ``torch.stack`` calls that returned a gathered buffer instead
    of a copy, ``verified`` rewired calls that verify mode found identical to the original. ``bytes_saved`` is
    what the backend's gathered-size temporary would have cost on the
    unpatched path, summed over calls whose route avoids it (gloo's broadcasts
    and ring, legacy NCCL's single call; not ProcessGroupNCCL2, which has none): a model, not a
    measurement (``memgather bench`` measures).
    """

    by_strategy: Mapping[str, int] = field(default_factory=dict)
    by_route: Mapping[str, int] = field(default_factory=dict)
    fallbacks: Mapping[str, int] = field(default_factory=dict)
    bytes_saved: int = 0
    verified: int = 0
    elided: int = 0

    @property
    def calls(self) -> int:
        return sum(self.by_strategy.values())

    @property
    def rewired(self) -> int:
        """``all_gather`` calls memgather carried out itself (not ``into_result``: no caller's list)."""
        return self.calls - self.by_strategy.get("fallback", 0) - self.by_strategy.get("into_result", 0)

    def __str__(self) -> str:
        def counts(mapping: Mapping[str, int]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(mapping.items())) or "none"

        return (
            f"memgather: {self.calls} calls, {self.rewired} rewired "
            f"({counts(self.by_strategy)}); routes: {counts(self.by_route)}; "
            f"fallbacks: {counts(self.fallbacks)}; saved {_human(self.bytes_saved)}"
            + (f"; elided {self.elided}" if self.elided else "")
            + (f"; verified {self.verified}" if self.verified else "")
        )


def record(strategy: str, route: Optional[str] = None, saved: int = 0) -> None:
    """Count one call memgather carried out (fallbacks: ``record_fallback``).

    One step of the tally of its kind, without a lock: a snapshot from another thread sees the
    call's strategy, route and bytes together or none of them.
    """
    tally = _kinds.get((strategy, route, saved))
    if tally is None:
        tally = _kind(strategy, route, saved)
        if tally is None:
            return  # a kind past _MAX_KINDS: counted under the lock
    tally.add()


def _kind(strategy: str, route: Optional[str], saved: int) -> Optional[_Tally]:
    """The tally of a kind of call, created (empty) where it is not there yet; None past ``_MAX_KINDS``,
    where the call is counted here, under the lock."""
    global _bytes_saved
    key = (strategy, route, saved)
    with _lock:
        tally = _kinds.get(key)
        if tally is not None:
            return tally
        _order.setdefault(strategy)
        if len(_kinds) < _MAX_KINDS:
            tally = _kinds[key] = _Tally()
            return tally
        _beyond[strategy] = _beyond.get(strategy, 0) + 1
        if route is not None:
            _beyond_routes[route] = _beyond_routes.get(route, 0) + 1
        _bytes_saved += saved
        return None


def record_fallback(reason: Optional[str]) -> None:
    """Count one call left to torch, for ``reason`` (None: unknown), without taking the lock."""
    tally = _fallbacks.get(reason)
    if tally is None:
        with _lock:
            if reason not in _fallbacks:
                # Counted before a reader can see it: no snapshot shows a fallback count of 0.
                _fallbacks[reason] = _Tally()
                _fallbacks[reason].add()
                _order.setdefault("fallback")  # its place among the strategies: where it first came
                return
            tally = _fallbacks[reason]
    tally.add()


def record_verified() -> None:
    """Count one rewired call that verify mode found identical to the original."""
    global _verified
    with _lock:
        _verified += 1


def stats() -> Stats:
    """This process's counters, as an immutable snapshot."""
    with _lock:
        fallbacks = {reason: tally.value() for reason, tally in list(_fallbacks.items())}
        strategies = dict.fromkeys(_order, 0)
        routes: Dict[str, int] = {}
        saved = _bytes_saved
        for (strategy, route, size), tally in list(_kinds.items()):
            calls = tally.value()
            # (.get: a reset_stats() from a signal handler between a kind's creation and its entry
            # in _order leaves the kind without its place; it then comes last.)
            strategies[strategy] = strategies.get(strategy, 0) + calls
            if route is not None:
                routes[route] = routes.get(route, 0) + calls
            saved += calls * size
        for strategy, calls in _beyond.items():
            strategies[strategy] = strategies.get(strategy, 0) + calls
        for route, calls in _beyond_routes.items():
            routes[route] = routes.get(route, 0) + calls
        if "fallback" in strategies:
            strategies["fallback"] += sum(fallbacks.values())
        return Stats(
            MappingProxyType({name: n for name, n in strategies.items() if n or name == "fallback"}),
            MappingProxyType({name: n for name, n in routes.items() if n}),
            MappingProxyType({reason: n for reason, n in fallbacks.items() if reason is not None and n}),
            saved,
            _verified,
            _elided,
        )


def reset_stats() -> None:
    """Zero every counter of this process."""
    global _bytes_saved, _verified, _elided
    with _lock:
        _kinds.clear()  # a call counting at this moment may count into a dropped tally: as if it came just before
        _beyond.clear()
        _beyond_routes.clear()
        _order.clear()
        _fallbacks.clear()
        _bytes_saved = 0
        _verified = 0
        _elided = 0


def record_elided() -> None:
    """Count one cat or stack that returned the gathered buffer (cat elision)."""
    global _elided
    with _lock:
        _elided += 1


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"
