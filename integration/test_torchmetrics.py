"""torchmetrics, unedited: metrics whose compute() gathers tensor states across 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

from integration.harness import compare


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    runs = compare("torchmetrics", tmp_path)
    for report in runs["memgather"].reports.values():
        # The two big CatMetric gathers (one padded to even lengths first): the slots are kept
        # as a list and the local one replaced afterwards, so they are filled where they lie.
        assert report.strategies.get("in_slots") == 2 and report.rewired == 2, report.line
