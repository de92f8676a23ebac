"""``memgather bench``: each caller pattern, unpatched vs under memgather, measured.

For every pattern (see ``memgather.tools.patterns``) and each mode, ``--world-size``
fresh processes join a process group (gloo on CPU; NCCL when CUDA is there
for every rank), gather the same data ``--repeat`` times and report peak
memory and time. Peak memory counts the input plus what the gather adds,
like the reference figure of Accelerate PR #1968: on CUDA
``torch.cuda.max_memory_allocated``; on CPU the resident-set high-water mark,
reset through ``/proc/self/clear_refs`` right before the call. Each row also
gives the transport floor (``_measure_floor``): the time the same bytes take
through bare collectives alone, measured once per invocation in fresh processes
of its own, and memgather's time as a multiple of it.

The other figures the README and docs/ quote (memgather's own microseconds per
call, gloo's two routes timed, ``memgather.pth``'s start-up cost, a buffer's first
touch) are measured by the scripts in the repository's ``benchmarks/`` folder,
which are not installed; they use this module's helpers (``spawn``, ``join``,
``timed``, ``parse_sizes``, ...), never the other way round.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from memgather.tools import patterns, rss

SEED_SHAPE = (64, 224, 224, 64)
DEFAULT_SHAPE = (16, 224, 224, 16)  # 49 MiB of float32 per rank: about a minute in all on 2 cores
MODES = ("torch", "memgather")
DEFAULT_REPEAT = 5


@dataclass
class RankResult:
    """What one rank measured for one pattern in one mode."""

    peaks: List[int]
    seconds: List[float]
    digest: str
    reserved: List[int] = field(default_factory=list)  # CUDA only: the caching allocator's reserved peak


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        shape = _parse_shape(args.shape)
        chosen = _parse_patterns(args.patterns)
    except ValueError as error:
        return usage_error(error)
    backend = args.backend or _default_backend(args.world_size)
    if backend == "gloo" and not rss.available():
        print(
            "memgather bench: on CPU the peak is read from /proc/self/status after resetting it through "
            "/proc/self/clear_refs, which this system does not have (Linux only).",
            file=sys.stderr,
        )
        return 2
    floor = _transport_floor(backend, args.world_size, shape, args.dtype, args.repeat, args.rounds)
    rows = []
    for pattern in chosen:
        results: Dict[str, List[RankResult]] = {mode: [] for mode in MODES}
        for round_index in range(args.rounds):
            for mode in MODES:  # alternating, so that drift on the machine hits both modes alike
                started = time.perf_counter()
                print(
                    f"[bench] {pattern.label:<22} {mode:<9} {args.world_size} ranks, {backend}, shape {shape} "
                    f"{args.dtype}, {args.repeat} repeats, round {round_index + 1}/{args.rounds} ...",
                    end="",
                    flush=True,
                )
                results[mode] += _run_mode(pattern.name, mode, backend, args.world_size, shape, args.dtype, args.repeat)
                print(f" {time.perf_counter() - started:.1f} s", flush=True)
        rows.append(_row(pattern, backend, args.world_size, shape, args.dtype, results, floor))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    if args.plot:
        _plot(rows, args.plot)
    return 0 if all(row["identical"] for row in rows) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memgather bench",
        description="Peak memory and time of each caller pattern's gather, torch's own all_gather vs the same "
        "code under memgather (patched; cat elision where memgather's defaults have it for the library the "
        "pattern stands for), in fresh processes, on this machine; and the transport floor: the time the same "
        "bytes take through bare collectives into a ready flat buffer (gloo: the faster of one broadcast per rank "
        "and the single-tensor all-gather; NCCL: the single-tensor all-gather), with memgather's time as a "
        "multiple of it. The other figures the docs quote are measured by the scripts in the repository's "
        "benchmarks/ folder.",
        epilog="Patterns: " + "; ".join(f"{p.name} ({p.stands_for})" for p in patterns.PATTERNS),
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument(
        "--shape",
        default=",".join(map(str, DEFAULT_SHAPE)),
        help="per-rank shape as comma-separated ints, or 'seed' for (64,224,224,64), the shape "
        "of the reference figure (default %(default)s)",
    )
    parser.add_argument("--dtype", default="float32", help="torch dtype name (default float32)")
    parser.add_argument(
        "--repeat",
        type=positive,
        default=DEFAULT_REPEAT,
        metavar="N",
        help="measured gathers per pattern and mode, and timing samples of the transport floor "
        f"(default {DEFAULT_REPEAT})",
    )
    parser.add_argument(
        "--rounds",
        type=positive,
        default=1,
        help="fresh process groups per pattern and mode, alternating modes, and for the transport "
        "floor; times are medians over all rounds (small gathers vary between process pairs: use 15 "
        "below 1 MiB)",
    )
    parser.add_argument("--patterns", help="comma-separated subset of: " + ",".join(patterns.BY_NAME))
    parser.add_argument(
        "--backend", choices=["gloo", "nccl"], help="default: nccl when CUDA has a GPU per rank, else gloo"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the pattern rows as JSON")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw peak memory per pattern (needs matplotlib: pip install 'memgather[plot]')",
    )
    return parser


def positive(text: str) -> int:
    """An argparse type: a positive integer."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def usage_error(error: Union[ValueError, str], prog: str = "memgather bench") -> int:
    """Say what is wrong with the command line (or why ``prog`` cannot measure anything here); exit status 2."""
    print(f"{prog}: {error}", file=sys.stderr)
    return 2


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_sizes(text: str) -> List[int]:
    """Bytes from '4K,256K,1M': whole numbers, each with an optional K, M or G (binary units)."""
    sizes = []
    for part in (p.strip().upper() for p in text.split(",")):
        number, unit = (part[:-1], part[-1]) if part[-1:] in ("K", "M", "G") else (part, "")
        if not number.isdigit():
            raise ValueError(f"--sizes {text!r}: expected comma-separated sizes such as 4K,1M,64M")
        sizes.append(int(number) * _UNITS[unit])
    return sizes


def sizes_text(sizes: Sequence[int]) -> str:
    """Sizes as --sizes takes them: '4K,1M'."""
    return ",".join(size_label(size).replace(" KiB", "K").replace(" MiB", "M").replace(" GiB", "G") for size in sizes)


def size_label(size: int) -> str:
    """'4 KiB', '1 MiB', ...: exact where the size is a whole number of the unit, else bytes."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} bytes"


def _parse_shape(text: str) -> Tuple[int, ...]:
    if text == "seed":
        return SEED_SHAPE
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise ValueError(f"--shape {text!r}: expected comma-separated integers such as 1024,1024, or 'seed'") from None
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"--shape {text!r}: every dimension must be positive")
    return shape


def _parse_patterns(text: Optional[str]) -> List[patterns.Pattern]:
    if not text:
        return list(patterns.PATTERNS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in patterns.BY_NAME]
    if unknown:
        raise ValueError(f"unknown pattern(s) {', '.join(unknown)}; known: {', '.join(patterns.BY_NAME)}")
    return [patterns.BY_NAME[n] for n in names]


def _default_backend(world: int) -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def _transport_floor(backend: str, world: int, shape: Tuple[int, ...], dtype: str, repeat: int, rounds: int) -> float:
    """Median seconds per call of the transport floor (``_measure_floor``): ``rounds``
    fresh process groups of ``repeat`` samples each, as a pattern's mode gets."""
    by_rank: List[Dict[str, List[float]]] = []
    for round_index in range(rounds):
        started = time.perf_counter()
        print(
            f"[bench] {'transport floor':<32} {world} ranks, {backend}, shape {shape} {dtype}, {repeat} repeats, "
            f"round {round_index + 1}/{rounds} ...",
            end="",
            flush=True,
        )
        try:
            by_rank += spawn(_measure_floor, world, backend, shape, dtype, repeat)
        except RuntimeError as error:
            raise RuntimeError(f"transport floor failed: {error}") from None
        print(f" {time.perf_counter() - started:.1f} s", flush=True)
    # The faster transport: on gloo the broadcasts win from a few MiB per rank, the single call below.
    return min(statistics.median(_samples([rank[name] for rank in by_rank], world)) for name in by_rank[0])


def _run_mode(
    pattern: str, mode: str, backend: str, world: int, shape: Tuple[int, ...], dtype: str, repeat: int
) -> List[RankResult]:
    try:
        by_rank = spawn(_measure, world, backend, pattern, mode, shape, dtype, repeat)
    except RuntimeError as error:
        raise RuntimeError(f"{pattern} ({mode}) failed: {error}") from None
    return [RankResult(**result) for result in by_rank]


def spawn(worker: Callable[..., Any], world: int, backend: str, *args: Any) -> List[Any]:
    """``worker(rank, world, port, backend, *args)`` in ``world`` fresh rank processes; what
    each returned, in rank order.

    ``worker`` must be a module-level function (the processes get it by name) that
    joins the process group with ``join(rank, world, port, backend)``, leaves it with
    ``leave()``, and returns something picklable. A rank that raised makes this raise
    ``RuntimeError`` naming the rank and its error.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(worker, rank, world, port, backend, args, queue)) for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        by_rank = dict(queue.get(timeout=3600) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=60)
    failed = {rank: result for rank, result in by_rank.items() if isinstance(result, _Failure)}
    if failed:
        raise RuntimeError("; ".join(f"rank {r}: {e.message}" for r, e in sorted(failed.items())))
    return [by_rank[rank] for rank in range(world)]


@dataclass(frozen=True)
class _Failure:
    """What a rank sends back instead of a result when its worker raised."""

    message: str


def _context() -> Any:
    """Fresh rank processes, forked from a server that has imported torch once.

    Each fork starts with nothing of memgather set up and no process group, as a
    spawned interpreter would, but in a fraction of a second instead of two: the
    small-size rows need many process pairs (``--rounds``) to average out how
    each pair happens to be scheduled.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _rank_main(
    worker: Callable[..., Any], rank: int, world: int, port: int, backend: str, args: Tuple[Any, ...], queue: Any
) -> None:
    try:
        result: Any = worker(rank, world, port, backend, *args)
    except Exception as error:  # noqa: BLE001 - any error of the worker's is reported by the parent
        result = _Failure(f"{type(error).__name__}: {error}")
    queue.put((rank, result))
    queue.close()
    queue.join_thread()


def join(rank: int, world: int, port: int, backend: str) -> Any:
    """Join the rank processes' group (``tcp://127.0.0.1:port``); returns this rank's device.

    One intra-op thread (more would only contend with the other ranks), this
    rank's GPU under NCCL, and the calling thread pinned to a core of its own.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _pin_main_thread(rank)
    return device


def leave() -> None:
    """Wait for every rank, then destroy the process group."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _measure(
    rank: int,
    world: int,
    port: int,
    backend: str,
    pattern: str,
    mode: str,
    shape: Tuple[int, ...],
    dtype: str,
    repeat: int,
) -> Dict[str, Any]:
    import memgather

    device = join(rank, world, port, backend)
    if mode == "memgather":
        memgather.patch([patterns.MODULE])  # cat elision as the proof decides for the pattern's code
    else:
        memgather.unpatch()  # in case MEMGATHER=1 patched this process at start-up
    gather = patterns.function(pattern, memgather_mode=(mode == "memgather"))
    tensor = _input(rank, shape, dtype, device)
    peaks, reserved, result_digest = _peaks(gather, tensor, repeat)
    inner = calls_per_sample(gather, tensor)
    seconds = [timed(gather, tensor, inner) / inner for _ in range(repeat)]
    leave()
    return asdict(RankResult(peaks, seconds, result_digest, reserved))


def _input(rank: int, shape: Tuple[int, ...], dtype: str, device: Any) -> Any:
    """Rank ``rank``'s input: the same values in every mode, and on every rank that asks for it."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    return (torch.rand(shape, generator=generator) * 1000).to(getattr(torch, dtype)).to(device)


def _measure_floor(
    rank: int, world: int, port: int, backend: str, shape: Tuple[int, ...], dtype: str, repeat: int
) -> Dict[str, List[float]]:
    """The transport floor: seconds per call (one per sample) that the gathered bytes take
    through bare collectives alone, with no caller code and nothing of memgather, per transport.

    Every rank's input bytes land in one flat buffer allocated once and written to
    before any timing (no page faults in the timed calls): on gloo by one async
    broadcast per rank, from the source's own slot (its input copied in once) into
    that slot on the others, as memgather's broadcast route sends them, and by the
    single-tensor all-gather where gloo has it (faster for small gathers); on NCCL by
    one ``all_gather_into_tensor``. The bytes are sent as bytes, so that any dtype
    goes. Whatever a pattern takes beyond the faster one is the caller's code and
    memgather's (allocations, first touches, copies, the agreement round), not the
    transport. Timed as the patterns are (``calls_per_sample``, ``timed``), each after
    one checked call.
    """
    import torch
    import torch.distributed as dist

    import memgather
    from memgather import compat

    device = join(rank, world, port, backend)
    memgather.unpatch()  # bare collectives, also where MEMGATHER=1 patched this process at start-up
    source = _input(rank, shape, dtype, device).reshape(-1).view(torch.uint8)
    flat = torch.empty(world * source.numel(), dtype=torch.uint8, device=device).zero_()
    slots = list(flat.view(world, -1).unbind(0))
    slots[rank].copy_(source)

    single = compat.single_tensor_primitive().function

    def broadcasts(tensor: Any) -> None:
        works = [dist.broadcast(slot, src=i, async_op=True) for i, slot in enumerate(slots)]
        for work in works:
            work.wait()

    def single_call(tensor: Any) -> None:
        assert single is not None, "this torch has no single-tensor all-gather"
        single(flat, tensor)

    movers = {"single": single_call} if backend == "nccl" else {"broadcasts": broadcasts}
    if backend == "gloo" and single is not None and compat.gloo_has_single_tensor():
        movers["single"] = single_call
    seconds = {}
    for name, move in movers.items():
        flat.zero_()
        slots[rank].copy_(source)
        move(source)
        for other, slot in enumerate(slots):  # a floor that moved the wrong bytes would mean nothing
            if not torch.equal(slot, _input(other, shape, dtype, device).reshape(-1).view(torch.uint8)):
                raise RuntimeError(f"rank {rank}: the floor's {name} left wrong bytes in rank {other}'s slot")
        inner = calls_per_sample(move, source)
        seconds[name] = [timed(move, source, inner) / inner for _ in range(repeat)]
    leave()
    return seconds


def _peaks(gather: Any, tensor: Any, repeat: int) -> Tuple[List[int], List[int], str]:
    """Peak memory of ``repeat`` gathers (input included), on CUDA the reserved peak's growth
    too, and a digest of the result.

    Measured before any timing, with every allocation of 64 KiB or more taken
    from the system and given back when freed (CPU): otherwise glibc keeps
    freed temporaries of up to 32 MiB in its heap after the first few calls,
    and a later call's peak would not show in the resident set.
    """
    import torch.distributed as dist

    meter = Meter(tensor.device)
    meter.start()
    gather(tensor)  # the warm-up: first-call costs are not the gather's
    peaks: List[int] = []
    reserved: List[int] = []
    first = ""
    for index in range(repeat):
        meter.reset()  # before the barrier: its cost on one rank must not show as the other's wait
        dist.barrier()
        result = gather(tensor)
        synchronize(tensor.device)
        peaks.append(tensor.numel() * tensor.element_size() + meter.growth())
        grown = meter.reserved_growth()
        if grown is not None:
            reserved.append(grown)
        if index == 0:
            first = digest(result)
        del result
    meter.stop()
    return peaks, reserved, first


def synchronize(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _pin_main_thread(rank: int) -> None:
    """Each rank's calling thread on a core of its own, where the system allows; the
    backend's worker threads (started before this) stay free to run anywhere. Without
    it, small timings vary by +-40% between process pairs on a 2-core machine."""
    import os

    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})  # 0: this thread only, on Linux


def calls_per_sample(gather: Any, tensor: Any) -> int:
    """Calls per timing sample: enough for about 50 ms, so that small gathers are not
    timed against the skew of the barrier before them. The same on every rank.

    Batches double until one lasts 50 ms on the slowest rank, which also warms up:
    first calls pay for lazy set-up (the backend's buffers, the pages of the
    result). Timing one call alone made small samples a few calls long and their
    medians vary by 2x or more.
    """
    calls = 1
    while True:
        elapsed = _slowest(gather, tensor, calls)
        if elapsed >= 0.05 or calls >= 4096:
            return max(1, int(calls * 0.05 / max(elapsed, 1e-9)))
        calls *= 2


def _slowest(gather: Any, tensor: Any, calls: int) -> float:
    """Seconds ``calls`` gathers take on the slowest rank (every rank gets the same answer)."""
    import torch
    import torch.distributed as dist

    elapsed = torch.tensor([timed(gather, tensor, calls)], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def timed(gather: Any, tensor: Any, calls: int) -> float:
    """Seconds this rank takes for ``calls`` gathers, started together after a barrier
    (on CUDA until the device has finished them)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        gather(tensor)
    synchronize(tensor.device)
    return time.perf_counter() - start


class Meter:
    """Memory growth since ``reset()``: CUDA allocator peak, or resident-set high-water mark.

    On CUDA ``reserved_growth()`` also gives the caching allocator's reserved peak
    (what ``nvidia-smi`` shows, less the context): freed blocks stay reserved, and
    one large request is seldom served from several smaller freed blocks.
    """

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        self.cuda = torch.cuda if device.type == "cuda" else None
        self.before = 0
        self.reserved_before = 0

    def reset(self) -> None:
        import gc

        gc.collect()
        if self.cuda is not None:
            self.cuda.synchronize(self.device)
            self.cuda.reset_peak_memory_stats(self.device)
            self.before = self.cuda.memory_allocated(self.device)
            self.reserved_before = self.cuda.memory_reserved(self.device)
        else:
            rss.reset_peak()
            self.before = rss.current_bytes()

    def start(self) -> None:
        if self.cuda is None:
            rss.track_allocations(True)

    def stop(self) -> None:
        if self.cuda is None:
            rss.track_allocations(False)

    def growth(self) -> int:
        peak = self.cuda.max_memory_allocated(self.device) if self.cuda is not None else rss.peak_bytes()
        return peak - self.before

    def reserved_growth(self) -> Optional[int]:
        """Growth of the CUDA allocator's reserved peak; None on CPU."""
        if self.cuda is None:
            return None
        return self.cuda.max_memory_reserved(self.device) - self.reserved_before


def digest(result: Any) -> str:
    """SHA-256 of the result's bytes, read in place: the main job installs torch alone,
    and torch's ``.numpy()`` needs NumPy."""
    sha = hashlib.sha256()
    for part in result if isinstance(result, (list, tuple)) else [result]:
        flat = part.detach().contiguous().cpu()
        size = flat.numel() * flat.element_size()
        if size:
            sha.update((ctypes.c_char * size).from_address(flat.data_ptr()))
    return sha.hexdigest()


def _row(
    pattern: patterns.Pattern,
    backend: str,
    world: int,
    shape: Tuple[int, ...],
    dtype: str,
    results: Dict[str, List[RankResult]],
    time_floor: float,
) -> Dict[str, Any]:
    import torch

    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_rank = itemsize
    for d in shape:
        per_rank *= d
    # Per rank and call the high-water mark; per mode the median call of the highest rank.
    # A one-time growth of the process's heap (its first small allocations after the
    # allocation tracking returned its free pages) is not the gather's.
    peak = {mode: max(statistics.median(r.peaks) for r in ranks) for mode, ranks in results.items()}
    median = {mode: statistics.median(_samples([r.seconds for r in ranks], world)) for mode, ranks in results.items()}
    # CUDA: the allocator's reserved peak grows by whole segments, so it is shown beside the allocated one.
    reserved = {
        mode: max(statistics.median(r.reserved) for r in ranks) if all(r.reserved for r in ranks) else None
        for mode, ranks in results.items()
    }
    floor = per_rank * (world + 1)  # the input, plus the gathered result that must exist
    return {
        "pattern": pattern.name,
        "label": pattern.label,
        "stands_for": pattern.stands_for,
        "backend": backend,
        "world_size": world,
        "shape": list(shape),
        "dtype": dtype,
        "bytes_per_rank": per_rank,
        "floor": floor,
        "peak_torch": peak["torch"],
        "peak_memgather": peak["memgather"],
        "peak_ratio": peak["memgather"] / peak["torch"],
        "memgather_vs_floor": peak["memgather"] / floor,
        "reserved_torch": reserved["torch"],
        "reserved_memgather": reserved["memgather"],
        "time_torch": median["torch"],
        "time_memgather": median["memgather"],
        "time_ratio": median["memgather"] / median["torch"],
        "time_floor": time_floor,
        "time_memgather_vs_floor": median["memgather"] / time_floor,
        "identical": [r.digest for r in results["torch"]] == [r.digest for r in results["memgather"]],
    }


def _samples(by_rank: List[List[float]], world: int) -> List[float]:
    """Per-call times, one per repeat and round: the slowest rank's (a gather ends when all have it).
    ``by_rank`` holds each rank's seconds, a round (``world`` ranks) after another."""
    samples = []
    for first in range(0, len(by_rank), world):
        group = by_rank[first : first + world]
        samples += [max(seconds[i] for seconds in group) for i in range(len(group[0]))]
    return samples


def table(rows: List[Dict[str, Any]]) -> str:
    """The rows as an aligned text table."""
    header: Tuple[str, ...] = (
        "pattern",
        "backend",
        "world",
        "peak torch",
        "peak memgather",
        "ratio",
        "memgather/floor",
        "time torch",
        "time memgather",
        "ratio",
        "time floor",
        "mg/time floor",
        "identical",
    )
    cuda = any(row.get("reserved_torch") is not None for row in rows)
    if cuda:
        header = header[:5] + ("reserved grew torch", "reserved grew memgather") + header[5:]
    lines = [header]
    for row in rows:
        reserved = (human_size(row["reserved_torch"]), human_size(row["reserved_memgather"])) if cuda else ()
        lines.append(
            (
                row["label"],
                row["backend"],
                str(row["world_size"]),
                human_size(row["peak_torch"]),
                human_size(row["peak_memgather"]),
                *reserved,
                f"{row['peak_ratio']:.3f}",
                f"{row['memgather_vs_floor']:.3f}",
                _duration(row["time_torch"]),
                _duration(row["time_memgather"]),
                f"{row['time_ratio']:.3f}",
                _duration(row["time_floor"]),
                f"{row['time_memgather_vs_floor']:.3f}",
                "yes" if row["identical"] else "NO",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def _plot(rows: List[Dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "memgather bench: --plot needs matplotlib (pip install 'memgather[plot]'); no plot written.",
            file=sys.stderr,
        )
        return
    labels = [row["label"] for row in rows]
    positions = range(len(rows))
    figure, axes = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    gib = float(1 << 30)
    axes.bar([p - 0.2 for p in positions], [row["peak_torch"] / gib for row in rows], 0.4, label="torch")
    axes.bar([p + 0.2 for p in positions], [row["peak_memgather"] / gib for row in rows], 0.4, label="memgather")
    axes.scatter(
        list(positions),
        [row["floor"] / gib for row in rows],
        marker="_",
        s=900,
        color="black",
        label="floor (input + gathered)",
    )
    axes.set_xticks(list(positions))
    axes.set_xticklabels(labels, rotation=20, ha="right")
    axes.set_ylabel("peak memory per rank (GiB)")
    first = rows[0]
    axes.set_title(f"{first['backend']}, {first['world_size']} ranks, {tuple(first['shape'])} {first['dtype']}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"[bench] plot written to {path}")


def human_size(size: float) -> str:
    if size >= 1 << 30:
        return f"{size / (1 << 30):.2f} GiB"
    if size >= 1 << 20:
        return f"{size / (1 << 20):.1f} MiB"
    return f"{size / 1024:.1f} KiB"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
