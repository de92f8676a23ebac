"""The CUDA path on a real GPU: fresh slots rebound on NCCL, and each hazard left to torch.

Each case runs in a fresh interpreter that is a world of 1 on NCCL (a device copy:
the same calls and the same allocator as on many ranks), under torch and then under
memgather, and compares values, version counters, where the slots' memory lies and
``torch.cuda.max_memory_allocated``. They skip without a CUDA device and NCCL; the
decision they exercise is tested without one in tests/test_cuda_memory.py and
tests/test_every_rank.py. ``benchmarks/gpu_check.py`` runs them on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from memgather import compat

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs a CUDA device and NCCL (benchmarks/gpu_check.py runs these on a GPU)")

MIB = 1 << 20

_PRELUDE = """
import json, tempfile, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
import memgather
torch.cuda.set_device(0)
dist.init_process_group(BACKEND, init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)

def peak(run):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - start

def fresh(n, factory=torch.empty_like, stream=None):
    '''build() for compare: an input of n floats and one fresh slot of it, made on stream (default: current).'''
    def build():
        t = torch.arange(n, dtype=torch.float32, device="cuda")
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            return [factory(t)], t
    return build

def compare(build, gather_kwargs=None, use=lambda slots: torch.cat(slots)):
    '''build() -> (slots, tensor); torch's all_gather + use(slots) against memgather's.'''
    results = {}
    for name, gather in (("torch", dist.all_gather), ("memgather", memgather.all_gather)):
        slots, tensor = build()
        addresses = [slot.data_ptr() for slot in slots]
        memgather.reset_stats()
        kwargs = dict(gather_kwargs or {})
        if name == "torch":
            kwargs.pop("elide", None)
        def run():
            work = gather(slots, tensor, **kwargs)
            if work is not None:
                work.wait()
            return use(slots)
        out, grown = peak(run)
        stats = memgather.stats()
        results[name] = {"values": out.cpu().tolist() if out.numel() < 64 else float(out.double().sum()),
                         "versions": [slot._version if not slot.is_inference() else None for slot in slots],
                         "moved": addresses != [slot.data_ptr() for slot in slots], "peak": grown,
                         "strategies": dict(stats.by_strategy), "fallbacks": dict(stats.fallbacks),
                         "routes": dict(stats.by_route)}
    return results
"""


def _run(body: str, backend: str = "nccl", env: Dict[str, str] | None = None) -> Dict[str, Any]:
    script = _PRELUDE.replace("BACKEND", repr(backend)) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TORCH_DISTRIBUTED_DEBUG": "OFF", "MEMGATHER_NCCL_MIN_BYTES": "0",
                               **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _same(results: Dict[str, Any]) -> Dict[str, Any]:
    ours, torchs = results["memgather"], results["torch"]
    assert ours["values"] == torchs["values"], results
    assert ours["versions"] == torchs["versions"], results
    return ours


@pytest.mark.parametrize("factory", ["empty_like", "zeros_like", "ones_like", "clone"])
def test_fresh_slots_are_rebound_and_the_cat_elided(factory: str) -> None:
    """Legacy NCCL: beyond the slots, torch's temporary and then its cat (N each); memgather's buffer
    takes the freed slots' place and the cat returns it (nothing beyond them)."""
    results = _run(f"""
        print(json.dumps(compare(fresh(4 << 20, torch.{factory}), {{"elide": True}})))
    """)
    ours = _same(results)
    assert ours["strategies"] == {"rebind": 1} and ours["moved"], results
    assert results["torch"]["peak"] - ours["peak"] >= 4 * (4 << 20) - MIB, results


def test_a_kept_list_is_rebound() -> None:
    """Without a cat: the slots become views of one buffer and torch's temporary is saved."""
    results = _run("""
        print(json.dumps(compare(fresh(4 << 20), {}, use=lambda slots: slots[0])))
    """)
    ours = _same(results)
    assert ours["strategies"] == {"rebind": 1}, results
    assert results["torch"]["peak"] - ours["peak"] >= 4 * (4 << 20) - MIB, results


def test_async_rebind_holds_the_result_after_wait() -> None:
    results = _run("""
        print(json.dumps(compare(fresh(1 << 20), {"async_op": True, "elide": True})))
    """)
    assert _same(results)["strategies"] == {"rebind": 1}, results


@pytest.mark.parametrize("case,reason", [
    ("written", "slot_written"),  # a slot some kernel wrote: maybe a graph's static tensor
    ("inference", "slot_written"),  # no version counter to show it fresh
    ("dlpack", "slot_memory"),  # not torch's allocator's deleter
])
def test_memory_memgather_cannot_prove_stays_with_torch(case: str, reason: str) -> None:
    results = _run(f"""
        n = 1 << 20
        def build():
            t = torch.arange(n, dtype=torch.float32, device="cuda")
            if {case!r} == "written":
                slot = torch.empty_like(t).fill_(0)
            elif {case!r} == "inference":
                with torch.inference_mode():
                    slot = torch.empty_like(t)
            else:
                slot = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(torch.empty_like(t)))
            return [slot], t
        use = lambda slots: slots[0].clone()
        if {case!r} == "inference":
            with torch.inference_mode():
                print(json.dumps(compare(build, {{"elide": True}}, use=use)))
        else:
            print(json.dumps(compare(build, {{"elide": True}}, use=use)))
    """)
    ours = _same(results)
    assert ours["fallbacks"] == {reason: 1} and not ours["moved"], results


def test_slots_made_on_a_side_stream() -> None:
    """Slots allocated on another stream: recorded on the current one before they are freed, so the
    result is right and the block is not reused under work still queued."""
    results = _run("""
        print(json.dumps(compare(fresh(4 << 20, stream=torch.cuda.Stream()), {"elide": True})))
    """)
    assert _same(results)["strategies"] == {"rebind": 1}, results


@pytest.mark.skipif(compat.torch_release() < compat.NCCL2_OPT_IN_SINCE,
                    reason=f"torch {torch.__version__} has no ProcessGroupNCCL2")
def test_nccl2_rewires_elided_calls_only() -> None:
    """ProcessGroupNCCL2: an elided cat takes the single call (t + 2N -> t + N); a kept list stays with torch."""
    body = """
        build = fresh(4 << 20)
        print(json.dumps([compare(build, {"elide": True}), compare(build, {}, use=lambda s: s[0].clone())]))
    """
    elided, kept = _run(body, backend="nccl2")  # type: ignore[misc]
    assert _same(elided)["strategies"] == {"rebind": 1} and elided["memgather"]["routes"] == {"single_every_rank": 1}
    assert _same(kept)["fallbacks"] == {"nccl2": 1}
