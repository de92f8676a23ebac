"""``memgather bench``: peak memory and time of a gather, torch vs memgather.

Each mode runs in fresh processes (``--world-size`` ranks on gloo, one
process group per mode), on the same data, and the table compares them. Peak
memory counts the input plus what the gather adds, like the reference figure
in Accelerate PR #1968: the resident-set high-water mark, reset through
``/proc/self/clear_refs`` right before the call (Linux only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memgather import rss

SEED_SHAPE = (64, 224, 224, 64)
DEFAULT_SHAPE = (16, 224, 224, 16)  # 49 MiB of float32 per rank: about a minute in all on 2 cores
MODES = ("torch", "memgather")


@dataclass
class RankResult:
    """What one rank measured in one mode."""

    peaks: List[int]
    seconds: List[float]
    digest: str


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.overhead:
        from memgather import overhead

        print(overhead.table(overhead.measure()))
        return 0
    if not rss.available():
        print("memgather bench needs Linux's /proc/self/clear_refs to reset the peak RSS; not found here.", file=sys.stderr)
        return 2
    shape = SEED_SHAPE if args.shape == "seed" else tuple(int(d) for d in args.shape.split(","))
    results = {}
    for mode in MODES:
        print(f"[bench] {mode}: {args.world_size} ranks on gloo, shape {shape} {args.dtype}, {args.repeat} repeats", flush=True)
        results[mode] = _run_mode(mode, args.world_size, shape, args.dtype, args.repeat)
    rows = [_row("empty_like slots (list)", args.world_size, shape, args.dtype, results)]
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0 if all(row["identical"] for row in rows) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memgather bench",
        description="Measure peak memory and time of all_gather into fresh empty_like slots, "
        "torch's own vs memgather's, on gloo ranks of this machine.",
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)),
                        help="per-rank shape as comma-separated ints, or 'seed' for (64,224,224,64), "
                        "the reference shape (default %(default)s)")
    parser.add_argument("--dtype", default="float32", help="torch dtype name (default float32)")
    parser.add_argument("--repeat", type=int, default=5, help="gathers per mode; times are medians (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    parser.add_argument("--overhead", action="store_true",
                        help="instead: microseconds memgather adds per call (torch's no-op 'fake' backend, in-process)")
    return parser


def _run_mode(mode: str, world: int, shape: Tuple[int, ...], dtype: str, repeat: int) -> List[RankResult]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world, port, mode, shape, dtype, repeat, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    by_rank = dict(queue.get(timeout=3600) for _ in procs)
    for proc in procs:
        proc.join()
    return [RankResult(**by_rank[rank]) for rank in range(world)]


def _rank_main(rank: int, world: int, port: int, mode: str, shape: Tuple[int, ...], dtype: str, repeat: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    import memgather

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from memgather.core import original_all_gather

    # torch's own function, even if MEMGATHER=1 patched this process at start-up
    gather = memgather.all_gather if mode == "memgather" else original_all_gather()
    generator = torch.Generator().manual_seed(rank)
    tensor = (torch.rand(shape, generator=generator) * 1000).to(getattr(torch, dtype))
    peaks, seconds, digest = [], [], ""
    for index in range(repeat):
        slots = [torch.empty_like(tensor) for _ in range(world)]
        dist.barrier()
        rss.reset_peak()
        before = rss.current_bytes()
        start = time.perf_counter()
        gather(slots, tensor)
        seconds.append(time.perf_counter() - start)
        peaks.append(tensor.numel() * tensor.element_size() + rss.peak_bytes() - before)
        if index == 0:
            digest = _digest(slots)
        del slots
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, asdict(RankResult(peaks, seconds, digest))))
    queue.close()
    queue.join_thread()


def _digest(slots: List[Any]) -> str:
    import torch

    sha = hashlib.sha256()
    for slot in slots:
        sha.update(slot.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _row(pattern: str, world: int, shape: Tuple[int, ...], dtype: str, results: Dict[str, List[RankResult]]) -> Dict[str, Any]:
    peak = {mode: max(max(r.peaks) for r in ranks) for mode, ranks in results.items()}
    median = {mode: statistics.median(max(r.seconds[i] for r in ranks) for i in range(len(ranks[0].seconds)))
              for mode, ranks in results.items()}
    identical = [r.digest for r in results["torch"]] == [r.digest for r in results["memgather"]]
    return {
        "pattern": pattern, "backend": "gloo", "world_size": world, "shape": list(shape), "dtype": dtype,
        "peak_torch": peak["torch"], "peak_memgather": peak["memgather"],
        "peak_ratio": peak["memgather"] / peak["torch"],
        "time_torch": median["torch"], "time_memgather": median["memgather"],
        "time_ratio": median["memgather"] / median["torch"],
        "identical": identical,
    }


def _table(rows: List[Dict[str, Any]]) -> str:
    header = ("pattern", "backend", "world", "peak torch", "peak memgather", "ratio", "time torch", "time memgather", "ratio", "identical")
    lines = [header]
    for row in rows:
        lines.append((
            row["pattern"], row["backend"], str(row["world_size"]),
            _gib(row["peak_torch"]), _gib(row["peak_memgather"]), f"{row['peak_ratio']:.3f}",
            f"{row['time_torch'] * 1e3:.1f} ms", f"{row['time_memgather'] * 1e3:.1f} ms", f"{row['time_ratio']:.3f}",
            "yes" if row["identical"] else "NO",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines)


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
