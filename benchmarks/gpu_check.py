"""The one-GPU check: memgather's CUDA path on a real device, in a few minutes, with no network.

Run from the repository root on a machine with one CUDA GPU and torch installed:

    python benchmarks/gpu_check.py [--wheels DIR] [--out gpu_check.json]
    python benchmarks/gpu_check.py --sweep [--sizes 1,4,16,64,256,784] [--out gpu_sweep.json]

Steps, each bounded in time, each recorded in one JSON summary whatever happens:

1. ``memgather selftest`` on a world of 1 on NCCL (results identical to torch's);
2. ``memgather bench --backend nccl --shape seed --world-size 1`` with
   ``MEMGATHER_NCCL_MIN_BYTES=0``: allocated and reserved peaks and times per pattern;
3. accelerate 0.23.0's ``gather`` of a CUDA tensor on two ranks under ``MEMGATHER=1``
   against the same job unpatched (accelerate 0.23.0 from ``--wheels DIR`` when the installed one is another);
4. ``tests/test_cuda.py`` and the CUDA fallback tests of ``tests/test_fallbacks.py``;
5. two ranks on the one GPU, each with its own ``NCCL_HOSTID``, fresh slots gathered
   under memgather against torch (skipped where NCCL refuses two ranks on one device);
6. memgather's own host time per rewired 4 KiB call (two ranks, fresh slots, listed and
   cat), against torch's list call in the same run;
7. the crossover sweep (``--sweep`` runs it alone): on legacy NCCL, world 1, for 1 / 4 /
   16 / 64 / 256 / 784 MiB per rank, torch's list ``all_gather`` against
   ``memgather.all_gather`` (every call rewired: ``MEMGATHER_NCCL_MIN_BYTES=0``), for
   fresh slots + ``torch.cat`` (memgather's cat elided) and for a kept list, each
   without and with a ``.cpu()`` right after the gather (of the result's first element:
   the host waits for the gather, as a loop that reads its result back each step does,
   without a device-to-host copy that would dwarf the difference); the median time per
   call, the ``max_memory_allocated`` / ``max_memory_reserved`` growth of one call, and
   per case the crossover: the size from which memgather's call is no slower than
   torch's. It calibrates the NCCL threshold (docs/cuda.md, "The NCCL threshold");
8. torch's copy-on-write on CUDA (``--only cow``), which an elided cat's result on CUDA
   would rest on (on the CPU it does: ``memgather.cow``): whether a lazy clone of a CUDA
   buffer is copy-on-write, what a write into either side on the current stream and on a
   side stream leaves in the other, what a write under graph capture does, and the
   ``memory_allocated`` cost of each (the clone, a write while both live, a write once the
   other side is gone). Informational: memgather hands out the buffer itself on CUDA.

memgather runs from this checkout (``PYTHONPATH``); ``MEMGATHER=1`` reaches the jobs
through a site directory holding this checkout's ``memgather.pth``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # ``python benchmarks/gpu_check.py``: the repository root, for benchmarks.processes
    sys.path.insert(0, ROOT)

from benchmarks import processes  # noqa: E402 - after the root is on the path

# The accelerate job, one rank of two sharing the GPU: its own gather of a CUDA tensor, the
# peak and a digest of the result's bytes.
_ACCELERATE_JOB = """
import hashlib, json, os, sys, torch
from accelerate import PartialState
from accelerate.utils import gather
import accelerate
state = PartialState()
t = torch.arange(16 * 224 * 224 * 16, dtype=torch.float32, device=state.device).view(16, 224, 224, 16)
t += state.process_index
gather(t)  # warm-up
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
out = gather(t)
torch.cuda.synchronize()
row = {"accelerate": accelerate.__version__, "rank": state.process_index,
       "peak_above_input": torch.cuda.max_memory_allocated() - before,
       "reserved": torch.cuda.max_memory_reserved(), "shape": list(out.shape),
       "digest": hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()}
if "memgather" in sys.modules:
    import memgather
    stats = memgather.stats()
    row["memgather"] = {"strategies": dict(stats.by_strategy), "fallbacks": dict(stats.fallbacks),
                        "elided": stats.elided}
torch.distributed.destroy_process_group()
print(json.dumps(row))
"""

# Two ranks on one GPU: fresh slots + cat under torch, then under memgather (elided), compared.
_TWO_RANKS = """
import json, os, sys, torch, torch.distributed as dist
import memgather  # before CUDA is first used
torch.cuda.set_device(0)
dist.init_process_group("nccl")  # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from _two_ranks
rank = dist.get_rank()
t = torch.arange(1 << 20, dtype=torch.float32, device="cuda") + rank
slots = [torch.empty_like(t) for _ in range(2)]
dist.all_gather(slots, t)
want = torch.cat(slots)
slots = [torch.empty_like(t) for _ in range(2)]
memgather.all_gather(slots, t, elide=True)
got = torch.cat(slots)
torch.cuda.synchronize()
stats = memgather.stats()
print(json.dumps({"rank": rank, "equal": bool(torch.equal(got, want)), "strategies": dict(stats.by_strategy),
                  "fallbacks": dict(stats.fallbacks)}))
dist.destroy_process_group()
"""


# memgather's own host time per call on CUDA, one rank of two sharing the GPU: 4 KiB per
# rank, every call rewired (threshold 0), fresh slots each call; torch's list call timed in
# the same run, the two taking turns. Only the queueing of the calls is timed (the GPU is
# waited for between rounds, outside the timer): the host's share, which is memgather's,
# not the link's (two ranks on one GPU talk through NCCL's network transport).
_OVERHEAD = """
import json, os, statistics, time, torch, torch.distributed as dist
import memgather
torch.cuda.set_device(0)
dist.init_process_group("nccl")
world, rank = dist.get_world_size(), dist.get_rank()
t = torch.ones(1024, device="cuda") + rank
def torch_list():
    slots = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(slots, t)
def memgather_list():
    slots = [torch.empty_like(t) for _ in range(world)]
    memgather.all_gather(slots, t)
def torch_cat():
    slots = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(slots, t)
    return torch.cat(slots)
def memgather_cat():
    slots = [torch.empty_like(t) for _ in range(world)]
    memgather.all_gather(slots, t, elide=True)
    return torch.cat(slots)
calls, rounds = 150, 9
def timed(call):
    torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    queued = time.perf_counter() - started
    torch.cuda.synchronize()
    return queued / calls * 1e6
rows = {"rank": rank, "world": world}
for name, (mine, theirs) in {"list": (memgather_list, torch_list), "cat": (memgather_cat, torch_cat)}.items():
    for call in (mine, theirs):
        for _ in range(50):
            call()
    memgather.reset_stats()
    times = {"torch": [], "memgather": []}
    for turn in range(rounds):
        order = (("torch", theirs), ("memgather", mine))
        for who, call in order if turn % 2 == 0 else order[::-1]:
            times[who].append(timed(call))
    stats = memgather.stats()
    torch_us, ours_us = statistics.median(times["torch"]), statistics.median(times["memgather"])
    rows[name] = {"torch_us": round(torch_us, 2), "memgather_us": round(ours_us, 2),
                  "own_us": round(ours_us - torch_us, 2), "own_ratio": round((ours_us - torch_us) / torch_us, 2),
                  "strategies": dict(stats.by_strategy), "fallbacks": dict(stats.fallbacks), "elided": stats.elided}
    print(name, rows[name], flush=True)
dist.destroy_process_group()
print(json.dumps(rows))
"""


# torch's copy-on-write on CUDA: each fact printed as one JSON object on the last line.
_COW = """
import json, torch
facts = {}
mib = 1 << 20
def grown(before):
    torch.cuda.synchronize()
    return (torch.cuda.memory_allocated() - before) // mib
def fact(name, read):
    try:
        facts[name] = read()
    except Exception as error:
        facts[name] = f"{type(error).__name__}: {str(error)[:200]}"
base = torch.arange(16 * mib // 4, dtype=torch.float32, device="cuda")
slots = list(base.view(4, -1).unbind(0))
expected = base.clone()
before = torch.cuda.memory_allocated()
clone = torch._lazy_clone(base)
fact("clone_is_cow", lambda: bool(torch._C._is_cow_tensor(clone) and torch._C._is_cow_tensor(slots[0])))
fact("clone_mib", lambda: grown(before))
slots[1].mul_(-1)
fact("write_into_slot_mib", lambda: grown(before))
fact("clone_kept_its_values", lambda: bool(torch.equal(clone, expected)))
expected = base.clone()
side = torch.cuda.Stream()
other = torch._lazy_clone(base)
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    torch.cuda._sleep(10_000_000)  # the side stream's write lands late: is the other side left alone?
    other.add_(1)
torch.cuda.current_stream().wait_stream(side)
fact("side_stream_write_isolated", lambda: bool(torch.equal(base, expected) and torch.equal(other, expected + 1)))
del other
last = torch._lazy_clone(base)
del base, slots
before = torch.cuda.memory_allocated()
last.add_(1)
fact("write_once_alone_mib", lambda: grown(before))
captured = torch._lazy_clone(last)
def capture():
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    return "captured; the source kept its values: " + str(bool(last[0].item() != captured[0].item()))
fact("write_under_capture", capture)
from memgather import cow
facts["memgather_cow_serves_cuda"] = cow.serves(last)
print(json.dumps(facts))
"""


def cow_step() -> Dict[str, Any]:
    """torch's copy-on-write on CUDA, fact by fact (informational: memgather does not use it there)."""
    script = os.path.join(tempfile.mkdtemp(prefix="cow-"), "cow.py")
    with open(script, "w") as out:
        out.write(textwrap.dedent(_COW))
    return _step("copy-on-write on CUDA", [sys.executable, script], 120)


def overhead_step() -> Dict[str, Any]:
    """memgather's own host time per rewired 4 KiB call on NCCL, two ranks, against torch's list call."""
    script = os.path.join(tempfile.mkdtemp(prefix="overhead-"), "job.py")
    with open(script, "w") as out:
        out.write(textwrap.dedent(_OVERHEAD))
    env = _env(MEMGATHER_NCCL_MIN_BYTES="0", TORCH_DIST_USE_NCCL2="0")
    return _two_ranks("overhead per call (NCCL, two ranks, 4 KiB)", [sys.executable, script], env, 120)


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCH_DISTRIBUTED_DEBUG", "OFF")
    env.update(extra)
    return env


def _step(
    name: str,
    command: List[str],
    timeout_s: float,
    env: Optional[Dict[str, str]] = None,
    keep_output: bool = False,
) -> Dict[str, Any]:
    """Run ``command``; its outcome, time and output tail (the last line parsed when it is JSON),
    and with ``keep_output`` its whole standard output."""
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env or _env(), cwd=ROOT)
    except subprocess.TimeoutExpired as expired:
        tail = (expired.stdout or b"")[-4000:] if isinstance(expired.stdout, bytes) else (expired.stdout or "")[-4000:]
        return {"step": name, "status": "timed out", "seconds": round(time.monotonic() - started, 1), "tail": str(tail)}
    row: Dict[str, Any] = {
        "step": name,
        "status": "passed" if done.returncode == 0 else f"failed (exit {done.returncode})",
        "seconds": round(time.monotonic() - started, 1),
        "tail": (done.stdout[-4000:] + "\n" + done.stderr[-2000:]).strip(),
    }
    if keep_output:
        row["output"] = done.stdout
    lines = done.stdout.strip().splitlines()
    if lines:
        try:
            row["result"] = json.loads(lines[-1])
        except ValueError:
            pass
    print(f"gpu_check: {name}: {row['status']} ({row['seconds']} s)", flush=True)
    return row


def _site_with_pth() -> str:
    """A site directory holding memgather.pth: ``site.addsitedir`` runs its line as an install would."""
    site = tempfile.mkdtemp(prefix="memgather-site-")
    shutil.copy(os.path.join(ROOT, "memgather.pth"), site)
    return site


def _python_with_site(site: str, script: str) -> List[str]:
    return [
        sys.executable,
        "-c",
        f"import site; site.addsitedir({site!r}); exec(compile(open({script!r}).read(), {script!r}, 'exec'))",
    ]


def _accelerate_path(wheels: Optional[str]) -> Optional[str]:
    """A directory with accelerate 0.23.0 on it (unpacked from a wheel), '' for the installed one, None: neither."""
    try:
        import accelerate

        if accelerate.__version__ == "0.23.0":
            return ""
    except ImportError:
        pass
    found = sorted(glob.glob(os.path.join(wheels or "", "accelerate-0.23.0-*.whl"))) if wheels else []
    if not found:
        return None
    target = tempfile.mkdtemp(prefix="accelerate-0.23-")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target, found[0]],
        check=True,
        timeout=120,
    )
    return target


def _two_ranks(name: str, command: List[str], env: Dict[str, str], timeout_s: float) -> Dict[str, Any]:
    """``command`` as ranks 0 and 1 of a world of 2 on GPU 0, each its own ``NCCL_HOSTID``
    (so NCCL connects them as two hosts would be); a step with each rank's last JSON line."""
    port = str(29500 + (os.getpid() % 500))
    launch = {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    envs = [{**env, **launch, "RANK": str(rank), "NCCL_HOSTID": f"memgather-check-{rank}"} for rank in range(2)]
    started = time.monotonic()
    ends = processes.run([command, command], envs, timeout_s, cwd=ROOT)
    row: Dict[str, Any] = {"step": name, "seconds": round(time.monotonic() - started, 1)}
    if any(end.returncode != 0 for end in ends):
        tails = [end.stderr[-1500:] for end in ends]
        if any("Duplicate GPU" in tail for tail in tails):
            status = "skipped: NCCL refused two ranks on one GPU"
        elif all(end.returncode in (None, 0) for end in ends):
            status = f"timed out after {timeout_s} s"
        else:
            status = "failed"
        row.update(status=status, tails=tails)
    else:
        row.update(status="passed", ranks=[json.loads(end.stdout.strip().splitlines()[-1]) for end in ends])
    print(f"gpu_check: {name}: {row['status']} ({row['seconds']} s)", flush=True)
    return row


def accelerate_step(wheels: Optional[str]) -> Dict[str, Any]:
    """accelerate 0.23.0's gather on two ranks, unpatched and under MEMGATHER=1: the results'
    digests must match, and the peaks are the figures."""
    path = _accelerate_path(wheels)
    if path is None:
        return {
            "step": "accelerate 0.23.0 gather",
            "status": "skipped: accelerate 0.23.0 is neither installed nor "
            "in --wheels (pip download accelerate==0.23.0 --no-deps)",
        }
    job = os.path.join(tempfile.mkdtemp(prefix="accelerate-job-"), "job.py")
    with open(job, "w") as out:
        out.write(textwrap.dedent(_ACCELERATE_JOB))
    site = _site_with_pth()
    launch = {"PYTHONPATH": path + os.pathsep + ROOT} if path else {}
    rows = {}
    for mode, extra in (("torch", {}), ("memgather", {"MEMGATHER": "1", "MEMGATHER_NCCL_MIN_BYTES": "0"})):
        rows[mode] = _two_ranks(
            f"accelerate gather, {mode}", _python_with_site(site, job), _env(**launch, **extra), 120
        )
    torchs, ours = rows["torch"].get("ranks"), rows["memgather"].get("ranks")
    same = bool(
        torchs
        and ours
        and all(a["digest"] == b["digest"] and a["shape"] == b["shape"] for a, b in zip(torchs, ours))
        and len({rank["digest"] for rank in torchs}) == 1
    )
    status = "passed" if same else "failed: results differ or a run failed"
    figures = {}
    if torchs and ours:
        figures = {
            "peak_torch": [rank["peak_above_input"] for rank in torchs],
            "peak_memgather": [rank["peak_above_input"] for rank in ours],
            "ratio": [round(b["peak_above_input"] / max(a["peak_above_input"], 1), 3) for a, b in zip(torchs, ours)],
            "memgather": [rank.get("memgather") for rank in ours],
        }
    return {"step": "accelerate 0.23.0 gather", "status": status, "figures": figures, "runs": rows}


def two_ranks_step() -> Dict[str, Any]:
    script = os.path.join(tempfile.mkdtemp(prefix="two-ranks-"), "job.py")
    with open(script, "w") as out:
        out.write(textwrap.dedent(_TWO_RANKS))
    row = _two_ranks("two ranks on one GPU", [sys.executable, script], _env(MEMGATHER_NCCL_MIN_BYTES="0"), 90)
    if row["status"] == "passed" and not all(rank["equal"] for rank in row["ranks"]):
        row["status"] = "failed: results differ"
    return row


# The crossover sweep: sizes per rank (MiB), the caller patterns, the measured calls.
SWEEP_SIZES_MIB = (1, 4, 16, 64, 256, 784)
SWEEP_PATTERNS = ("cat", "list")  # fresh slots + torch.cat (memgather's cat elided); fresh slots kept as a list
SWEEP_SYNCS = (False, True)  # without and with a .cpu() right after the gather
SWEEP_CALLS = 20  # calls per timed run
SWEEP_ROUNDS = 7  # timed runs per implementation, torch's and memgather's taking turns
SWEEP_TIMEOUT_S = 150


def parse_sizes(text: str) -> List[int]:
    """Sizes per rank in MiB from '1,4,16': each a positive whole number."""
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes in MiB must be whole numbers of 1 or more: {text!r}")
    return sorted(set(sizes))


def crossover(rows: List[Dict[str, Any]], pattern: str, sync: bool) -> Optional[int]:
    """The smallest size (MiB per rank) from which memgather's median time per call is at most
    torch's at that size and every larger one, for ``pattern`` with or without the sync; None
    where it is not so at the largest size."""
    timed = sorted(
        (row["mib"], row["memgather_us"] <= row["torch_us"])
        for row in rows
        if row["pattern"] == pattern and row["sync"] == sync and row.get("torch_us") is not None
    )
    found: Optional[int] = None
    for mib, no_slower in reversed(timed):
        if not no_slower:
            break
        found = mib
    return found


def sweep_table(rows: List[Dict[str, Any]]) -> List[str]:
    """The sweep's rows as text, then one line per case with its crossover."""
    lines = [
        f"{'pattern':<8} {'sync':<5} {'MiB':>5} {'torch us':>10} {'memgather us':>13} {'ratio':>6} "
        f"{'alloc torch':>12} {'alloc mg':>9} {'resv torch':>11} {'resv mg':>8} {'equal':>6}"
    ]
    for row in rows:
        ratio = row["memgather_us"] / row["torch_us"] if row["torch_us"] else float("nan")
        lines.append(
            f"{row['pattern']:<8} {'cpu()' if row['sync'] else '-':<5} {row['mib']:>5} {row['torch_us']:>10.1f} "
            f"{row['memgather_us']:>13.1f} {ratio:>6.2f} {_mib(row['torch_allocated']):>12} "
            f"{_mib(row['memgather_allocated']):>9} {_mib(row['torch_reserved']):>11} "
            f"{_mib(row['memgather_reserved']):>8} {'yes' if row['equal'] else 'NO':>6}"
        )
    for pattern in SWEEP_PATTERNS:
        for sync in SWEEP_SYNCS:
            if any(row["pattern"] == pattern and row["sync"] == sync for row in rows):
                found = crossover(rows, pattern, sync)
                where = f"from {found} MiB per rank" if found is not None else "not within the sizes swept"
                lines.append(f"crossover, {pattern}, {'.cpu() after each gather' if sync else 'no sync'}: {where}")
    return lines


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f}M"


def sweep(sizes_mib: List[int], calls: int = SWEEP_CALLS, rounds: int = SWEEP_ROUNDS) -> Dict[str, Any]:
    """The crossover sweep on legacy NCCL, world 1, in this process; one summary step."""
    os.environ["MEMGATHER_NCCL_MIN_BYTES"] = "0"  # every memgather call rewired
    os.environ["TORCH_DIST_USE_NCCL2"] = "0"  # read when torch.distributed is imported: the legacy group
    import torch
    import torch.distributed as dist

    import memgather
    from memgather import compat
    from memgather.engine import core, routes

    core.configure()  # the settings just set, should memgather have been imported before
    step: Dict[str, Any] = {"step": "crossover sweep (legacy NCCL, world 1)"}
    if not torch.cuda.is_available():
        return {**step, "status": "skipped: no CUDA device"}
    torch.cuda.set_device(0)
    store = tempfile.mktemp(prefix="memgather-sweep-store-")
    dist.init_process_group("nccl", init_method="file://" + store, rank=0, world_size=1)
    flavour = compat.nccl_flavour(dist.group.WORLD)
    step.update(
        torch=torch.__version__,
        device=torch.cuda.get_device_name(0),
        flavour=flavour,
        rule_threshold_mib=routes.nccl_threshold(None, 1) >> 20,
        rule_hbm_bytes_per_ns=routes.NCCL_HBM_BYTES_PER_NS,
        calls=calls,
        rounds=rounds,
    )
    if flavour != "legacy":
        dist.destroy_process_group()
        return {**step, "status": f"failed: the group is {flavour}, not legacy NCCL (TORCH_DIST_USE_NCCL2=0)"}

    def call(gather: Any, pattern: str, sync: bool, tensor: torch.Tensor) -> torch.Tensor:
        """One gather as ``pattern`` makes it; the result (the cat's, or the kept list's one slot)."""
        slots = [torch.empty_like(tensor)]
        if gather is memgather.all_gather:
            gather(slots, tensor, elide=pattern == "cat")
        else:
            gather(slots, tensor)
        result = torch.cat(slots) if pattern == "cat" else slots[0]
        if sync:
            result[:1].cpu()  # the host waits for the gather, as reading any of its result back does
        return result

    def timed(gather: Any, pattern: str, sync: bool, tensor: torch.Tensor) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            call(gather, pattern, sync, tensor)
        torch.cuda.synchronize()
        return (time.perf_counter() - started) / calls * 1e6

    def peaks(gather: Any, pattern: str, tensor: torch.Tensor) -> Tuple[int, int, torch.Tensor]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        result = call(gather, pattern, False, tensor)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - allocated, torch.cuda.max_memory_reserved() - reserved, result

    rows: List[Dict[str, Any]] = []
    warm = torch.ones(1024, device="cuda")
    for gather in (dist.all_gather, memgather.all_gather):
        call(gather, "cat", True, warm)  # NCCL's communicator and memgather's first-call work, outside the figures
    for mib in sizes_mib:
        tensor = torch.arange((mib << 20) // 4, dtype=torch.float32, device="cuda")
        for pattern in SWEEP_PATTERNS:
            rewired_before = memgather.stats().rewired
            torch_alloc, torch_resv, want = peaks(dist.all_gather, pattern, tensor)
            ours_alloc, ours_resv, got = peaks(memgather.all_gather, pattern, tensor)
            equal = bool(torch.equal(got, want))
            rewired = memgather.stats().rewired > rewired_before
            del want, got
            for sync in SWEEP_SYNCS:
                times: Dict[str, List[float]] = {"torch": [], "memgather": []}
                for turn in range(rounds):
                    order = (("torch", dist.all_gather), ("memgather", memgather.all_gather))
                    for name, gather in order if turn % 2 == 0 else order[::-1]:
                        times[name].append(timed(gather, pattern, sync, tensor))
                rows.append(
                    {
                        "pattern": pattern,
                        "sync": sync,
                        "mib": mib,
                        "torch_us": statistics.median(times["torch"]),
                        "memgather_us": statistics.median(times["memgather"]),
                        "torch_allocated": torch_alloc,
                        "memgather_allocated": ours_alloc,
                        "torch_reserved": torch_resv,
                        "memgather_reserved": ours_resv,
                        "equal": equal,
                        "rewired": rewired,
                    }
                )
        del tensor
        torch.cuda.empty_cache()
    stats = memgather.stats()
    dist.destroy_process_group()
    step["rows"] = rows
    step["crossover_mib"] = {
        f"{pattern}, {'cpu()' if sync else 'no sync'}": crossover(rows, pattern, sync)
        for pattern in SWEEP_PATTERNS
        for sync in SWEEP_SYNCS
    }
    step["memgather"] = {"strategies": dict(stats.by_strategy), "fallbacks": dict(stats.fallbacks)}
    print("\n".join(sweep_table(rows)), flush=True)
    bad = [row for row in rows if not row["equal"] or not row["rewired"]]
    step["status"] = "passed" if not bad else "failed: a result differed from torch's or a call was not rewired"
    return step


def sweep_step(sizes_mib: List[int]) -> Dict[str, Any]:
    """The sweep in a process of its own (its NCCL group, its settings), bounded in time."""
    out = os.path.join(tempfile.mkdtemp(prefix="sweep-"), "sweep.json")
    env = _env(MEMGATHER_NCCL_MIN_BYTES="0", TORCH_DIST_USE_NCCL2="0")
    row = _step(
        "crossover sweep (legacy NCCL, world 1)",
        [sys.executable, __file__, "--sweep", "--sizes", ",".join(map(str, sizes_mib)), "--out", out],
        SWEEP_TIMEOUT_S,
        env,
    )
    if os.path.exists(out):
        with open(out) as summary:
            steps = json.load(summary).get("steps", [])
        if steps:
            passed = row["status"] == "passed"  # else the process's own failure or timeout stands
            row.update({key: value for key, value in steps[0].items() if key != "step" and (passed or key != "status")})
    return row


def selftest_step(args: argparse.Namespace) -> Dict[str, Any]:
    return _step("selftest (NCCL, world 1)", [sys.executable, "-m", "memgather", "selftest", "--backend", "nccl"], 150)


def bench_step(args: argparse.Namespace) -> Dict[str, Any]:
    bench_json = os.path.join(tempfile.mkdtemp(prefix="bench-"), "bench.json")
    command = [sys.executable, "-m", "memgather", "bench", "--backend", "nccl", "--shape", "seed"]
    command += ["--world-size", "1", "--repeat", "2", "--rounds", "1", "--json", bench_json]
    bench = _step("bench --shape seed (NCCL, world 1)", command, 240, _env(MEMGATHER_NCCL_MIN_BYTES="0"))
    if os.path.exists(bench_json):
        with open(bench_json) as rows:
            bench["rows"] = json.load(rows)
    return bench


def tests_step(args: argparse.Namespace) -> Dict[str, Any]:
    """The CUDA tests, their whole output kept in the summary ("output")."""
    selected = "cuda or graph_capture or input_not_contiguous or nccl2 or slot_written"
    command = [sys.executable, "-m", "pytest", "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider"]
    command += ["tests/test_cuda.py", "tests/test_fallbacks.py", "-k", selected]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", "4"]  # each test is two processes that mostly wait on NCCL's set-up
    return _step("CUDA tests", command, 300, keep_output=True)


STEPS: Dict[str, Callable[[argparse.Namespace], Dict[str, Any]]] = {
    "selftest": selftest_step,
    "bench": bench_step,
    "accelerate": lambda args: accelerate_step(args.wheels),
    "tests": tests_step,
    "two-ranks": lambda args: two_ranks_step(),
    "overhead": lambda args: overhead_step(),
    "sweep": lambda args: sweep_step(args.sizes),
    "cow": lambda args: cow_step(),
}


def parse_steps(text: str) -> List[str]:
    """Step names from 'tests,overhead', each one of ``STEPS``."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in STEPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"steps are among {', '.join(STEPS)}: {text!r}")
    return names


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", help="a directory of wheels to take accelerate 0.23.0 from")
    parser.add_argument("--out", help="the summary (default gpu_check.json, with --sweep gpu_sweep.json)")
    parser.add_argument("--sweep", action="store_true", help="run only the crossover sweep (step 7)")
    parser.add_argument(
        "--only",
        type=parse_steps,
        default=list(STEPS),
        help=f"the steps to run, comma-separated, among {', '.join(STEPS)} (default: all)",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=list(SWEEP_SIZES_MIB),
        help="the sweep's sizes per rank, in MiB (default %(default)s)",
    )
    args = parser.parse_args(argv)
    out = args.out or ("gpu_sweep.json" if args.sweep else "gpu_check.json")
    if args.sweep:
        step = sweep(args.sizes)
        with open(out, "w") as summary_file:
            json.dump({"steps": [step]}, summary_file, indent=2)
        print(f"gpu_check: sweep: {step['status']}; summary in {out}")
        return 0 if step["status"] == "passed" or step["status"].startswith("skipped") else 1
    import torch

    summary: Dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "steps": [],
    }
    if not torch.cuda.is_available():
        summary["steps"].append({"step": "all", "status": "skipped: no CUDA device"})
    else:
        for name, step in STEPS.items():
            if name in args.only:
                summary["steps"].append(step(args))
    with open(out, "w") as summary_file:
        json.dump(summary, summary_file, indent=2)
    print(f"gpu_check: summary in {out}")
    return (
        0 if all(step["status"] == "passed" or step["status"].startswith("skipped") for step in summary["steps"]) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
