"""``memgather bench --overhead``: microseconds memgather adds to one call.

Timed in-process on torch's no-op ``fake`` backend, where the collective costs
nothing, so what remains is the Python around it. Four ways to call
``all_gather`` of two 4 KiB slots are compared, fresh slots each call:

- torch: the unpatched function;
- bare wrapper: a wrapt ``FunctionWrapper`` whose wrapper only looks its
  caller's code object up in a dict (the floor for any caller-scoped wrapper);
- non-target: memgather patched, the caller not a target;
- rewired: memgather patched, the caller a target (rebind strategy).

Then the same three (torch, non-target, rewired) for a gather made inside an
autograd Function's forward (``torch.distributed.nn.functional.all_gather``,
as Lightning's ``all_gather`` makes it): such a decision cannot be cached by
the forward's code, which serves every caller, so each call walks the stack
to the code that applied the Function.
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
    rewired = _patched(results, "", lambda: _user_call(tensor), "*", calls, rounds)
    results["Function: torch"] = _time(lambda: _user_function(tensor), calls, rounds)
    through_function = _patched(results, "Function: ", lambda: _user_function(tensor), "memgather_bench_user",
                                calls, rounds)
    if rewired == 0 or through_function == 0:
        raise RuntimeError("a rewired variant was not rewired; its timing would be meaningless")
    return results


def _patched(results: Dict[str, float], label: str, call: Callable[[], Any], target: str, calls: int,
             rounds: int) -> int:
    """Time ``call`` patched for another target ("non-target"), then for ``target`` ("rewired");
    returns how many calls the latter rewired."""
    import memgather

    memgather.patch(["memgather_overhead_no_such_target"])
    results[label + "non-target"] = _time(call, calls, rounds)
    memgather.patch([target])
    memgather.reset_stats()
    results[label + "rewired"] = _time(call, calls, rounds)
    rewired = memgather.stats().rewired
    memgather.unpatch()
    return rewired


# What user code does: fresh slots, and dist.all_gather looked up at call time,
# so every variant is reached through the same caller. It is compiled into a
# namespace of its own because memgather's frames are skipped when looking for
# the caller: inside memgather.overhead it would never count as user code.
_USER_CODE = """
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn


def call(tensor):
    dist.all_gather([torch.empty_like(tensor), torch.empty_like(tensor)], tensor)


def function(tensor):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation notice, torch's cost alike in every variant
        return dist_nn.all_gather(tensor)
"""
_user_namespace: Dict[str, Any] = {"__name__": "memgather_bench_user"}
exec(compile(_USER_CODE, "<memgather bench user code>", "exec"), _user_namespace)
_user_call = _user_namespace["call"]
_user_function = _user_namespace["function"]


def _time(function: Callable[[], None], calls: int, rounds: int) -> float:
    function()  # warm caches (the caller decision, torch's dispatch)
    per_round: List[float] = [t / calls * 1e6 for t in timeit.repeat(function, number=calls, repeat=rounds)]
    return statistics.median(per_round)


def table(results: Dict[str, float]) -> str:
    base = results["torch"]
    lines = ["variant                us/call   added vs torch"]
    for name, value in results.items():
        if name == "Function: torch":
            base = value
        lines.append(f"{name:<22} {value:7.2f}   {value - base:+7.2f}")
    lines.append(f"non-target adds {results['non-target'] - results['bare wrapper']:+.2f} us over the bare wrapper")
    return "\n".join(lines)
