"""transformers, unedited: trainer_pt_utils.distributed_concat (clone() slots + cat) on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

from integration.harness import compare, proof_verdicts


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    runs = compare("transformers", tmp_path)
    for report in runs["memgather"].reports.values():
        # The three 3 MiB gathers; distributed_concat is proven to drop its list after the cat, so
        # each is rebound and its cat elided.
        assert report.strategies.get("rebind") == 3 and report.rewired == 3, report.line


def test_the_proof_accepts_the_installed_distributed_concat() -> None:
    """Cat elision's default comes from reading the installed release's code: no table of releases decides it."""
    assert proof_verdicts("transformers")["transformers.trainer_pt_utils:distributed_concat"].proven
