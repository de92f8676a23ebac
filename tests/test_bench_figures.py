"""The commands behind the figures of the README and docs/, each run for real at tiny settings:
``benchmarks/route_times.py``, ``benchmarks/startup.py``, ``benchmarks/first_touch.py`` and
``memgather bench``'s transport floor (``benchmarks/overhead.py``: tests/test_overhead.py).
Only the shape of what they print is checked (a well-formed table of positive numbers),
never a timing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from benchmarks import route_times
from memgather.engine import pages
from memgather.tools import bench
from tests.jobs import environment

ROOT = Path(__file__).resolve().parent.parent
TIME = re.compile(r"^([0-9]+(?:\.[0-9]+)?) (ms|us)$")


def _bench(*args: str) -> "subprocess.CompletedProcess[str]":
    return _run("-m", "memgather", "bench", *args)


def _script(name: str, *args: str) -> "subprocess.CompletedProcess[str]":
    """``python benchmarks/NAME.py ARGS``, from the repository root. The debug level off: torch cannot
    wrap the fake backend, which the overhead scripts time on, for TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    return _run(str(Path("benchmarks") / f"{name}.py"), *args, env=environment(TORCH_DISTRIBUTED_DEBUG="OFF"))


def _run(*args: str, env: Optional[Dict[str, str]] = None) -> "subprocess.CompletedProcess[str]":
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env or environment(), cwd=ROOT,
                          timeout=300)


def _cells(line: str) -> List[str]:
    """A table line's cells: columns are separated by two spaces or more."""
    return re.split(r" {2,}", line.strip())


def _positive_time(cell: str) -> float:
    match = TIME.match(cell)
    assert match, f"not a time: {cell!r}"
    value = float(match.group(1))
    assert value > 0, cell
    return value


def _table(stdout: str, header: str) -> List[List[str]]:
    """The rows below the line that starts with ``header``, up to a line of another shape."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    width = len(_cells(lines[start]))
    rows = []
    for line in lines[start + 1:]:
        cells = _cells(line)
        if len(cells) != width:
            break
        rows.append(cells)
    return rows


@pytest.mark.parametrize("world", [2, 4])
def test_routes_prints_a_table_per_size(world: int) -> None:
    done = _script("route_times", "--world-size", str(world), "--sizes", "4K,8K", "--repeat", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"gloo, world {world}, torch " in done.stdout
    rows = _table(done.stdout, "per rank")
    assert [row[0] for row in rows] == ["4 KiB", "8 KiB"]
    for size, single, broadcast, ratio in rows:
        assert _positive_time(single) and _positive_time(broadcast) and float(ratio) > 0
    crossover = done.stdout.strip().splitlines()[-1]
    assert crossover.startswith("crossover: ") and ("faster" in crossover), crossover


def test_startup_prints_the_line_and_the_start_ups() -> None:
    done = _script("startup", "--repeat", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "memgather.pth with MEMGATHER unset (" in done.stdout
    rows = {cells[0]: cells[1:] for cells in map(_cells, done.stdout.strip().splitlines()[1:])}
    for name in ("the line alone, compiled once", "the line as site runs it (exec of its text)",
                 "python -c pass, bare venv with memgather.pth", "python -c pass, bare venv without it"):
        assert _positive_time(rows[name][0])
    assert re.match(r"^[+-][0-9]+\.[0-9]+ ms$", rows["difference of the medians"][0])
    assert rows["difference of the medians"][1] == "3 runs each, alternating"


@pytest.mark.skipif(not pages.available(), reason="no huge-page advice here (not Linux, or MEMGATHER_HUGE_PAGES=0)")
def test_first_touch_prints_both_variants() -> None:
    done = _script("first_touch", "--sizes", "4M", "--repeat", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "transparent huge pages: " in done.stdout
    rows = _table(done.stdout, "size")
    assert len(rows) == 1 and rows[0][0] == "4 MiB"
    _, plain, advised, ratio = rows[0]
    assert _positive_time(plain) and _positive_time(advised) and float(ratio) > 0


def test_patterns_carry_the_transport_floor(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = _bench("--shape", "64,64", "--repeat", "2", "--patterns", "empty_like_cat,single_tensor", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("[bench] transport floor") == 1  # once per invocation, not per pattern
    header = _cells(next(line for line in done.stdout.splitlines() if line.startswith("pattern")))
    cells = [dict(zip(header, row)) for row in _table(done.stdout, "pattern")]
    rows = json.loads(out.read_text())
    assert [row["pattern"] for row in rows] == ["empty_like_cat", "single_tensor"] and len(cells) == 2
    for row, printed in zip(rows, cells):
        assert row["time_floor"] > 0 and row["time_floor"] == rows[0]["time_floor"]
        assert row["time_memgather_vs_floor"] == pytest.approx(row["time_memgather"] / row["time_floor"])
        assert _positive_time(printed["time floor"]) and printed["time floor"] == bench._duration(row["time_floor"])
        assert float(printed["mg/time floor"]) == pytest.approx(row["time_memgather_vs_floor"], abs=5e-4)


@pytest.mark.parametrize("script,args,message", [
    ("route_times", ["--sizes", "4K,1X"], "expected comma-separated sizes such as 4K,1M,64M"),
    ("route_times", ["--sizes", "6"], "each size must be a positive multiple of 4 bytes"),
    ("route_times", ["--backend", "nccl"], "route_times.py times gloo's routes"),
    ("route_times", ["--repeat", "0"], "must be a positive integer"),
    ("first_touch", ["--sizes", "1M"], "memgather advises buffers from 4 MiB on"),
    ("startup", ["--repeat", "x"], "invalid positive value"),
    ("overhead", ["--calls", "0"], "must be a positive integer"),
])
def test_figure_scripts_name_bad_input(script: str, args: List[str], message: str) -> None:
    done = _script(script, *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize("option", ["--overhead", "--routes", "--startup", "--first-touch", "--sizes"])
def test_bench_measures_only_the_patterns(option: str) -> None:
    """The figures only the docs need are the benchmarks/ scripts' now, not options of the installed command."""
    done = _bench(option)
    assert done.returncode == 2 and f"unrecognized arguments: {option}" in done.stderr, done.stderr


@pytest.mark.parametrize("script", ["overhead", "overhead_parts", "route_times", "startup", "first_touch"])
def test_each_script_explains_what_it_measures(script: str) -> None:
    done = _script(script, "--help")
    assert done.returncode == 0 and f"usage: python benchmarks/{script}.py" in done.stdout, done.stdout + done.stderr


def test_overhead_parts_times_every_step_of_a_rebind() -> None:
    done = _script("overhead_parts", "--calls", "20")
    assert done.returncode == 0, done.stderr
    steps = [line.rsplit(None, 1) for line in done.stdout.splitlines()[1:]]
    assert [name.strip() for name, _ in steps] == [
        "bind the call", "plan it (preconditions, route, slot checks)",
        "take the call site's kept plan (facts re-checked)", "the same, the slots proven made like the input",
        "rebind's torch calls + the single-tensor call", "bookkeeping (statistics)",
        "the whole rewired call, through the wrapper", "torch's own call, unpatched"], done.stdout
    values = [float(value) for _, value in steps]
    assert values[6] > values[7], done.stdout  # a rewired call costs more than torch's own


def test_sizes_and_their_labels() -> None:
    assert bench.parse_sizes("4K, 256k,1M,2G,12") == [4096, 256 << 10, 1 << 20, 2 << 30, 12]
    assert [bench.size_label(s) for s in (4096, 1 << 20, 3 << 30, 1536, 12)] == ["4 KiB", "1 MiB", "3 GiB", "1536 bytes", "12 bytes"]


def test_crossover_in_words() -> None:
    def rows(*faster: bool) -> List[route_times.Row]:
        return [route_times.Row(1 << (20 + i), 2.0, 1.0 if fast else 3.0) for i, fast in enumerate(faster)]

    assert route_times.crossover(rows(False, False, True, True)) == \
        "broadcast is faster from 4 MiB per rank on; single is faster at 2 MiB"
    assert route_times.crossover(rows(True, True)) == "broadcast is faster at every size measured"
    assert route_times.crossover(rows(False, False)) == "single is faster at every size measured"
    assert route_times.crossover(rows(False, True, False)) == "no single crossover: broadcast is faster at 2 MiB per rank only"
