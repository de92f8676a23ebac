"""What ``memgather.pth`` costs a Python start-up with MEMGATHER unset.

    python benchmarks/startup.py [--repeat 100]

``site`` runs the file's one line at every interpreter start. Two measures:

- the line alone, in this process with ``MEMGATHER`` removed from the
  environment meanwhile: compiled once (the floor), and as ``site`` runs it
  (``exec`` of its text, which compiles it each time); ``timeit``, medians;
- whole start-ups: ``python -c pass`` in two bare virtual environments made
  for the purpose (``venv --without-pip``), one with ``memgather.pth`` in its
  site-packages and one without, alternating, each run timed from this
  process around ``subprocess.run``. The one with the file is checked to
  process it: with ``MEMGATHER=1`` its line must run (and fail there, where
  memgather is not installed).

The line is read from the ``memgather.pth`` beside the ``memgather``
package: the installed one in site-packages, or the one in a source checkout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# ``python benchmarks/startup.py``: the repository root, for memgather.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

PROG = "python benchmarks/startup.py"
VARIANTS = ("with", "without")
DEFAULT_RUNS = 100


@dataclass(frozen=True)
class Result:
    """Microseconds per run of the line; seconds per ``python -c pass``, every run."""

    pth: str
    line_compiled_us: float
    line_text_us: float
    starts: Dict[str, List[float]]


def pth_file() -> Path:
    """The ``memgather.pth`` beside the ``memgather`` package (site-packages, or a source checkout)."""
    import memgather

    return Path(memgather.__file__).resolve().parent.parent / "memgather.pth"


def usable() -> str:
    """Why the start-up cost cannot be measured here, or '' when it can."""
    path = pth_file()
    if not path.is_file():
        return f"no memgather.pth at {path} (installed from a wheel, memgather has it in site-packages)"
    return ""


def measure(runs: int) -> Result:
    """The line's cost in this process, then ``runs`` start-ups with the file and as many without."""
    path = pth_file()
    line = path.read_text().strip()
    compiled, text = _line_costs(line)
    return Result(str(path), compiled, text, _starts(line, runs))


def _line_costs(line: str) -> Tuple[float, float]:
    """Median microseconds of one run of ``line``: compiled once, and as site runs it (exec of the text)."""
    code = compile(line, "memgather.pth", "exec")
    saved = os.environ.pop("MEMGATHER", None)  # the case measured: unset
    try:
        return _median_us(lambda: exec(code, {})), _median_us(lambda: exec(line, {}))
    finally:
        if saved is not None:
            os.environ["MEMGATHER"] = saved


def _median_us(function: Callable[[], object]) -> float:
    timer = timeit.Timer(function)
    number, _ = timer.autorange()  # enough calls for 0.2 s
    return statistics.median(t / number * 1e6 for t in timer.repeat(repeat=5, number=number))


def _starts(line: str, runs: int) -> Dict[str, List[float]]:
    """Seconds per ``python -c pass`` in a bare venv with ``line`` as memgather.pth, and in one without."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATHER")}
    with tempfile.TemporaryDirectory(prefix="memgather-startup-") as scratch:
        pythons = {variant: _bare_venv(Path(scratch) / variant) for variant in VARIANTS}
        site_packages = next((Path(scratch) / "with").glob("lib/python*/site-packages"))
        (site_packages / "memgather.pth").write_text(line + "\n")
        _check_processed(pythons["with"], env)
        for python in pythons.values():
            _start(python, env)  # warm-up: the first start reads everything from disk
        starts: Dict[str, List[float]] = {variant: [] for variant in VARIANTS}
        for index in range(runs):
            for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
                starts[variant].append(_start(pythons[variant], env))
    return starts


def _bare_venv(directory: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, capture_output=True, timeout=300
    )
    return directory / "bin" / "python"


def _check_processed(python: Path, env: Dict[str, str]) -> None:
    """With MEMGATHER=1 the line imports memgather, which the bare venv lacks: site reports it."""
    done = subprocess.run(
        [str(python), "-c", "pass"], capture_output=True, text=True, env=dict(env, MEMGATHER="1"), timeout=60
    )
    if "memgather" not in done.stderr:
        raise RuntimeError(f"{python} did not process memgather.pth; the start-ups would not measure it")


def _start(python: Path, env: Dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], check=True, env=env, timeout=60)
    return time.perf_counter() - start


def table(result: Result) -> str:
    """The measures as an aligned text table, with the file's path above."""
    with_file, without = (statistics.median(result.starts[v]) for v in VARIANTS)
    runs = len(result.starts["with"])
    lines = [
        ("the line alone, compiled once", f"{result.line_compiled_us:.2f} us", "median, timeit"),
        ("the line as site runs it (exec of its text)", f"{result.line_text_us:.2f} us", "median, timeit"),
        ("python -c pass, bare venv with memgather.pth", f"{with_file * 1e3:.2f} ms", _spread(result.starts["with"])),
        ("python -c pass, bare venv without it", f"{without * 1e3:.2f} ms", _spread(result.starts["without"])),
        ("difference of the medians", f"{(with_file - without) * 1e3:+.2f} ms", f"{runs} runs each, alternating"),
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    body = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    return "\n".join([f"memgather.pth with MEMGATHER unset ({result.pth})", *body])


def _spread(samples: List[float]) -> str:
    """The middle half of the runs, as a measure of the noise."""
    if len(samples) < 4:
        return f"median of {len(samples)}"
    low, _, high = statistics.quantiles(samples, n=4)
    return f"median of {len(samples)}; middle half {low * 1e3:.2f}-{high * 1e3:.2f} ms"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from memgather.tools import bench

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="What memgather.pth costs a Python start-up with MEMGATHER unset: its line alone (timeit: "
        "compiled once, and as site runs it), and 'python -c pass' in a bare venv with the file vs one without, "
        "alternating.",
    )
    parser.add_argument(
        "--repeat",
        type=bench.positive,
        default=DEFAULT_RUNS,
        metavar="N",
        help=f"interpreter start-ups with and without memgather.pth, each (default {DEFAULT_RUNS})",
    )
    args = parser.parse_args(argv)
    reason = usable()
    if reason:
        return bench.usage_error(reason, PROG)
    print(table(measure(args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
