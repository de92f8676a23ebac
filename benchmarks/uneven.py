"""An uneven gather as libraries write it, against ``memgather.gather_uneven``: peak memory and time.

    python benchmarks/uneven.py [--mib 120,40] [--repeat 3]

Rank i holds ``MIB[i]`` MiB of float32 rows of 256 columns (the ranks' dim 0 differs).
torch's way is what MONAI's ``evenly_divisible_all_gather(concat=True)`` and the uneven
path of torchmetrics' ``gather_all_tensors`` do: gather every rank's row count, pad
each rank to the largest, all_gather a list of ``zeros_like`` slots, slice each slot
back and ``torch.cat`` the slices. memgather's is one call of ``gather_uneven``. Each
rank runs both in one process (one gloo group, alternating, ``--repeat`` times each),
checks that they give the same bytes, and reports the peak growth of its resident set
during the call as a multiple of the gathered result (every block of 64 KiB or more is
mapped afresh and unmapped when freed: ``rss.track_allocations``), and the median time.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

# ``python benchmarks/uneven.py``: the repository root, for memgather.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

COLUMNS = 256
PROG = "python benchmarks/uneven.py"


def padded(local: Any) -> Any:
    """torch's way: row counts, pad to the longest, a list all_gather, slices, cat."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    length = torch.tensor([local.shape[0]])
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    longest = max(sizes)
    extra = longest - local.shape[0]
    padded_local = torch.nn.functional.pad(local, (0, 0, 0, extra)) if extra else local
    slots = [torch.zeros_like(padded_local) for _ in range(world)]
    dist.all_gather(slots, padded_local)
    return torch.cat([slot[:size] for slot, size in zip(slots, sizes)])


def uneven(local: Any) -> Any:
    import memgather

    return memgather.gather_uneven(local)


WAYS = {"torch": padded, "memgather": uneven}


def _rank(rank: int, world: int, store: str, mib: List[float], repeat: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from memgather.tools import rss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = [int(m * (1 << 20)) // (4 * COLUMNS) for m in mib]
    local = torch.rand(rows[rank], COLUMNS, generator=torch.Generator().manual_seed(rank))
    result_bytes = sum(rows) * COLUMNS * 4
    rss.track_allocations(True)
    samples: Dict[str, List[List[float]]] = {name: [] for name in WAYS}
    digests: Dict[str, str] = {}
    for way in WAYS.values():
        way(local[:1])  # first-call costs (the group's first collectives) are not the gather's
    for _ in range(repeat):
        for name, way in WAYS.items():
            dist.barrier()
            before = rss.current_bytes()
            rss.reset_peak()
            started = time.perf_counter()
            result = way(local)
            seconds = time.perf_counter() - started
            grown = rss.peak_bytes() - before
            digests[name] = hashlib.sha256(result.numpy().tobytes()).hexdigest()
            del result
            samples[name].append([grown / result_bytes, seconds])
    dist.barrier()
    dist.destroy_process_group()
    return {"samples": samples, "same": digests["torch"] == digests["memgather"]}


def measure(mib: Sequence[float], repeat: int) -> List[Dict[str, Any]]:
    """Each rank's median peak (x result) and seconds per way, and whether the results matched."""
    from benchmarks import processes

    rows = []
    for rank, got in enumerate(processes.spawned(_rank, len(mib), list(mib), repeat)):
        row: Dict[str, Any] = {"rank": rank, "mib": mib[rank], "same": got["same"]}
        for name, samples in got["samples"].items():
            row[name] = (statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples))
        rows.append(row)
    return rows


def table(rows: List[Dict[str, Any]]) -> List[str]:
    lines = ["rank  MiB   torch peak   memgather peak   peak ratio   time ratio   same result"]
    for row in rows:
        (t_peak, t_s), (m_peak, m_s) = row["torch"], row["memgather"]
        lines.append(
            f"{row['rank']:<5} {row['mib']:<5g} {t_peak:>8.3f} x   {m_peak:>10.3f} x   {m_peak / t_peak:>10.3f}"
            f"   {m_s / t_s:>10.3f}   {'yes' if row['same'] else 'NO'}"
        )
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", default="120,40", help="MiB of rows on each rank, comma-separated (default 120,40)")
    parser.add_argument("--repeat", type=int, default=3, help="calls of each way per rank (default 3)")
    args = parser.parse_args(argv)
    try:
        mib = [float(m) for m in args.mib.split(",")]
    except ValueError:
        parser.error(f"--mib {args.mib!r}: MiB per rank, comma-separated numbers")
    if len(mib) < 2 or min(mib) < 0 or args.repeat < 1:
        parser.error("--mib needs two ranks or more, none negative; --repeat at least 1")
    from memgather.tools import rss

    if not rss.available():
        parser.error("peak memory needs Linux's /proc/self/clear_refs")
    rows = measure(mib, args.repeat)
    print(f"peak resident-set growth during the call, as a multiple of the gathered result ({sum(mib):g} MiB);")
    print("time and peak ratios are memgather's / torch's, medians of --repeat calls")
    print("\n".join(table(rows)))
    return 0 if all(row["same"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
