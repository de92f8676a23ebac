"""torchmetrics, unedited: metrics whose compute() gathers tensor states across 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.harness import compare, memory_growth, proof_verdicts
from memgather import cow


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    runs = compare("torchmetrics", tmp_path)
    for report in runs["memgather"].reports.values():
        # The two big CatMetric gathers. The even one (_simple_gather_all_tensors returns its list, its
        # own rank's entry replaced by the input) goes to Metric._sync_dist, which flattens its list
        # states before it concatenates them: never armed, its slots filled where they lie. The uneven
        # one, gather_all_tensors taken over, is gathered unpadded into one tensor of the other ranks' rows.
        assert report.rewired == 2 and report.strategies.get("in_slots") == report.strategies.get("unpadded") == 1, \
            report.line
        assert report.elided == 0, report.line


def test_the_proof_follows_the_returned_list() -> None:
    verdicts = proof_verdicts("torchmetrics")
    simple = verdicts["torchmetrics.utilities.distributed:_simple_gather_all_tensors"]
    assert simple.proven and simple.needs_cow and "returns the list" in simple.reason, simple
    padded = verdicts["torchmetrics.utilities.distributed:gather_all_tensors"]
    assert not padded.proven, padded  # its slots are sliced: not a cat


@pytest.mark.skipif(not cow.works(), reason="this torch has no copy-on-write clone")
@pytest.mark.parametrize("path", ["CatMetric.compute", "tensor state: Metric.compute"])
def test_peak_memory_of_compute(tmp_path: Path, path: str) -> None:
    """40 MiB of state per rank (above glibc's 32 MiB mmap ceiling: freed blocks leave the resident set). torch: the local state's copy (sync's cache, half the result),
    the slots and the cat (or stack) of them: 2.5 x the result. With memgather the slots are
    filled where they lie, with no gathered-size temporary, and the peak is torchmetrics' own
    clone of the computed value, beside the synced state and the cache: 2 x (the local state it
    replaces freed)."""
    for theirs, mine in memory_growth("torchmetrics", tmp_path, 40, path=path):
        result = mine["gathered"]
        assert theirs["growth"] >= 2.4 * result, theirs
        assert mine["growth"] <= 2.1 * result, mine
        assert "in_slots=1" in mine["report"], mine["report"]


def test_the_users_peak_of_an_uneven_gather() -> None:
    from integration import uneven_peaks

    uneven_peaks.check_floors()
