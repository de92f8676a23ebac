"""gloo's two routes timed against each other, per size.

    python benchmarks/route_times.py [--world-size 2] [--sizes 4K,256K,...] [--repeat 5] [--rounds 1]

Where memgather's gloo threshold (``routes.BROADCAST_MIN_BYTES_PER_RANK``)
comes from. For each per-rank size, ``world`` gloo ranks (fresh processes, as
``memgather bench`` starts them: ``memgather.tools.bench.spawn``) gather a
float32 tensor into one flat buffer, kept from call to call, by each route:

- single: torch's single-tensor all-gather (``compat.single_tensor_primitive``),
  which gloo stages through a gathered-size temporary of its own;
- broadcast: memgather's broadcast route as a rewired call takes it: the
  metadata agreement round (``agreement.agree``), then one async broadcast
  per rank into its view of the buffer (``routes.broadcast_into``).

Both routes are checked to gather the right values before they are timed.
Samples alternate between the routes; each times enough calls for about 50
ms on the slowest rank (``bench.calls_per_sample``), and a sample's per-call
time is the slowest rank's. A row gives the median over samples and rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

# ``python benchmarks/route_times.py``: the repository root, for memgather (the rank processes get this sys.path).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from memgather.tools import bench  # noqa: E402 - after the repository root is on sys.path

PROG = "python benchmarks/route_times.py"
ROUTES = ("single", "broadcast")
DEFAULT_SIZES = (4 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20, 64 << 20)
DEFAULT_REPEAT = bench.DEFAULT_REPEAT
_ITEMSIZE = 4  # float32

# Per size (bytes per rank), per route: seconds per call, one entry per sample.
Samples = Dict[int, Dict[str, List[float]]]


@dataclass(frozen=True)
class Row:
    """Median seconds per gather of each route at one size."""

    bytes_per_rank: int
    single: float
    broadcast: float


def usable() -> str:
    """Why the routes cannot be timed on this torch, or '' when they can."""
    from memgather import compat

    if compat.single_tensor_primitive().function is None:
        return "this torch has no single-tensor all-gather"
    if not compat.gloo_has_single_tensor():
        return "gloo has no single-tensor all-gather on this torch (from torch 2.2 on)"
    return ""


def check_sizes(sizes: Sequence[int]) -> None:
    """Raise ValueError unless every size is a positive whole number of float32 elements."""
    bad = [size for size in sizes if size <= 0 or size % _ITEMSIZE]
    if bad:
        raise ValueError(
            f"--sizes: {', '.join(map(str, bad))} bytes: each size must be a positive multiple of 4 bytes (float32)"
        )


def measure(world: int, sizes: Sequence[int], repeat: int) -> Samples:
    """One round: ``world`` fresh gloo ranks time both routes at every size; the slowest
    rank's per-call time of each sample."""
    by_rank: List[Samples] = bench.spawn(_rank, world, "gloo", tuple(sizes), repeat)
    return {
        size: {route: [max(per_rank) for per_rank in zip(*(r[size][route] for r in by_rank))] for route in ROUTES}
        for size in sizes
    }


def rows(rounds: Sequence[Samples]) -> List[Row]:
    """Median per route and size over every sample of every round."""
    sizes = list(rounds[0])
    median = {
        (size, route): statistics.median([s for samples in rounds for s in samples[size][route]])
        for size in sizes
        for route in ROUTES
    }
    return [Row(size, median[size, "single"], median[size, "broadcast"]) for size in sizes]


def crossover(table_rows: Sequence[Row]) -> str:
    """Where broadcast starts to beat single, in words."""
    faster = [row.broadcast < row.single for row in table_rows]
    labels = [bench.size_label(row.bytes_per_rank) for row in table_rows]
    if all(faster):
        return "broadcast is faster at every size measured"
    if not any(faster):
        return "single is faster at every size measured"
    first = faster.index(True)
    if all(faster[first:]):
        return f"broadcast is faster from {labels[first]} per rank on; single is faster at {labels[first - 1]}"
    won = ", ".join(label for label, fast in zip(labels, faster) if fast)
    return f"no single crossover: broadcast is faster at {won} per rank only"


def table(table_rows: Sequence[Row], world: int, repeat: int, rounds: int) -> str:
    """The rows as an aligned text table, a header line above and the crossover below."""
    import torch

    lines = [("per rank", "single", "broadcast", "broadcast/single")]
    for row in table_rows:
        lines.append(
            (
                bench.size_label(row.bytes_per_rank),
                _ms(row.single),
                _ms(row.broadcast),
                f"{row.broadcast / row.single:.2f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    body = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    head = (
        f"gloo, world {world}, torch {torch.__version__}: median time per gather (slowest rank), "
        f"{repeat} samples x {rounds} round{'s' if rounds != 1 else ''} per route and size"
    )
    return "\n".join([head, *body, f"crossover: {crossover(table_rows)}"])


def _ms(seconds: float) -> str:
    millis = seconds * 1e3
    return f"{millis:.0f} ms" if millis >= 100 else f"{millis:.3g} ms"


def _rank(rank: int, world: int, port: int, backend: str, sizes: Sequence[int], repeat: int) -> Samples:
    """What one rank measures (``bench.spawn`` runs it in each rank process)."""
    import torch

    bench.join(rank, world, port, backend)
    samples: Samples = {}
    for size in sizes:
        tensor = torch.full((size // _ITEMSIZE,), float(rank))
        flat = torch.empty(world * tensor.numel())
        gathers = _gathers(flat, world)
        for route, gather in gathers.items():
            flat.zero_()
            gather(tensor)
            _check(flat, world, route)
        calls = {route: bench.calls_per_sample(gather, tensor) for route, gather in gathers.items()}
        samples[size] = {route: [] for route in ROUTES}
        for index in range(repeat):
            for route in ROUTES if index % 2 == 0 else ROUTES[::-1]:  # alternating: drift hits both alike
                samples[size][route].append(bench.timed(gathers[route], tensor, calls[route]) / calls[route])
        del flat, gathers
    bench.leave()
    return samples


def _gathers(flat: Any, world: int) -> Dict[str, Callable[[Any], None]]:
    """Each route as a call that gathers every rank's tensor into ``flat``."""
    from memgather import compat
    from memgather.engine import agreement, core, routes

    primitive = compat.single_tensor_primitive().function
    assert primitive is not None, "this torch has no single-tensor all-gather (see usable())"
    destinations = list(flat.view(world, -1).unbind(0))
    gather_rows = core.original_all_gather()

    def single(tensor: Any) -> None:
        primitive(flat, tensor)

    def broadcast(tensor: Any) -> None:
        reason = agreement.agree(gather_rows, None, tensor, True, True, world, False).reason
        if reason is not None:
            raise RuntimeError(f"the ranks did not agree on the broadcast route: {reason.value}")
        routes.broadcast_into(destinations, tensor, None)

    return {"single": single, "broadcast": broadcast}


def _check(flat: Any, world: int, route: str) -> None:
    """Rank i's part of ``flat`` must hold i everywhere."""
    import torch

    parts = flat.view(world, -1)
    expected = torch.arange(world, dtype=flat.dtype)
    if not (torch.equal(parts.amin(1), expected) and torch.equal(parts.amax(1), expected)):
        raise RuntimeError(f"the {route} route gathered wrong values")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Median time per gather of gloo's two routes at each of --sizes, on --world-size real gloo "
        "ranks (fresh processes): torch's single-tensor all-gather vs memgather's broadcast route (with its "
        "metadata agreement round), and where broadcast starts to win: the source of memgather's 2 MiB gloo "
        "threshold.",
    )
    parser.add_argument("--world-size", type=bench.positive, default=2, help="gloo ranks to spawn (default 2)")
    parser.add_argument(
        "--sizes",
        metavar="SIZES",
        help="bytes per rank, comma-separated, each a whole number with an optional K, M or G "
        f"(KiB, MiB, GiB), a multiple of 4 (default {bench.sizes_text(DEFAULT_SIZES)})",
    )
    parser.add_argument(
        "--repeat",
        type=bench.positive,
        default=DEFAULT_REPEAT,
        metavar="N",
        help=f"timing samples per route and size (default {DEFAULT_REPEAT})",
    )
    parser.add_argument(
        "--rounds",
        type=bench.positive,
        default=1,
        help="fresh process groups, one table's samples each; times are medians over all rounds "
        "(small gathers vary between process pairs: use 15 below 1 MiB)",
    )
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default="gloo",
        help="gloo, the only one timed: NCCL has one route (default gloo)",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.backend == "nccl":
        return bench.usage_error("route_times.py times gloo's routes; NCCL has one route (single_in_place)", PROG)
    try:
        sizes = bench.parse_sizes(args.sizes) if args.sizes else list(DEFAULT_SIZES)
        check_sizes(sizes)
    except ValueError as error:
        return bench.usage_error(error, PROG)
    reason = usable()
    if reason:
        return bench.usage_error(reason, PROG)
    rounds = []
    for round_index in range(args.rounds):
        started = time.perf_counter()
        print(
            f"[route_times] {args.world_size} ranks, gloo, {', '.join(map(bench.size_label, sizes))} per rank, "
            f"{args.repeat} samples, round {round_index + 1}/{args.rounds} ...",
            end="",
            flush=True,
        )
        rounds.append(measure(args.world_size, sizes, args.repeat))
        print(f" {time.perf_counter() - started:.1f} s", flush=True)
    print(table(rows(rounds), args.world_size, args.repeat, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
