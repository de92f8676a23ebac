"""The user's peak of the libraries' uneven gathers, torch's way and memgather's: one command.

    .tox/newest/bin/python -m integration.uneven_peaks [--mib 120,40] [--repeat 2]

Rank i holds ``MIB[i]`` MiB of float32 (the ranks' lengths differ). Each rank runs each
user-facing call below unpatched and then with ``memgather.patch()`` (in turn, ``--repeat``
times), checks that both give the same bytes, and reports the median peak growth of its
resident set during the call as a multiple of the call's result (every block of 64 KiB or
more mapped afresh and unmapped when freed: ``rss.track_allocations``):

- torchmetrics ``CatMetric.compute()``: its list state synced (``gather_all_tensors``, uneven:
  padded to the longest rank by torchmetrics), then concatenated; the result is every rank's values;
- MONAI ``evenly_divisible_all_gather(data, concat=True)``: padded to the longest rank by MONAI;
- MONAI ``Cumulative.get_buffer()``: its buffer stacked, then as above;
- Ignite ``idist.all_gather_tensors_with_shapes(tensor, shapes)`` (padded to the longest rank by
  Ignite, gathered, each rank's slice returned), then ``torch.cat`` of the list;
- Lightning Fabric's ``_gather_all_tensors`` (torchmetrics' copy: padded, gathered, sliced), then
  ``torch.cat`` of the list.

The calls of the libraries installed run: the ``newest`` tox environment has both, with Ignite,
through which MONAI then gathers; the ``monai`` one has MONAI alone, which then gathers
through torch.distributed itself.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


def _cat_metric(local: torch.Tensor) -> Callable[[], torch.Tensor]:
    from torchmetrics.aggregation import CatMetric

    metric = CatMetric()
    metric.update(local.clone())  # the metric's own state, as a metric's updates leave it: nothing else holds it
    return metric.compute


def _evenly(local: torch.Tensor) -> Callable[[], torch.Tensor]:
    from monai.utils.dist import evenly_divisible_all_gather

    return lambda: evenly_divisible_all_gather(local, concat=True)


def _cumulative(local: torch.Tensor) -> Callable[[], torch.Tensor]:
    from monai.metrics import Cumulative

    buffer = Cumulative()
    buffer.extend(local.view(-1, 1024))
    return lambda: buffer.get_buffer()


def _with_shapes(local: torch.Tensor) -> Callable[[], torch.Tensor]:
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, torch.tensor([local.numel()]))
    shapes = [[int(n)] for n in lengths]

    def call() -> torch.Tensor:
        import ignite.distributed as idist

        # The list of every rank's tensor, concatenated at once, as a caller that wants one tensor does.
        return torch.cat(idist.all_gather_tensors_with_shapes(local, shapes))

    return call


def _fabric_gather(local: torch.Tensor) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        from lightning_fabric.utilities.distributed import _gather_all_tensors

        return torch.cat(_gather_all_tensors(local))  # every rank's values, as a caller that wants one tensor has them

    return call


CALLS: Dict[str, Callable[[torch.Tensor], Callable[[], torch.Tensor]]] = {
    name: make
    for name, make, library in (
        ("torchmetrics CatMetric.compute()", _cat_metric, "torchmetrics"),
        ("MONAI evenly_divisible_all_gather(concat=True)", _evenly, "monai"),
        ("MONAI Cumulative.get_buffer()", _cumulative, "monai"),
        ("Ignite all_gather_tensors_with_shapes + torch.cat", _with_shapes, "ignite"),
        ("Lightning Fabric _gather_all_tensors + torch.cat", _fabric_gather, "lightning_fabric"),
    )
    if importlib.util.find_spec(library) is not None  # the calls of the libraries installed here
}


def _rank(rank: int, world: int, store: str, mib: List[float], repeat: int) -> Dict[str, Any]:
    import memgather
    from memgather.tools import rss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    numel = [int(m * (1 << 20)) // 4 // 1024 * 1024 for m in mib]
    local = torch.rand(numel[rank], generator=torch.Generator().manual_seed(rank))
    rss.track_allocations(True)
    samples: Dict[str, Dict[str, List[float]]] = {name: {"torch": [], "memgather": []} for name in CALLS}
    same: Dict[str, bool] = {}
    for name, make in CALLS.items():
        make(local[:1024])()  # first-call costs (the group's first collectives, imports) are not the call's
        digests = {}
        for _ in range(repeat):
            for way in ("torch", "memgather"):
                if way == "memgather":
                    memgather.patch(["torchmetrics", "monai", "ignite", "lightning_fabric"])
                call = make(local)
                dist.barrier()
                before = rss.current_bytes()
                rss.reset_peak()
                result = call()
                grown = rss.peak_bytes() - before
                digests[way] = hashlib.sha256(result.numpy().tobytes()).hexdigest()
                samples[name][way].append(grown / (result.numel() * result.element_size()))
                del result, call
                memgather.unpatch()
        same[name] = digests["torch"] == digests["memgather"]
    dist.barrier()
    dist.destroy_process_group()
    return {"samples": samples, "same": same}


def measure(mib: Sequence[float], repeat: int) -> List[Dict[str, Any]]:
    """Per rank: per call, the median peak (x result) torch's way and memgather's, and whether they matched."""
    from benchmarks import processes

    rows = []
    for rank, got in enumerate(processes.spawned(_rank, len(mib), list(mib), repeat)):
        for name, ways in got["samples"].items():
            rows.append({"rank": rank, "mib": mib[rank], "call": name, "same": got["same"][name],
                         **{way: statistics.median(values) for way, values in ways.items()}})
    return rows


# Each call's peak with memgather, as a multiple of its result: the result alone, or the library's own
# clone of it beside it (torchmetrics' compute(), MONAI's get_buffer()).
FLOORS = {"torchmetrics CatMetric.compute()": 2, "MONAI evenly_divisible_all_gather(concat=True)": 1,
          "MONAI Cumulative.get_buffer()": 2, "Ignite all_gather_tensors_with_shapes + torch.cat": 1,
          "Lightning Fabric _gather_all_tensors + torch.cat": 1}


def floor(call: str, share: float) -> float:
    """``call``'s peak with memgather, as a multiple of its result, on a rank holding ``share`` of the rows.

    torchmetrics before 1.6 gathers its own rank's rows too (later releases hand back the input in their
    place) and its ``_sync_dist`` concatenates the list while it lives, beside the copy ``sync()`` keeps of
    the local state: the list, the cat and that copy, where later releases' list holds the other ranks'
    rows alone (2 x in all)."""
    if call == "torchmetrics CatMetric.compute()":
        from importlib import metadata

        from packaging.version import Version

        if Version(metadata.version("torchmetrics")) < Version("1.6"):
            return 2 + share
    return FLOORS[call]


def check_floors(mib: Sequence[float] = (24, 8)) -> None:
    """The integration environments' check: every call of the libraries installed, values torch's, its
    peak at its floor with memgather and at least one result above it without."""
    rows = measure(mib, 1)
    assert rows, "no library of integration/uneven_peaks.py is installed here"
    for row in rows:
        print(row)
        assert row["same"], row
        least = floor(row["call"], mib[row["rank"]] / sum(mib))
        assert row["memgather"] <= least + 0.1 and row["torch"] >= least + 1, row


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integration.uneven_peaks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="120,40", help="MiB on each rank, comma-separated (default 120,40)")
    parser.add_argument("--repeat", type=int, default=2, help="calls of each way per rank (default 2)")
    args = parser.parse_args(argv)
    try:
        mib = [float(m) for m in args.mib.split(",")]
    except ValueError:
        parser.error(f"--mib {args.mib!r}: MiB per rank, comma-separated numbers")
    if len(mib) < 2 or min(mib) <= 0 or args.repeat < 1:
        parser.error("--mib needs two ranks or more, each above 0; --repeat at least 1")
    rows = measure(mib, args.repeat)
    print(f"peak resident-set growth during the call, as a multiple of its result ({sum(mib):g} MiB), medians")
    print(f"{'call':<50} rank  MiB    torch   memgather  same")
    for row in rows:
        print(f"{row['call']:<50} {row['rank']:<5} {row['mib']:<6g} {row['torch']:.3f} x  {row['memgather']:.3f} x"
              f"    {'yes' if row['same'] else 'NO'}")
    return 0 if all(row["same"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
