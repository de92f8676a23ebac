"""DeepSpeed, unedited: deepspeed.comm.all_gather with the slot layouts its code uses, on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

from integration.harness import compare


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    runs = compare("deepspeed", tmp_path)
    for report in runs["memgather"].reports.values():
        # Fresh slots are filled where they lie; ZeRO's views of one buffer are used as they are.
        # The list repeating one tensor object stays with torch (as does the small gather).
        assert report.strategies == {"in_slots": 1, "direct": 1, "fallback": 2}, report.line
    for report in runs["verify"].reports.values():
        assert report.strategies == {"in_slots": 2, "direct": 1, "fallback": 1}, report.line
