"""transformers, unedited: trainer_pt_utils.distributed_concat (clone() slots + cat) on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

from integration.harness import compare


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    runs = compare("transformers", tmp_path)
    for report in runs["memgather"].reports.values():
        # The three 3 MiB gathers; elision is on (audited), so each is rebound and its cat elided.
        assert report.strategies.get("rebind") == 3 and report.rewired == 3, report.line
