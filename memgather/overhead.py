"""``memgather bench --overhead``: microseconds memgather adds to one call.

Timed in-process on torch's no-op ``fake`` backend, where the collective costs
nothing, so what remains is the Python around it. Four ways to call
``all_gather`` of two 4 KiB slots are compared, fresh slots each call:

- torch: the unpatched function;
- bare wrapper: a wrapt ``FunctionWrapper`` whose wrapper only looks its
  caller's code object up in a dict (the floor for any caller-scoped wrapper);
- non-target: memgather patched, the caller not a target;
- rewired: memgather patched, the caller a target (rebind strategy).
"""

from __future__ import annotations

import statistics
import sys
import timeit
from typing import Any, Callable, Dict, List


def measure(calls: int = 20000, rounds: int = 7) -> Dict[str, float]:
    """Median microseconds per call of each variant."""
    import torch
    import torch.distributed as dist
    import wrapt
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import memgather

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    tensor = torch.ones(1024)
    original = dist.all_gather
    seen: Dict[Any, bool] = {}

    def lookup_only(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        seen.get(sys._getframe(1).f_code)
        return wrapped(*args, **kwargs)

    bare = wrapt.FunctionWrapper(original, lookup_only)

    results: Dict[str, float] = {}
    results["torch"] = _time(lambda: _user_call(tensor), calls, rounds)
    dist.all_gather = bare
    try:
        results["bare wrapper"] = _time(lambda: _user_call(tensor), calls, rounds)
    finally:
        dist.all_gather = original
    memgather.patch(["memgather_overhead_no_such_target"])
    results["non-target"] = _time(lambda: _user_call(tensor), calls, rounds)
    memgather.patch(["*"])
    memgather.reset_stats()
    results["rewired"] = _time(lambda: _user_call(tensor), calls, rounds)
    rewired = memgather.stats().rewired
    memgather.unpatch()
    if rewired == 0:
        raise RuntimeError("the rewired variant was not rewired; its timing would be meaningless")
    return results


# What user code does: fresh slots, and dist.all_gather looked up at call time,
# so every variant is reached through the same caller. It is compiled into a
# namespace of its own because memgather's frames are skipped when looking for
# the caller: inside memgather.overhead it would never count as user code.
_USER_CODE = """
import torch
import torch.distributed as dist


def call(tensor):
    dist.all_gather([torch.empty_like(tensor), torch.empty_like(tensor)], tensor)
"""
_user_namespace: Dict[str, Any] = {"__name__": "memgather_bench_user"}
exec(compile(_USER_CODE, "<memgather bench user code>", "exec"), _user_namespace)
_user_call = _user_namespace["call"]


def _time(function: Callable[[], None], calls: int, rounds: int) -> float:
    function()  # warm caches (the caller decision, torch's dispatch)
    per_round: List[float] = [t / calls * 1e6 for t in timeit.repeat(function, number=calls, repeat=rounds)]
    return statistics.median(per_round)


def table(results: Dict[str, float]) -> str:
    base = results["torch"]
    lines = ["variant        us/call   added vs torch"]
    for name, value in results.items():
        lines.append(f"{name:<14} {value:7.2f}   {value - base:+7.2f}")
    lines.append(f"non-target adds {results['non-target'] - results['bare wrapper']:+.2f} us over the bare wrapper")
    return "\n".join(lines)
