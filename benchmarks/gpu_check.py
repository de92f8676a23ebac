"""The one-GPU check: memgather's CUDA path on a real device, in a few minutes, with no network.

Run from the repository root on a machine with one CUDA GPU and torch installed:

    python benchmarks/gpu_check.py [--wheels DIR] [--out gpu_check.json]

Steps, each bounded in time, each recorded in one JSON summary whatever happens:

1. ``memgather selftest`` on a world of 1 on NCCL (results identical to torch's);
2. ``memgather bench --backend nccl --shape seed --world-size 1`` with
   ``MEMGATHER_NCCL_MIN_BYTES=0``: allocated and reserved peaks and times per pattern;
3. accelerate 0.23.0's ``gather`` of a CUDA tensor under ``MEMGATHER=1`` against the same
   job unpatched (accelerate 0.23.0 from ``--wheels DIR`` when the installed one is another);
4. ``tests/test_cuda.py`` and the CUDA fallback tests of ``tests/test_fallbacks.py``;
5. two ranks on the one GPU, each with its own ``NCCL_HOSTID``, fresh slots gathered
   under memgather against torch (skipped where NCCL refuses two ranks on one device).

memgather runs from this checkout (``PYTHONPATH``); ``MEMGATHER=1`` reaches the jobs
through a site directory holding this checkout's ``memgather.pth``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The accelerate job: its own gather of a CUDA tensor, the peak and the result's checksum.
_ACCELERATE_JOB = """
import json, os, sys, torch
from accelerate import PartialState
from accelerate.utils import gather
import accelerate
state = PartialState()
t = torch.arange(16 * 224 * 224 * 16, dtype=torch.float32, device=state.device).view(16, 224, 224, 16)
gather(t)  # warm-up
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
out = gather(t)
torch.cuda.synchronize()
row = {"accelerate": accelerate.__version__, "peak_above_input": torch.cuda.max_memory_allocated() - before,
       "reserved": torch.cuda.max_memory_reserved(), "shape": list(out.shape),
       "checksum": float(out.double().sum()), "bytes_hash": hash(out.cpu().numpy().tobytes())}
if "memgather" in sys.modules:
    import memgather
    stats = memgather.stats()
    row["memgather"] = {"strategies": dict(stats.by_strategy), "fallbacks": dict(stats.fallbacks),
                        "elided": stats.elided}
print(json.dumps(row))
"""

# Two ranks on one GPU: fresh slots + cat under torch, then under memgather (elided), compared.
_TWO_RANKS = """
import json, os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
os.environ["NCCL_HOSTID"] = f"memgather-check-{rank}"
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
import memgather
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


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCH_DISTRIBUTED_DEBUG", "OFF")
    env.update(extra)
    return env


def _step(name: str, command: List[str], timeout_s: float, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Run ``command``; its outcome, time and output tail (the last line parsed when it is JSON)."""
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


def accelerate_step(wheels: Optional[str]) -> Dict[str, Any]:
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
    launch = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
    if path:
        launch["PYTHONPATH"] = path + os.pathsep + ROOT
    rows = {}
    for mode, extra in (("torch", {}), ("memgather", {"MEMGATHER": "1", "MEMGATHER_NCCL_MIN_BYTES": "0"})):
        rows[mode] = _step(f"accelerate gather, {mode}", _python_with_site(site, job), 120, _env(**launch, **extra))
    torchs, ours = rows["torch"].get("result"), rows["memgather"].get("result")
    same = bool(torchs and ours and torchs["bytes_hash"] == ours["bytes_hash"] and torchs["shape"] == ours["shape"])
    status = "passed" if same else "failed: results differ or a run failed"
    figures = {}
    if torchs and ours:
        figures = {
            "peak_torch": torchs["peak_above_input"],
            "peak_memgather": ours["peak_above_input"],
            "ratio": round(ours["peak_above_input"] / max(torchs["peak_above_input"], 1), 3),
            "memgather": ours.get("memgather"),
        }
    return {"step": "accelerate 0.23.0 gather", "status": status, "figures": figures, "runs": rows}


def two_ranks_step() -> Dict[str, Any]:
    script = os.path.join(tempfile.mkdtemp(prefix="two-ranks-"), "job.py")
    with open(script, "w") as out:
        out.write(textwrap.dedent(_TWO_RANKS))
    store = tempfile.mktemp(prefix="memgather-store-")
    env = _env(MEMGATHER_NCCL_MIN_BYTES="0")
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), store],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for rank in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(5.0, 90 - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            return {
                "step": "two ranks on one GPU",
                "status": "skipped: NCCL did not finish within 90 s (two ranks on one device)",
            }
        outputs.append((proc.returncode, out, err))
    if any(code != 0 for code, _, _ in outputs):
        tails = [err[-1500:] for _, _, err in outputs]
        refused = any("Duplicate GPU" in tail for tail in tails)
        return {
            "step": "two ranks on one GPU",
            "status": "skipped: NCCL refused two ranks on one GPU" if refused else "failed",
            "tails": tails,
        }
    rows = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in outputs]
    ok = all(row["equal"] for row in rows)
    return {"step": "two ranks on one GPU", "status": "passed" if ok else "failed: results differ", "ranks": rows}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", help="a directory of wheels to take accelerate 0.23.0 from")
    parser.add_argument("--out", default="gpu_check.json", help="the summary (default gpu_check.json)")
    args = parser.parse_args(argv)
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
        module = [sys.executable, "-m", "memgather"]
        bench_json = os.path.join(tempfile.mkdtemp(prefix="bench-"), "bench.json")
        summary["steps"].append(_step("selftest (NCCL, world 1)", module + ["selftest", "--backend", "nccl"], 150))
        bench = _step(
            "bench --shape seed (NCCL, world 1)",
            module
            + [
                "bench",
                "--backend",
                "nccl",
                "--shape",
                "seed",
                "--world-size",
                "1",
                "--repeat",
                "2",
                "--rounds",
                "1",
                "--json",
                bench_json,
            ],
            240,
            _env(MEMGATHER_NCCL_MIN_BYTES="0"),
        )
        if os.path.exists(bench_json):
            with open(bench_json) as rows:
                bench["rows"] = json.load(rows)
        summary["steps"].append(bench)
        summary["steps"].append(accelerate_step(args.wheels))
        cuda_tests = "cuda or graph_capture or input_not_contiguous or nccl2 or slot_written"
        summary["steps"].append(
            _step(
                "CUDA tests",
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "tests/test_cuda.py",
                    "tests/test_fallbacks.py",
                    "-k",
                    cuda_tests,
                ],
                240,
            )
        )
        summary["steps"].append(two_ranks_step())
    with open(args.out, "w") as out:
        json.dump(summary, out, indent=2)
    print(f"gpu_check: summary in {args.out}")
    return (
        0 if all(step["status"] == "passed" or step["status"].startswith("skipped") for step in summary["steps"]) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
