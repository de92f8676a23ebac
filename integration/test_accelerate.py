"""accelerate, unedited: utils.gather and Accelerator.gather_for_metrics on 2 gloo ranks."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from integration.harness import compare, memory_growth, proof_verdicts


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    runs = compare("accelerate", tmp_path)
    for report in runs["memgather"].reports.values():
        # Elision is on for accelerate's _gpu_gather_one (its code is proven to drop the list after
        # the cat): every big gather is rebound, its cat returns the buffer.
        assert report.rewired >= 5 and report.strategies.get("rebind", 0) == report.rewired, report.line


def test_peak_memory_of_a_gather(tmp_path: Path) -> None:
    """24 MiB per rank here; docs/libraries.md's 196 MiB figure comes from integration/measure_memory.py."""
    for theirs, mine in memory_growth("accelerate", tmp_path, 24):
        ratio = mine["growth"] / theirs["growth"]
        print(f"accelerate {metadata.version('accelerate')}: peak growth {theirs['growth'] >> 20} MiB -> "
              f"{mine['growth'] >> 20} MiB (x{ratio:.3f})")
        assert ratio <= 0.55


def test_the_proof_accepts_the_installed_gather_one() -> None:
    """Cat elision's default comes from reading the installed release's code: no table of releases decides it."""
    verdicts = proof_verdicts("accelerate")
    assert verdicts["accelerate.utils.operations:_gpu_gather.<locals>._gpu_gather_one"].proven
