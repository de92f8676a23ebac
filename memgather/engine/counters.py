"""Per-process counters of what memgather did (step 5 of docs/calls.md)."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional

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


# Every count is a _Tally. A fallback adds to its own without the lock; a rewired call adds its
# strategy, route and bytes under it, so a snapshot never splits a call across threads. The lock
# also guards the creation of a tally (its place in the table: where it first came) and reading.
_strategies: Dict[str, _Tally] = {}  # strategy -> calls ("fallback": a place-holder, counted in _fallbacks)
_routes: Dict[str, _Tally] = {}  # route -> calls
_fallbacks: Dict[Optional[str], _Tally] = {}  # reason (None: unknown) -> fallback calls
_bytes_saved = 0
_verified = 0
_elided = 0


@dataclass(frozen=True)
class Stats:
    """A snapshot of this process's counters since start or ``reset_stats()``.

    ``by_strategy`` counts calls per strategy ("direct", "rebind",
    "in_slots", "staged", "into_result", "fallback"), ``by_route`` calls memgather carried out per
    collective ("single_staged", "single_in_place", "single_every_rank", "broadcast", "ring"),
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

    Under the lock, so that a snapshot from another thread sees the call's strategy,
    route and bytes together or none of them (a fallback has one count: no lock).
    """
    global _bytes_saved
    with _lock:
        tally = _strategies.get(strategy)
        (tally or _created(_strategies, strategy)).add()
        if route is not None:
            tally = _routes.get(route)
            (tally or _created(_routes, route)).add()
        _bytes_saved += saved


def _created(table: Dict[Any, _Tally], key: Any) -> _Tally:
    """``table[key]``, created (empty) where it is not there yet; the caller adds to it."""
    with _lock:
        tally = table.get(key)
        if tally is None:
            tally = table[key] = _Tally()
        return tally


def record_fallback(reason: Optional[str]) -> None:
    """Count one call left to torch, for ``reason`` (None: unknown), without taking the lock."""
    tally = _fallbacks.get(reason)
    if tally is None:
        with _lock:
            if reason not in _fallbacks:
                # Counted before a reader can see it: no snapshot shows a fallback count of 0.
                _fallbacks[reason] = _Tally()
                _fallbacks[reason].add()
                if "fallback" not in _strategies:  # its place among the strategies: where it first came
                    _strategies["fallback"] = _Tally()
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
        strategies = {name: tally.value() for name, tally in list(_strategies.items())}
        if "fallback" in strategies:
            strategies["fallback"] += sum(fallbacks.values())
        return Stats(
            MappingProxyType({name: n for name, n in strategies.items() if n or name == "fallback"}),
            MappingProxyType({name: n for name, n in ((k, t.value()) for k, t in list(_routes.items())) if n}),
            MappingProxyType({reason: n for reason, n in fallbacks.items() if reason is not None and n}),
            _bytes_saved,
            _verified,
            _elided,
        )


def reset_stats() -> None:
    """Zero every counter of this process."""
    global _bytes_saved, _verified, _elided
    with _lock:
        _strategies.clear()
        _routes.clear()
        _fallbacks.clear()  # a call counting at this moment may count into a dropped tally: as if it came just before
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
