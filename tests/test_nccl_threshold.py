"""The default NCCL threshold (routes.nccl_threshold): which calls it rewires on both flavours, the rule
it follows, the table docs/cuda.md shows, what ``memgather doctor`` says, and the CPU-side helpers of
``benchmarks/gpu_check.py``'s crossover sweep (the sweep itself needs a GPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from benchmarks import gpu_check, nccl_threshold
from memgather.engine import routes

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
FLOAT32 = 4
REFERENCE = 64 * 224 * 224 * 64 * FLOAT32  # 784 MiB per rank
LOGITS = 4 * 192 * 32000 * FLOAT32  # 93.75 MiB per rank: an evaluation step's logits
EMBEDDINGS = 256 * 1024 * FLOAT32  # 1 MiB per rank: a contrastive loss's embeddings
METRIC = 4 << 10  # a metric's few KiB
FLAVOURS = ("legacy", "nccl2")


def _rewired(per_rank: int, world: int, flavour: str, **settings: Any) -> bool:
    return per_rank * world >= routes.gathered_limit("nccl", "cuda", flavour, world, **settings)


def test_the_named_sizes_are_what_they_say() -> None:
    assert (REFERENCE, LOGITS, EMBEDDINGS) == (784 * MIB, 93.75 * MIB, MIB)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("per_rank", [REFERENCE, LOGITS], ids=["reference", "logits"])
def test_the_reference_size_and_the_logits_are_rewired_by_default(per_rank: int, world: int, flavour: str) -> None:
    assert _rewired(per_rank, world, flavour)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("world", [2, 8, 64])
@pytest.mark.parametrize("per_rank", [EMBEDDINGS, METRIC], ids=["embeddings", "metric"])
def test_small_calls_stay_with_torch_by_default(per_rank: int, world: int, flavour: str) -> None:
    assert not _rewired(per_rank, world, flavour)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_setting_overrides_the_default(flavour: str) -> None:
    for world in (1, 2, 8, 64):
        assert routes.gathered_limit("nccl", "cuda", flavour, world, nccl_min_bytes=0) == 0  # every call rewired
        assert _rewired(METRIC, world, flavour, nccl_min_bytes=0)
        assert _rewired(EMBEDDINGS, world, flavour, nccl_min_bytes=MIB)
        assert not _rewired(REFERENCE, world, flavour, nccl_min_bytes=1 << 30)
        assert routes.nccl_threshold(12345, world) == 12345


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 16, 64, 1024])
def test_the_default_is_the_smallest_whole_mib_whose_removed_copy_covers_memgathers_time(world: int) -> None:
    """A call of t bytes per rank removes a device copy of world x t bytes (read and written at 3.35 TB/s):
    at the default that takes at least memgather's own time at that many ranks, a MiB less would not."""
    threshold = routes.nccl_threshold(None, world)
    overhead_ns = 90_000 + 10_000 * max(world - 2, 0)
    assert threshold % MIB == 0
    assert 2 * world * threshold / 3_350 >= overhead_ns > 2 * world * (threshold - MIB) / 3_350
    assert routes.gathered_limit("nccl", "cuda", "legacy", world) == routes.gathered_limit(
        "nccl", "cuda", "nccl2", world) == world * threshold  # the same on both flavours


def test_the_default_by_world_size() -> None:
    assert {world: routes.nccl_threshold(None, world) // MIB for world in (1, 2, 4, 8, 16, 64)} == {
        1: 144, 2: 72, 4: 44, 8: 30, 16: 23, 64: 18}


def test_docs_cuda_shows_the_table_the_script_prints() -> None:
    page = (ROOT / "docs" / "cuda.md").read_text()
    printed = nccl_threshold.table(nccl_threshold.DEFAULT_WORLDS)
    assert "\n".join(printed) in page, "docs/cuda.md: rerun python benchmarks/nccl_threshold.py and paste its table"
    assert "benchmarks/nccl_threshold.py" in page


def test_the_script_runs_and_takes_other_world_sizes(capsys: pytest.CaptureFixture) -> None:
    assert nccl_threshold.main(["--worlds", "3,32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 3", "| 32"]
    assert lines[2].startswith("| 3 | 54 MiB | 100 us |")
    with pytest.raises(SystemExit):
        nccl_threshold.main(["--worlds", "0"])


def test_doctor_prints_the_default_thresholds() -> None:
    from memgather.tools import doctor

    plan = doctor.nccl_plan("all_gather_into_tensor")
    assert "Calls under 72 MiB per rank at 2 ranks, 30 MiB per rank at 8 ranks, 18 MiB per rank at 64 ranks" in plan
    assert "Calls under 2 MiB per rank stay" in doctor.nccl_plan("all_gather_into_tensor", 2 * MIB)
    assert "every size" in doctor.nccl_plan("all_gather_into_tensor", 0)


def test_the_docs_quote_the_default_as_the_code_computes_it() -> None:
    """Every page that quotes the default at 2 and 8 ranks quotes today's figures."""
    quoted = "72 MiB per rank at 2 ranks, 30 MiB at 8"
    for page in ("README.md", "docs/settings.md", "docs/torch-releases.md", "docs/calls.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert quoted in text, f"{page} does not quote the NCCL default as {quoted!r}"
    assert (routes.nccl_threshold(None, 2), routes.nccl_threshold(None, 8)) == (72 * MIB, 30 * MIB)


def _row(pattern: str, sync: bool, mib: int, torch_us: float, memgather_us: float) -> Dict[str, Any]:
    return {"pattern": pattern, "sync": sync, "mib": mib, "torch_us": torch_us, "memgather_us": memgather_us,
            "torch_allocated": 3 * mib * MIB, "memgather_allocated": mib * MIB, "torch_reserved": 3 * mib * MIB,
            "memgather_reserved": mib * MIB, "equal": True, "rewired": True}


def test_the_sweeps_crossover_is_where_memgather_stays_no_slower() -> None:
    rows: List[Dict[str, Any]] = [
        _row("list", True, 1, 40.0, 120.0), _row("list", True, 16, 80.0, 70.0),  # a fluke below the crossover
        _row("list", True, 64, 200.0, 230.0), _row("list", True, 256, 600.0, 500.0),
        _row("list", True, 784, 1500.0, 1200.0),
        _row("list", False, 1, 40.0, 120.0), _row("list", False, 784, 1000.0, 1100.0),
    ]
    assert gpu_check.crossover(rows, "list", True) == 256
    assert gpu_check.crossover(rows, "list", False) is None
    assert gpu_check.crossover(rows, "cat", True) is None  # not swept
    lines = gpu_check.sweep_table(rows)
    assert len(lines) == 1 + len(rows) + 2
    assert lines[-2] == "crossover, list, no sync: not within the sizes swept"
    assert lines[-1] == "crossover, list, .cpu() after each gather: from 256 MiB per rank"
    assert lines[4].split()[:6] == ["list", "cpu()", "256", "600.0", "500.0", "0.83"]


def test_the_sweeps_sizes() -> None:
    assert gpu_check.parse_sizes("784,1,4,4") == [1, 4, 784]
    assert list(gpu_check.SWEEP_SIZES_MIB) == [1, 4, 16, 64, 256, 784]
    for bad in ("", "0,4", "1.5"):
        with pytest.raises(ValueError):
            gpu_check.parse_sizes(bad)


def test_the_sweep_without_a_gpu_records_that_it_skipped(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--sweep", "--sizes", "1,4", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    step = json.loads(out.read_text())["steps"][0]
    assert step["step"] == "crossover sweep (legacy NCCL, world 1)"
    assert re.match(r"skipped: no CUDA device", step["status"])
