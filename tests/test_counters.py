"""memgather.engine.counters: fallbacks are counted without a lock, and still exactly."""

from __future__ import annotations

import sys
import threading
import time
from typing import Iterator, List

import pytest

from memgather.engine import counters


@pytest.fixture(autouse=True)
def _fresh_counters() -> Iterator[None]:
    counters.reset_stats()
    yield
    counters.reset_stats()


@pytest.fixture
def _eager_switching() -> Iterator[None]:
    """Threads switched every microsecond: a lost step of a read-add-write would show."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


class Overlap:
    """Makes a reader's snapshots fall inside the counting, however the scheduler runs the threads.

    A busy machine may run the counting threads to their end before the reader is ever
    scheduled, so that no snapshot is taken while counting. Here each counting thread stops
    halfway (``midway``) until the reader has taken a snapshot after that point (``read``).
    """

    WAIT_S = 120.0

    def __init__(self) -> None:
        self.half = threading.Event()
        self.seen = threading.Event()

    def midway(self) -> None:
        self.half.set()
        assert self.seen.wait(self.WAIT_S), "the reader never took a snapshot while counting"

    def read(self) -> counters.Stats:
        halfway = self.half.is_set()
        snapshot = counters.stats()
        if halfway:
            self.seen.set()
        return snapshot


def test_fallbacks_counted_by_threads_while_another_reads_stay_exact(_eager_switching: None) -> None:
    reasons = ["below_threshold", "nccl2", None]
    per_thread, threads = 20000, 6
    start = threading.Barrier(threads + 1)
    done = threading.Event()
    snapshots: List[counters.Stats] = []
    overlap = Overlap()

    def count(reason: object) -> None:
        start.wait()
        for i in range(per_thread):
            if i == per_thread // 2:
                overlap.midway()
            counters.record_fallback(reason)  # type: ignore[arg-type]

    def read() -> None:
        start.wait()
        while not done.is_set():
            snapshots.append(overlap.read())

    workers = [threading.Thread(target=count, args=(reasons[i % 3],)) for i in range(threads)]
    reader = threading.Thread(target=read)
    for thread in [*workers, reader]:
        thread.start()
    for thread in workers:
        thread.join()
    done.set()
    reader.join()

    final = counters.stats()
    assert dict(final.fallbacks) == {"below_threshold": 2 * per_thread, "nccl2": 2 * per_thread}
    assert final.by_strategy["fallback"] == threads * per_thread  # the unknown reason counts as a fallback too
    assert final.calls == threads * per_thread and final.rewired == 0
    assert overlap.seen.is_set()  # a snapshot was taken halfway through the counting
    # Reading takes steps of its own: no snapshot may count them, and none may go backwards.
    totals = [s.by_strategy.get("fallback", 0) for s in snapshots]
    assert totals == sorted(totals) and totals[-1] <= threads * per_thread


def test_a_snapshot_counts_each_rewired_call_of_another_thread_whole(_eager_switching: None) -> None:
    calls = 50000
    done = threading.Event()
    split: List[counters.Stats] = []
    snapshots = 0
    overlap = Overlap()

    def count() -> None:
        for i in range(calls):
            if i == calls // 2:
                overlap.midway()
            counters.record("rebind", route="single_staged", saved=8)
        done.set()

    def read() -> None:
        nonlocal snapshots
        while not done.is_set():
            s = overlap.read()
            snapshots += 1
            if sum(s.by_route.values()) != s.rewired or s.bytes_saved != 8 * s.rewired:
                split.append(s)  # its strategy counted, not yet its route or bytes (or the other way)

    threads = [threading.Thread(target=count), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlap.seen.is_set() and split == []
    final = counters.stats()
    assert (final.rewired, dict(final.by_route), final.bytes_saved) == (calls, {"single_staged": calls}, 8 * calls)


def test_fallbacks_keep_their_place_among_the_strategies_and_reset_to_nothing() -> None:
    counters.record("rebind", route="single_staged")
    counters.record_fallback("below_threshold")
    counters.record("direct", route="single_staged", saved=8)
    counters.record_fallback("below_threshold")
    first = counters.stats()
    assert list(first.by_strategy.items()) == [("rebind", 1), ("fallback", 2), ("direct", 1)]
    assert dict(first.fallbacks) == {"below_threshold": 2} and first.bytes_saved == 8
    assert counters.stats() == first  # reading twice changes nothing

    counters.reset_stats()
    empty = counters.stats()
    assert (dict(empty.by_strategy), dict(empty.fallbacks), empty.calls) == ({}, {}, 0)
    counters.record_fallback(None)
    after = counters.stats()
    assert dict(after.by_strategy) == {"fallback": 1} and dict(after.fallbacks) == {}


def test_kinds_past_the_cap_are_counted_under_the_lock_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that gathers ever new sizes holds at most _MAX_KINDS tallies; past them, each call's
    strategy, route and bytes are still counted, and still together."""
    monkeypatch.setattr(counters, "_MAX_KINDS", 3)
    for size in range(1, 7):  # six kinds: three tallies, three past them
        counters.record("rebind", route="single_staged", saved=size)
        counters.record("rebind", route="single_staged", saved=size)
    counters.record("staged", saved=100)
    counters.record_fallback("below_threshold")
    assert len(counters._kinds) == 3
    final = counters.stats()
    assert list(final.by_strategy.items()) == [("rebind", 12), ("staged", 1), ("fallback", 1)]
    assert dict(final.by_route) == {"single_staged": 12}
    assert final.bytes_saved == 2 * sum(range(1, 7)) + 100
    counters.reset_stats()
    assert counters.stats().calls == 0 and counters._beyond == {} and counters._kinds == {}


def test_no_snapshot_shows_a_fallback_count_of_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that comes while the first fallback of a reason is being counted sees it counted."""
    stepping = threading.Event()

    class SlowTally(counters._Tally):  # a thread switch inside each step, made long
        def __init__(self) -> None:
            super().__init__()
            step = self.add

            def add() -> int:
                stepping.set()
                time.sleep(0.3)
                return step()

            self.add = add  # type: ignore[method-assign]

    monkeypatch.setattr(counters, "_Tally", SlowTally)
    counting = threading.Thread(target=counters.record_fallback, args=("below_threshold",))
    counting.start()
    assert stepping.wait(timeout=60)
    snapshot = counters.stats()
    counting.join()
    assert dict(snapshot.by_strategy) == {"fallback": 1} and dict(snapshot.fallbacks) == {"below_threshold": 1}


_HANDLER_READS_INSIDE_A_COUNT = """
import signal
from memgather.engine import counters

seen = []
signal.signal(signal.SIGUSR1, lambda *_: seen.append(counters.stats()))


class Interrupted(dict):
    # The handler runs at the next instruction boundary: still inside the locked block in which
    # record() creates the tally of the call's kind, before the call is counted on it.
    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        signal.raise_signal(signal.SIGUSR1)


counters._kinds = Interrupted()
counters.record("direct", route="single_staged", saved=8)
after = counters.stats()
print(len(seen), seen[0].by_strategy.get("direct", 0), after.by_strategy["direct"], after.by_route["single_staged"])
"""


def test_a_signal_handler_reading_stats_inside_a_count_does_not_deadlock() -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-c", _HANDLER_READS_INSIDE_A_COUNT], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    # The handler read once, before the call was counted (no count of 0 shown); then it was.
    assert done.stdout.split() == ["1", "0", "1", "1"]


_HANDLERS_READ_WHILE_MAIN_READS = """
import signal, threading, time
from memgather.engine import counters

for _ in range(5):
    counters.record_fallback("below_threshold")
seen = []
signal.signal(signal.SIGUSR1, lambda *_: seen.append(counters.stats().fallbacks["below_threshold"]))
main, stop = threading.get_ident(), threading.Event()


def interrupt():
    while not stop.is_set():
        signal.pthread_kill(main, signal.SIGUSR1)
        time.sleep(0.0002)


threading.Thread(target=interrupt, daemon=True).start()
# Read for 3 s, and on until the handler has read 100 times: a busy machine may schedule the
# interrupting thread seldom (the deadline only bounds a run that never gets there).
read, start = [], time.monotonic()
while (time.monotonic() < start + 3 or len(seen) <= 100) and time.monotonic() < start + 50:
    read.append(counters.stats().fallbacks["below_threshold"])
stop.set()
print(len(seen) > 100, sorted(set(seen)), sorted(set(read)))
"""


def test_signal_handlers_reading_stats_while_the_thread_reads_read_exact_counts() -> None:
    """Reading a count once took a step of its own: a handler's read landing inside another read
    counted one too many, and the read it interrupted one too few (for the rest of that read)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _HANDLERS_READ_WHILE_MAIN_READS], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "True [5] [5]", done.stdout
