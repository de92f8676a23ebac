"""StagedWork: an async staged call's work, against torch's own work for the single call.

The copy into the slots completes the gather: made once, on the caller's side, only after
torch's work is known to be done (wait, an is_completed that finds it complete, its
future, or the work dropped unwaited), and never after a gather that failed.
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any, List, Optional

import pytest
import torch
import torch.distributed as dist

from memgather.engine import staged


class _Inner(dist.Work):
    """Stands in for torch's work: done or not, failed or not; counts its waits."""

    def __init__(self, done: bool = True, error: Optional[BaseException] = None) -> None:
        super().__init__()
        self.done, self.error, self.waits, self.timeouts = done, error, 0, []  # type: ignore[var-annotated]

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self.waits += 1
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done

    def exception(self) -> Any:
        return self.error


def _staged(inner: _Inner) -> tuple:
    slots: List[torch.Tensor] = [torch.full((3,), -1.0), torch.full((3,), -1.0)]
    flat = torch.arange(6.0)
    versions = [slot._version for slot in slots]
    return staged.StagedWork(inner, slots, flat), slots, versions


def test_wait_copies_once_and_leaves_the_version_counters() -> None:
    work, slots, versions = _staged(_Inner(done=False))
    assert isinstance(work, dist.Work)
    assert slots[0].tolist() == [-1.0] * 3  # nothing before the gather is known done
    assert work.wait() is True
    assert [slot.tolist() for slot in slots] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert [slot._version for slot in slots] == versions  # mark_written, not the copy, sets them
    slots[0].fill_(9.0)
    work.wait()
    assert slots[0].tolist() == [9.0] * 3  # once only: a second wait writes nothing


def test_a_timeout_reaches_torchs_work() -> None:
    inner = _Inner()
    work, _, _ = _staged(inner)
    work.wait(timeout=timedelta(seconds=5))
    assert inner.timeouts == [timedelta(seconds=5)]


def test_a_failed_gather_raises_and_writes_nothing() -> None:
    inner = _Inner(error=RuntimeError("Timed out waiting"))
    work, slots, _ = _staged(inner)
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        work.wait()
    assert all(slot.tolist() == [-1.0] * 3 for slot in slots)
    assert isinstance(work.exception(), RuntimeError)


def test_is_completed_copies_only_once_torchs_work_is_done() -> None:
    inner = _Inner(done=False)
    work, slots, _ = _staged(inner)
    assert work.is_completed() is False and slots[0].tolist() == [-1.0] * 3
    inner.done = True
    assert work.is_completed() is True and slots[1].tolist() == [3.0, 4.0, 5.0]


@pytest.mark.parametrize("fails", [False, True], ids=["done", "failed"])
def test_the_future_gives_the_slots_filled_or_the_gathers_error(fails: bool) -> None:
    work, slots, _ = _staged(_Inner())
    parent = torch.futures.Future()
    work._inner.get_future = lambda: parent  # type: ignore[method-assign]
    future = work.get_future()
    if fails:
        class GatherFailed(RuntimeError):  # a backend's own kind of error (DistBackendError is one)
            pass

        parent.set_exception(GatherFailed("gather failed"))
        with pytest.raises(GatherFailed) as raised:
            future.wait()
        # The gather's error as it is, as torch's future raises it: no callback's message around it.
        assert type(raised.value) is GatherFailed and str(raised.value) == "gather failed"
        assert slots[0].tolist() == [-1.0] * 3
    else:
        parent.set_result([torch.arange(6.0)])
        value = future.wait()  # a list of the slots themselves, as torch's future gives (not the caller's list)
        assert value is not slots and [a is b for a, b in zip(value, slots)] == [True, True]
        assert len(value) == len(slots) and slots[0].tolist() == [0.0, 1.0, 2.0]


def test_a_work_dropped_unwaited_still_fills_the_slots() -> None:
    """torch's call fills the slots whether or not its work is waited on: so does a dropped StagedWork,
    after waiting for torch's work as torch's own teardown would."""
    inner = _Inner(done=False)
    work, slots, _ = _staged(inner)
    del work
    gc.collect()
    assert inner.waits == 1 and slots[1].tolist() == [3.0, 4.0, 5.0]


def test_a_dropped_work_whose_gather_failed_writes_nothing() -> None:
    inner = _Inner(error=RuntimeError("peer gone"))
    work, slots, _ = _staged(inner)
    del work
    gc.collect()
    assert slots[0].tolist() == [-1.0] * 3
