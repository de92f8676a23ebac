"""The CUDA path on a real GPU: fresh slots rebound on NCCL, and each hazard left to torch.

Each case runs on two NCCL ranks sharing the one GPU (tests/nccl_ranks.py: a world of 1
would not do, its one slot being the whole output), under torch and then under memgather,
and compares values, version counters, where the slots' memory lies and
``torch.cuda.max_memory_allocated`` on every rank. They skip without a CUDA device and NCCL;
the decision they exercise is tested without one in tests/test_cuda_memory.py and
tests/test_every_rank.py. ``benchmarks/gpu_check.py`` runs them on a GPU machine.
"""

from __future__ import annotations

import textwrap
from typing import Any, Dict, List

import pytest
import torch

from memgather import compat
from tests import nccl_ranks

pytestmark = pytest.mark.skipif(not nccl_ranks.available(),
                                reason="needs a CUDA device and NCCL (benchmarks/gpu_check.py runs these on a GPU)")

MIB = 1 << 20

_PRELUDE = """
import memgather

def peak(run):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - start

def fresh(n, factory=torch.empty_like, stream=None):
    '''build() for compare: this rank's input of n floats and WORLD fresh slots of it, made on stream.'''
    def build():
        t = torch.arange(n, dtype=torch.float32, device="cuda") + RANK
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            return [factory(t) for _ in range(WORLD)], t
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
                         "gathered": WORLD * tensor.numel() * tensor.element_size(),
                         "strategies": dict(stats.by_strategy), "fallbacks": dict(stats.fallbacks),
                         "routes": dict(stats.by_route)}
    return results
"""


def _run(body: str, backend: str = "nccl") -> List[Any]:
    """``body`` after the prelude on every rank: each rank's printed result."""
    return nccl_ranks.run(_PRELUDE + textwrap.dedent(body), backend, env={"MEMGATHER_NCCL_MIN_BYTES": "0"})


def _same(results: Dict[str, Any]) -> Dict[str, Any]:
    ours, torchs = results["memgather"], results["torch"]
    assert ours["values"] == torchs["values"], results
    assert ours["versions"] == torchs["versions"], results
    return ours


@pytest.mark.parametrize("factory", ["empty_like", "zeros_like", "ones_like", "clone"])
def test_fresh_slots_are_rebound_and_the_cat_elided(factory: str) -> None:
    """Legacy NCCL: beyond the slots, torch's temporary and then its cat (the gathered size each);
    memgather's buffer takes the freed slots' place and the cat returns it (nothing beyond them)."""
    for results in _run(f"""
        print(json.dumps(compare(fresh(4 << 20, torch.{factory}), {{"elide": True}})))
    """):
        ours = _same(results)
        assert ours["strategies"] == {"rebind": 1} and ours["moved"], results
        assert results["torch"]["peak"] - ours["peak"] >= ours["gathered"] - MIB, results


def test_a_kept_list_is_rebound() -> None:
    """Without a cat: the slots become views of one buffer and torch's temporary is saved."""
    for results in _run("""
        print(json.dumps(compare(fresh(4 << 20), {}, use=lambda slots: slots[0])))
    """):
        ours = _same(results)
        assert ours["strategies"] == {"rebind": 1}, results
        assert results["torch"]["peak"] - ours["peak"] >= ours["gathered"] - MIB, results


def test_async_rebind_holds_the_result_after_wait() -> None:
    for results in _run("""
        print(json.dumps(compare(fresh(1 << 20), {"async_op": True, "elide": True})))
    """):
        assert _same(results)["strategies"] == {"rebind": 1}, results


@pytest.mark.parametrize("case,reason", [
    ("written", "slot_written"),  # a slot some kernel wrote: maybe a graph's static tensor
    ("inference", "slot_written"),  # no version counter to show it fresh
    ("dlpack", "slot_memory"),  # not torch's allocator's deleter
])
def test_memory_memgather_cannot_prove_stays_with_torch(case: str, reason: str) -> None:
    for results in _run(f"""
        n = 1 << 20
        def slot(t):
            if {case!r} == "written":
                return torch.empty_like(t).fill_(0)
            if {case!r} == "inference":
                with torch.inference_mode():
                    return torch.empty_like(t)
            return torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(torch.empty_like(t)))
        def build():
            t = torch.arange(n, dtype=torch.float32, device="cuda") + RANK
            return [slot(t) for _ in range(WORLD)], t
        use = lambda slots: torch.cat(slots)
        if {case!r} == "inference":
            with torch.inference_mode():
                print(json.dumps(compare(build, {{"elide": True}}, use=use)))
        else:
            print(json.dumps(compare(build, {{"elide": True}}, use=use)))
    """):
        ours = _same(results)
        assert ours["fallbacks"] == {reason: 1} and not ours["moved"], results


def test_slots_made_on_a_side_stream() -> None:
    """Slots allocated on another stream: recorded on the current one before they are freed, so the
    result is right and the block is not reused under work still queued."""
    for results in _run("""
        print(json.dumps(compare(fresh(4 << 20, stream=torch.cuda.Stream()), {"elide": True})))
    """):
        assert _same(results)["strategies"] == {"rebind": 1}, results


@pytest.mark.skipif(compat.torch_release() < compat.NCCL2_OPT_IN_SINCE,
                    reason=f"torch {torch.__version__} has no ProcessGroupNCCL2")
def test_nccl2_rewires_elided_calls_only() -> None:
    """ProcessGroupNCCL2: an elided cat takes the single call (t + 2N -> t + N); a kept list stays with torch."""
    body = """
        build = fresh(4 << 20)
        print(json.dumps([compare(build, {"elide": True}), compare(build, {}, use=lambda s: s[0].clone())]))
    """
    for elided, kept in _run(body, backend="nccl2"):
        assert _same(elided)["strategies"] == {"rebind": 1}, elided
        assert elided["memgather"]["routes"] == {"single_every_rank": 1}, elided
        assert _same(kept)["fallbacks"] == {"nccl2": 1}, kept


def test_gather_uneven_on_nccl_writes_each_ranks_rows_once() -> None:
    """One broadcast per rank into views of the result: values torch.cat's, and nothing beyond the
    result but the one int64 row per rank of the exchange (a MiB of slack for the allocator)."""
    from tests.test_uneven import UNEVEN_TWO_RANKS

    for results in nccl_ranks.run(UNEVEN_TWO_RANKS, "nccl"):
        for rows, equal, shape, peak, result_bytes in results:
            assert equal and shape == [sum(rows), 3], rows
            assert peak <= result_bytes + MIB, (rows, peak, result_bytes)


def test_taken_over_helpers_on_nccl_answer_as_the_libraries_own_code() -> None:
    """torchmetrics', Lightning's and MONAI's uneven gathers on CUDA tensors over NCCL: unpadded, one
    broadcast per rank into one tensor, everything the helpers return as their own code returns it."""
    from tests.test_padded import HELPERS_TWO_RANKS

    for results in nccl_ranks.run(HELPERS_TWO_RANKS, "nccl", env={"MEMGATHER_NCCL_MIN_BYTES": "0"}):
        for shapes, same, unpadded in results:
            assert same and unpadded == 4, (shapes, unpadded)


OBJECTS_TWO_RANKS = """
import io
from memgather.engine.object_verification import alike

obj = [{"i": RANK * 1000 + i, "t": torch.rand(1 << 18)} for i in range(8 * (RANK + 1))]  # 8 and 16 MiB, on the host
stream = io.BytesIO()
dist.distributed_c10d._pickler(stream).dump(obj)
sizes = [None] * WORLD
dist.all_gather_object(sizes, stream.getbuffer().nbytes)
del stream

def call(module, name):
    if name == "all_gather_object":
        listed = [None] * WORLD
        module.all_gather_object(listed, obj)
    elif name == "gather_object":
        listed = [None] * WORLD if RANK == 0 else None
        module.gather_object(obj, listed, dst=0)
    else:
        listed = [obj] if RANK == 0 else [None]
        module.broadcast_object_list(listed, src=0)
    return listed

out = {"largest": max(sizes), "sizes": sizes}
for name in ("all_gather_object", "gather_object", "broadcast_object_list"):
    got = {}
    for way, module in (("torch", dist), ("memgather", memgather)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        listed = call(module, name)
        torch.cuda.synchronize()
        got[way] = (listed, torch.cuda.max_memory_allocated() - start)
    out[name] = {"same": alike(got["torch"][0], got["memgather"][0]), "torch": got["torch"][1],
                 "memgather": got["memgather"][1]}
print(json.dumps(out))
"""


def test_object_collectives_on_nccl_hold_one_part_on_the_device() -> None:
    """all_gather_object, gather_object and broadcast_object_list over NCCL: torch's objects, and on the
    device at most the largest part at once (torch: every rank's bytes, padded to the largest)."""
    for results in nccl_ranks.run(OBJECTS_TWO_RANKS, "nccl"):
        largest = results["largest"]
        for name in ("all_gather_object", "gather_object", "broadcast_object_list"):
            got = results[name]
            assert got["same"], (name, got)
            assert got["memgather"] <= largest + MIB, (name, got, largest)
        assert results["all_gather_object"]["torch"] >= 2 * largest, results
