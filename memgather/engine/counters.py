"""Per-process counters of what memgather did (step 5 of docs/calls.md)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

_lock = threading.Lock()
_strategies: Counter = Counter()
_routes: Counter = Counter()
_fallbacks: Counter = Counter()
_bytes_saved = 0
_verified = 0
_elided = 0


@dataclass(frozen=True)
class Stats:
    """A snapshot of this process's counters since start or ``reset_stats()``.

    ``by_strategy`` counts calls per strategy ("direct", "rebind",
    "in_slots", "into_result", "fallback"), ``by_route`` calls memgather carried out per
    collective ("single_staged", "single_in_place", "broadcast", "ring"),
    ``fallbacks`` fallback calls per reason, ``elided``
    ``torch.cat`` / ``torch.stack`` calls that returned a gathered buffer instead
    of a copy, ``verified`` rewired calls that verify mode found identical to the original. ``bytes_saved`` is
    what the backend's gathered-size temporary would have cost on the
    unpatched path, summed over calls whose route avoids it (a model, not a
    measurement: ``memgather bench`` measures).
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


def record(strategy: str, route: Optional[str] = None, reason: Optional[str] = None, saved: int = 0) -> None:
    """Count one call."""
    global _bytes_saved
    with _lock:
        _strategies[strategy] += 1
        if route is not None:
            _routes[route] += 1
        if reason is not None:
            _fallbacks[reason] += 1
        _bytes_saved += saved


def record_verified() -> None:
    """Count one rewired call that verify mode found identical to the original."""
    global _verified
    with _lock:
        _verified += 1


def stats() -> Stats:
    """This process's counters, as an immutable snapshot."""
    with _lock:
        return Stats(
            MappingProxyType(dict(_strategies)),
            MappingProxyType(dict(_routes)),
            MappingProxyType(dict(_fallbacks)),
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
