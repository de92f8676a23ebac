"""``memgather selftest``: the first thing to run on a new cluster, before switching memgather on.

Run it as the jobs run: ``torchrun --nproc_per_node N -m memgather selftest`` (any
launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``), or
``memgather selftest`` alone for a world of 1. On the live backend (NCCL when CUDA has
a device, else gloo) it runs each caller pattern of ``memgather bench`` at a few sizes:
torch's own ``all_gather`` first, then the same code under memgather, measured, then
once more in verify mode (every rewired call checked against the original on every
rank: ``VerifyError`` on a difference). Each rank compares the result's bytes with
torch's; the peaks (CPU: resident-set high-water mark; CUDA: allocated and reserved)
are the worst rank's. Rank 0 prints one row per case and one verdict line; every rank
exits 1 if any rank saw a difference, 2 if it could not run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from memgather.tools import bench, patterns, rss

# Per rank. Below gloo's 2 MiB threshold a call goes to torch: the first size shows that path.
CPU_SIZES = (64 << 10, 4 << 20, 32 << 20)
CUDA_SIZES = (64 << 10, 4 << 20, 64 << 20)
# NCCL's default threshold (tens of MiB per rank: memgather.engine.routes) would leave most CUDA
# sizes to torch, and which ones would depend on the world size: unless MEMGATHER_NCCL_MIN_BYTES is
# set, the test takes this one, so that the first size shows the path to torch and the others the
# rewired one.
CUDA_TEST_THRESHOLD = 1 << 20
# A peak above torch's by more than this share and this many bytes is flagged in its row.
_WORSE_SHARE, _WORSE_BYTES = 0.05, 1 << 20
_CALLS = 3  # measured gathers per mode: a single one's resident-set peak varies by a few MiB
_SETTLE_S = 0.5


@dataclass
class Case:
    """One pattern at one size, as this rank measured it (peaks: growth plus the input)."""

    pattern: str
    per_rank: int
    took: str = ""
    peak_torch: int = 0
    peak_memgather: int = 0
    reserved_torch: int = 0
    reserved_memgather: int = 0
    differs: bool = False
    verified: bool = False  # verify mode checked a rewired call
    error: str = ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    import torch.distributed as dist

    import memgather
    from memgather import config

    try:
        if config.load().enabled is False:
            raise ValueError("MEMGATHER=0 switches memgather off in this process; unset it to test")
        sizes = _sizes(args.sizes)
        device = _join(args.backend)
    except (ValueError, RuntimeError) as error:  # a setting, a size, or no group to join: nothing was tested
        print(f"memgather selftest: cannot run: {error}", file=sys.stderr)
        return 2
    sizes = sizes or list(CUDA_SIZES if device.type == "cuda" else CPU_SIZES)
    lowered = device.type == "cuda" and "MEMGATHER_NCCL_MIN_BYTES" not in os.environ
    if lowered:  # this process's own setting, read by every patch() below
        os.environ["MEMGATHER_NCCL_MIN_BYTES"] = str(CUDA_TEST_THRESHOLD)
    cases = [_run_case(pattern, size, device) for pattern in patterns.PATTERNS for size in sizes]
    _worst_of_ranks(cases, device)
    memgather.unpatch()
    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    if rank == 0:
        print(table(cases, world, device.type == "cuda"))
        if lowered:
            print(
                f"NCCL threshold for this test: {bench.size_label(CUDA_TEST_THRESHOLD)} per rank "
                f"(MEMGATHER_NCCL_MIN_BYTES unset; jobs take the default, see docs/cuda.md)"
            )
        print(verdict(cases, world, str(backend)))
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(case.differs or case.error for case in cases) else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memgather selftest",
        description=__doc__.split("\n\n", 1)[1].replace("``", "'") if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend", choices=["gloo", "nccl"], help="default: nccl when CUDA has a device for this rank, else gloo"
    )
    parser.add_argument(
        "--sizes",
        metavar="SIZES",
        help="bytes per rank, comma-separated, each a whole number with an optional K, M or G "
        f"(default: CPU {bench.sizes_text(CPU_SIZES)}, CUDA {bench.sizes_text(CUDA_SIZES)})",
    )
    return parser


def _sizes(text: Optional[str]) -> Optional[List[int]]:
    """``--sizes`` read; None for the backend's defaults. Each a positive whole number of float32 elements."""
    if text is None:
        return None
    sizes = bench.parse_sizes(text)
    bad = [size for size in sizes if size <= 0 or size % 4]
    if bad:
        raise ValueError(f"--sizes {text!r}: every size must be a positive multiple of 4 bytes (float32 elements)")
    return sizes


def _join(backend: Optional[str]) -> Any:
    """Join the launcher's group (env://), or make a world of 1; returns this rank's device."""
    import torch
    import torch.distributed as dist

    launched = all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--backend nccl needs a CUDA device, and this process sees none")
        # Each rank sees every GPU of its node, or only its own (CUDA_VISIBLE_DEVICES per rank).
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if launched:
        dist.init_process_group(backend, init_method="env://")
    else:
        port = bench.free_port()
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return device


def _run_case(pattern: patterns.Pattern, per_rank: int, device: Any) -> Case:
    """torch's run, memgather's verified run, memgather's measured run; this rank's view of them."""
    import torch.distributed as dist

    import memgather

    case = Case(pattern.name, per_rank)
    tensor = _input(dist.get_rank(), per_rank, device)
    memgather.unpatch()
    torch_gather = patterns.function(pattern.name, memgather_mode=False)
    torch_gather(tensor)  # warm-up: the backend's first-call costs are not the gather's
    case.peak_torch, case.reserved_torch, want = _measured(torch_gather, tensor)
    mine = patterns.function(pattern.name, memgather_mode=True)
    memgather.patch([patterns.MODULE])
    mine(tensor)  # warm-up
    memgather.reset_stats()
    case.peak_memgather, case.reserved_memgather, got = _measured(mine, tensor)
    case.took = _took(memgather.stats())
    case.differs = got != want
    # Verified last: verify mode's scratch gather leaves memory behind that a later peak would miss.
    memgather.patch([patterns.MODULE], verify=True)
    memgather.reset_stats()
    try:
        mine(tensor)  # raises VerifyError on every rank where a rewired call differs
    except memgather.VerifyError as error:
        case.error = str(error)
    case.verified = memgather.stats().verified > 0
    return case


def _input(rank: int, per_rank: int, device: Any) -> Any:
    import torch

    generator = torch.Generator().manual_seed(rank)
    return (torch.rand(per_rank // 4, generator=generator) * 1000).to(device)


def _measured(gather: Any, tensor: Any) -> Tuple[int, int, str]:
    """Median peak (growth plus the input) and reserved growth (CUDA; else 0) of a few gathers,
    and the first one's digest."""
    import torch.distributed as dist

    meter = bench.Meter(tensor.device)
    peaks, reserved, digest = [], [], ""
    meter.start()
    try:
        for call in range(_CALLS):
            _settle(tensor.device)
            meter.reset()
            dist.barrier()
            result = gather(tensor)
            bench.synchronize(tensor.device)
            peaks.append(tensor.numel() * tensor.element_size() + meter.growth())
            reserved.append(meter.reserved_growth() or 0)
            if call == 0:
                digest = bench.digest(result)
            del result
    finally:
        meter.stop()
    return int(statistics.median(peaks)), int(statistics.median(reserved)), digest


def _settle(device: Any) -> None:
    """Wait (bounded) until memory freed late has left the resident set: gloo's worker thread lets go
    of a finished call's tensors a moment after it returns, longer on a loaded machine, and memory it
    frees after the peak was reset would hide the next call's growth."""
    if device.type != "cpu":
        return
    import gc

    gc.collect()
    deadline = time.monotonic() + _SETTLE_S
    last = rss.current_bytes()
    while time.monotonic() < deadline:
        time.sleep(0.005)
        now = rss.current_bytes()
        if now >= last:
            return
        last = now


def _took(stats: Any) -> str:
    """What memgather did with the measured call: strategy and route, or torch's and why."""
    strategy = next((name for name in stats.by_strategy if name != "fallback"), None)
    if strategy is not None:
        route = next(iter(stats.by_route), "?")
        return f"{strategy} ({route})" + (", cat elided" if stats.elided else "")
    reason = next(iter(stats.fallbacks), "?")
    return f"torch ({reason})"


def _worst_of_ranks(cases: List[Case], device: Any) -> None:
    """Every case's peaks as the worst rank's, and a difference seen anywhere as seen everywhere."""
    import torch
    import torch.distributed as dist

    fields = ("peak_torch", "peak_memgather", "reserved_torch", "reserved_memgather")
    rows = [[getattr(c, f) for f in fields] + [int(c.differs), int(bool(c.error))] for c in cases]
    worst = torch.tensor(rows, dtype=torch.int64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    for case, row in zip(cases, worst.tolist()):
        for name, value in zip(fields, row):
            setattr(case, name, value)
        case.differs = bool(row[4])
        if row[5] and not case.error:
            case.error = "VerifyError on another rank"


def table(cases: List[Case], world: int, cuda: bool) -> str:
    """One aligned row per case."""
    header = ["pattern", "per rank", "memgather took", "peak torch", "peak memgather", "floor"]
    if cuda:
        header += ["reserved grew torch", "reserved grew memgather"]
    header.append("result")
    lines = [header]
    for case in cases:
        floor = case.per_rank * (world + 1)  # the input and the gathered result
        row = [
            case.pattern,
            bench.size_label(case.per_rank),
            case.took or "-",
            bench.human_size(case.peak_torch),
            bench.human_size(case.peak_memgather) + (" (above torch)" if _worse(case) else ""),
            bench.human_size(floor),
        ]
        if cuda:
            row += [bench.human_size(case.reserved_torch), bench.human_size(case.reserved_memgather)]
        row.append(case.error or ("DIFFERS from torch" if case.differs else "identical"))
        lines.append(row)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def verdict(cases: List[Case], world: int, backend: str) -> str:
    """The one line to read: PASS or FAIL, and why."""
    import torch

    from memgather.engine.strategies import Strategy

    where = f"{len(cases)} cases, {world} rank{'s' if world > 1 else ''}, {backend}, torch {torch.__version__}"
    bad = [c for c in cases if c.differs or c.error]
    if bad:
        names = ", ".join(sorted({f"{c.pattern} at {bench.size_label(c.per_rank)}" for c in bad}))
        return (
            f"memgather selftest: FAIL ({where}): results differ from torch's in {names}. "
            "Keep MEMGATHER off here and report it."
        )
    # memgather.gather's small call (into_result) is torch's own call: nothing to verify.
    rewired = [c for c in cases if c.took and not c.took.startswith(("torch", Strategy.INTO_RESULT.value))]
    verified = sum(1 for c in rewired if c.verified)
    worse = sum(1 for c in cases if _worse(c))
    margin = f"{_WORSE_BYTES >> 20} MiB and {_WORSE_SHARE:.0%}"
    memory = (
        f"peak more than {margin} above torch's in {worse} (marked)"
        if worse
        else f"peak never more than {margin} above torch's"
    )
    return (
        f"memgather selftest: PASS ({where}): results identical to torch's on every rank; "
        f"{len(rewired)} cases rewired, {verified} of them checked in verify mode; {memory}"
    )


def _worse(case: Case) -> bool:
    excess = case.peak_memgather - case.peak_torch
    return excess > _WORSE_BYTES and excess > _WORSE_SHARE * case.peak_torch


if __name__ == "__main__":
    sys.exit(main())
