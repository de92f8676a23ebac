"""open_clip, unedited: loss.gather_features with and without local_loss, on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

from integration.harness import compare


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    runs = compare("open_clip", tmp_path)
    for report in runs["memgather"].reports.values():
        # Two gathers per combination: image and text features, 3 MiB per rank each. Without
        # gradients gather_features fills zeros_like slots (then replaces the local one);
        # with them, torch.distributed.nn's all_gather fills empty_like slots it returns.
        assert report.rewired == 8 and report.strategies.get("in_slots") == 8, report.line
