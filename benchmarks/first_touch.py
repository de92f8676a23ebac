"""What huge-page advice saves on a buffer's first touch.

    python benchmarks/first_touch.py [--sizes 32M] [--repeat 20]

memgather advises the large CPU buffers it is about to fill (``pages.advise``).
This times that first fill, in this process: each sample allocates a fresh
buffer of the size asked for, advises it or not, and writes every byte once
(``fill_``, one thread), so the time is mostly the page faults of the first
touch. The advice is inside the advised variant's time. While measuring,
every block of 64 KiB or more is mapped afresh and unmapped when freed
(``rss.track_allocations``): otherwise glibc would serve later buffers from
pages an earlier one already touched. Samples alternate between the variants;
a row gives the median of each. Whether advice helps depends on the kernel's
transparent huge pages: ``madvise`` mode (a common default) honours it,
``always`` gives huge pages without it, ``never`` ignores it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# ``python benchmarks/first_touch.py``: the repository root, for memgather.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from memgather.engine import pages  # noqa: E402 - after the repository root is on sys.path
from memgather.tools import bench, rss  # noqa: E402 - after the repository root is put on sys.path

PROG = "python benchmarks/first_touch.py"
VARIANTS = ("plain", "advised")
DEFAULT_SIZES = (32 << 20,)
DEFAULT_REPEAT = 20
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class Row:
    """Median seconds to allocate and first fill a buffer of ``size`` bytes, each variant."""

    size: int
    plain: float
    advised: float


def usable() -> str:
    """Why the advice cannot be timed here, or '' when it can."""
    if not pages.available():
        return "huge-page advice is not given here (it needs Linux, and MEMGATHER_HUGE_PAGES not 0)"
    return ""


def check_sizes(sizes: Sequence[int]) -> None:
    """Raise ValueError for a size memgather would not advise (below ``pages.MIN_BYTES``)."""
    small = [size for size in sizes if size < pages.MIN_BYTES]
    if small:
        raise ValueError(
            f"--sizes: {', '.join(map(str, small))} bytes: memgather advises buffers from "
            f"{pages.MIN_BYTES >> 20} MiB on, so smaller ones would time the same code twice"
        )


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or 'unknown'."""
    try:
        text = _THP.read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def measure(sizes: Sequence[int], repeat: int) -> List[Row]:
    """Median first-fill time of each variant at each size, ``repeat`` fresh buffers each."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rss.track_allocations(True)
    try:
        result = []
        for size in sizes:
            samples: Dict[str, List[float]] = {variant: [] for variant in VARIANTS}
            for variant in VARIANTS:
                _touch(size, variant == "advised")  # warm-up: the allocator's and torch's first-call costs
            for index in range(repeat):
                for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
                    samples[variant].append(_touch(size, variant == "advised"))
            result.append(Row(size, statistics.median(samples["plain"]), statistics.median(samples["advised"])))
        return result
    finally:
        rss.track_allocations(False)
        torch.set_num_threads(threads)


def _touch(size: int, advise: bool) -> float:
    """Seconds to allocate a fresh buffer of ``size`` bytes, advise it (or not) and fill it once."""
    import torch

    start = time.perf_counter()
    buffer = torch.empty(size, dtype=torch.uint8)
    if advise:
        pages.advise(buffer)
    buffer.fill_(1)
    elapsed = time.perf_counter() - start
    del buffer
    return elapsed


def table(rows: Sequence[Row], repeat: int) -> str:
    """The rows as an aligned text table, with a header line naming the kernel's mode."""
    lines = [("size", "plain", "advised", "plain/advised")]
    for row in rows:
        lines.append((bench.size_label(row.size), _ms(row.plain), _ms(row.advised), f"{row.plain / row.advised:.2f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    body = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    head = (
        f"first touch of a fresh CPU buffer (allocate, advise or not, fill once; one thread), median of "
        f"{repeat} per variant; transparent huge pages: {transparent_huge_pages()}"
    )
    return "\n".join([head, *body])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Time to allocate and first fill a fresh CPU buffer of each of --sizes, with and without "
        "memgather's huge-page advice (MADV_HUGEPAGE), in this process; the kernel's transparent huge page "
        "mode decides whether the advice helps.",
    )
    parser.add_argument(
        "--sizes",
        metavar="SIZES",
        help="buffer sizes, comma-separated, each a whole number with an optional K, M or G (KiB, "
        f"MiB, GiB), from {pages.MIN_BYTES >> 20} MiB on (default {bench.sizes_text(DEFAULT_SIZES)})",
    )
    parser.add_argument(
        "--repeat",
        type=bench.positive,
        default=DEFAULT_REPEAT,
        metavar="N",
        help=f"fresh buffers per variant and size (default {DEFAULT_REPEAT})",
    )
    args = parser.parse_args(argv)
    try:
        sizes = bench.parse_sizes(args.sizes) if args.sizes else list(DEFAULT_SIZES)
        check_sizes(sizes)
    except ValueError as error:
        return bench.usage_error(error, PROG)
    reason = usable()
    if reason:
        return bench.usage_error(reason, PROG)
    print(table(measure(sizes, args.repeat), args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
