"""The peak and time of torch's object collectives, torch's way and memgather's: one command.

    .venv/bin/python -m benchmarks.object_peaks [--mib 96,96] [--repeat 2] [--calls all_gather_object]

Rank i holds ``MIB[i]`` MiB of evaluation results, as COCO-style evaluators collect them: a list
with one dict per image (``image_id``, and ``boxes``, ``scores``, ``labels`` tensors of 300
detections). Each rank makes each call (``--calls``, default the first three) from a target
module, ``benchmarks.object_user``: ``dist.all_gather_object``, ``dist.gather_object`` to rank 0,
``dist.broadcast_object_list([results])`` from rank 0, and ``detectron2_all_gather``, a copy of
detectron2's ``comm.all_gather`` (a gloo group of its own, then ``all_gather_object`` on it);
unpatched and then with ``memgather.patch()`` (in turn, ``--repeat`` times), checks that both
give the same objects, and reports the median peak growth of its resident set during the call
(``memgather.tools.rss``, the C heap's free pages returned first) as a multiple of the objects
it received, as they lie in memory once the call is over (on a rank that receives nothing: of
its own object's pickled bytes), and as a multiple of the pickled bytes it received, and the
median time of the call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

_DETECTIONS = 300


def results(mib: float, rank: int) -> List[Dict[str, Any]]:
    """About ``mib`` MiB of per-image detections, seeded by ``rank``."""
    generator = torch.Generator().manual_seed(rank)
    per_image = _DETECTIONS * (4 * 4 + 4 + 8)
    images = max(1, int(mib * (1 << 20)) // per_image)
    return [
        {
            "image_id": rank * 1_000_000 + index,
            "boxes": torch.rand(_DETECTIONS, 4, generator=generator),
            "scores": torch.rand(_DETECTIONS, generator=generator),
            "labels": torch.randint(0, 80, (_DETECTIONS,), generator=generator),
        }
        for index in range(images)
    ]


def same(a: Any, b: Any) -> bool:
    """Whether two unpickled objects are alike in type, structure and every tensor's bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.stride(), a.requires_grad) == (b.dtype, b.shape, b.stride(), b.requires_grad) and (
            torch.equal(a, b)
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _rank(rank: int, world: int, store: str, mib: List[float], repeat: int, calls: List[str]) -> Dict[str, Any]:
    import io

    import memgather
    from benchmarks import object_user
    from memgather.tools import rss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    local = results(mib[rank], rank)
    stream = io.BytesIO()
    dist.distributed_c10d._pickler(stream).dump(local)
    sizes: List[Optional[int]] = [None] * world
    dist.all_gather_object(sizes, stream.getbuffer().nbytes)
    del stream
    gathered = {
        "all_gather_object": sum(sizes),
        "detectron2_all_gather": sum(sizes),
        "gather_object": sum(sizes) if rank == 0 else sizes[rank],
        "broadcast_object_list": sizes[0],
    }
    rss.track_allocations(True)
    out: Dict[str, Any] = {}
    for name in calls:
        call = getattr(object_user, name)
        # Whether this rank receives objects (the others' peaks are told against their own pickled bytes).
        result_here = name in ("all_gather_object", "detectron2_all_gather") or (rank == 0) is (name == "gather_object")
        call(rank)  # first-call costs (the group's first collectives, imports) are not the call's
        peaks: Dict[str, List[float]] = {"torch": [], "memgather": []}
        times: Dict[str, List[float]] = {"torch": [], "memgather": []}
        pickled: Dict[str, List[float]] = {"torch": [], "memgather": []}
        got: Dict[str, Any] = {}
        for _ in range(repeat):
            for way in ("torch", "memgather"):
                if way == "memgather":
                    memgather.patch(["benchmarks.object_user"])
                rss.trim()
                dist.barrier()
                before = rss.current_bytes()
                rss.reset_peak()
                started = time.perf_counter()
                answer = call(local)
                times[way].append(time.perf_counter() - started)
                peak = rss.peak_bytes() - before
                rss.trim()
                held = rss.current_bytes() - before  # the gathered objects, as they lie in memory
                # (Tiny objects may fit in pages already resident: no multiple then, only the time.)
                base = held if result_here else gathered[name]
                peaks[way].append(peak / base if base > 0 else -1.0)
                pickled[way].append(peak / gathered[name])
                got[way] = answer
                del answer
                memgather.unpatch()
            alike = same(got["torch"], got["memgather"])
            got.clear()
        out[name] = {
            "same": alike,
            **{f"{way}_peak": statistics.median(v) for way, v in peaks.items()},
            **{f"{way}_s": statistics.median(v) for way, v in times.items()},
            **{f"{way}_per_pickled": statistics.median(v) for way, v in pickled.items()},
        }
    dist.barrier()
    dist.destroy_process_group()
    return out


def measure(mib: Sequence[float], repeat: int, calls: Sequence[str]) -> List[Dict[str, Any]]:
    """Per rank and call: the median peak (x gathered objects) and time, each way, and whether they matched."""
    from benchmarks import processes

    rows = []
    for rank, got in enumerate(processes.spawned(_rank, len(mib), list(mib), repeat, list(calls))):
        for name, row in got.items():
            rows.append({"rank": rank, "mib": mib[rank], "call": name, **row})
    return rows


CALLS = ("all_gather_object", "gather_object", "broadcast_object_list", "detectron2_all_gather")


def _multiple(value: float) -> str:
    return f"{value:.3f} x" if value >= 0 else "  -    "  # (objects too small to show in the resident set)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.object_peaks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mib", default="96,96", help="MiB of results on each rank, comma-separated (default 96,96)")
    parser.add_argument("--repeat", type=int, default=2, help="calls of each way per rank (default 2)")
    parser.add_argument("--calls", default=",".join(CALLS[:3]), help=f"comma-separated, of {', '.join(CALLS)}")
    args = parser.parse_args(argv)
    try:
        mib = [float(m) for m in args.mib.split(",")]
    except ValueError:
        parser.error(f"--mib {args.mib!r}: MiB per rank, comma-separated numbers")
    calls = [c.strip() for c in args.calls.split(",") if c.strip()]
    if len(mib) < 2 or min(mib) <= 0 or args.repeat < 1 or not calls or set(calls) - set(CALLS):
        parser.error(f"--mib needs two ranks or more, each above 0; --repeat at least 1; --calls of {CALLS}")
    rows = measure(mib, args.repeat, calls)
    print(
        "peak resident-set growth during the call, as a multiple of the objects received (of the pickled bytes"
        " received); medians"
    )
    print(f"{'call':<24} rank  MiB    torch              memgather          torch s  memgather s  same")
    for row in rows:
        print(
            f"{row['call']:<24} {row['rank']:<5} {row['mib']:<6g} "
            f"{_multiple(row['torch_peak'])} ({row['torch_per_pickled']:.2f})   "
            f"{_multiple(row['memgather_peak'])} ({row['memgather_per_pickled']:.2f})   "
            f"{row['torch_s']:7.3f}  {row['memgather_s']:7.3f}      {'yes' if row['same'] else 'NO'}"
        )
    return 0 if all(row["same"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
