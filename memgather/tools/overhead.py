"""``memgather bench --overhead``: microseconds memgather adds to one call.

Timed in-process on torch's no-op ``fake`` backend, where the collective costs
nothing, so what remains is the Python around it. memgather treats the fake
backend as legacy NCCL: the same threshold (``MEMGATHER_NCCL_MIN_BYTES``) and
the same single-tensor call. Ways to call ``all_gather`` of two 4 KiB slots:

- torch: the unpatched function, fresh slots each call;
- bare wrapper: a wrapt ``FunctionWrapper`` whose wrapper only looks its
  caller's code object up in a dict (the floor for any caller-scoped wrapper);
- non-target: memgather patched, the caller not a target;
- below threshold: the caller a target, the call under the NCCL threshold
  (what a small NCCL call costs: it goes to torch at once);
- rewired (rebind): the threshold set to 0, fresh slots rebound to one buffer;
- torch's calls of a rebind: the torch operations a rebind makes (release the
  slots, allocate the buffer, point the slots into it, the single-tensor call),
  with none of memgather's checks: what any rebind costs, memgather or not;
- direct slots: the slots are views of one buffer (``list(out.chunk(world))``),
  the only strategy memgather takes on NCCL (CUDA memory is never rebound),
  unpatched and rewired, and the single-tensor call into that buffer alone.

Then the same three (torch, non-target, rewired) for a gather made inside an
autograd Function's forward (``torch.distributed.nn.functional.all_gather``,
as Lightning's ``all_gather`` makes it): such a decision cannot be cached by
the forward's code, which serves every caller, so each call walks the stack
to the code that applied the Function.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import timeit
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

# Rows measured against the row named in the pair, not against plain "torch".
_BASES: Dict[str, str] = {
    "direct slots: rewired": "direct slots: torch",
    "direct slots: single call alone": "direct slots: torch",
    "Function: non-target": "Function: torch",
    "Function: rewired": "Function: torch",
}


def measure(calls: int = 20000, rounds: int = 7) -> Dict[str, float]:
    """Median microseconds per call of each variant."""
    import torch
    import torch.distributed as dist
    import wrapt
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memgather.engine import core

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    tensor = torch.ones(1024)
    buffer = torch.empty(2048)
    direct = list(buffer.chunk(2))
    seen: Dict[Any, bool] = {}

    def lookup_only(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        seen.get(sys._getframe(1).f_code)
        return wrapped(*args, **kwargs)

    results: Dict[str, float] = {}
    results["torch"] = _time(lambda: _user_call(tensor), calls, rounds)
    with _replaced(dist, "all_gather", wrapt.FunctionWrapper(dist.all_gather, lookup_only)):
        results["bare wrapper"] = _time(lambda: _user_call(tensor), calls, rounds)
    counts = {}
    counts["non-target"] = _patched(results, "non-target", lambda: _user_call(tensor), "memgather_no_such_target",
                                    calls, rounds)
    counts["below threshold"] = _patched(results, "below threshold", lambda: _user_call(tensor), "*", calls, rounds)
    with _environment("MEMGATHER_NCCL_MIN_BYTES", "0"):
        counts["rewired (rebind)"] = _patched(results, "rewired (rebind)", lambda: _user_call(tensor), "*", calls,
                                              rounds)
        results["torch's calls of a rebind"] = _time(lambda: _rebind_by_hand(tensor), calls, rounds)
        results["direct slots: torch"] = _time(lambda: _user_into(direct, tensor), calls, rounds)
        counts["direct slots: rewired"] = _patched(results, "direct slots: rewired",
                                                   lambda: _user_into(direct, tensor), "*", calls, rounds)
        single = _single_call()
        results["direct slots: single call alone"] = _time(lambda: single(buffer, tensor), calls, rounds)
        results["Function: torch"] = _time(lambda: _user_function(tensor), calls, rounds)
        counts["Function: non-target"] = _patched(results, "Function: non-target", lambda: _user_function(tensor),
                                                  "memgather_no_such_target", calls, rounds)
        counts["Function: rewired"] = _patched(results, "Function: rewired", lambda: _user_function(tensor),
                                               "memgather_bench_user", calls, rounds)
    core.configure()  # the last unpatch() read the threshold of 0: not for whatever this process does next
    _check_counts(counts)
    return results


def _check_counts(counts: Dict[str, int]) -> None:
    """Every variant did what its name says; else its timing would be meaningless."""
    for name, rewired in counts.items():
        expected = "rewired" in name
        if bool(rewired) != expected:
            raise RuntimeError(f"variant {name!r} was {'not ' if expected else ''}rewired: its timing would be "
                               "meaningless")


def _patched(results: Dict[str, float], name: str, call: Callable[[], Any], target: str, calls: int,
             rounds: int) -> int:
    """Time ``call`` with memgather patched for ``target``; returns how many calls it rewired."""
    import memgather

    memgather.patch([target])
    try:
        memgather.reset_stats()
        results[name] = _time(call, calls, rounds)
        return memgather.stats().rewired
    finally:
        memgather.unpatch()


def _single_call() -> Callable[..., Any]:
    from memgather import compat

    function = compat.single_tensor_primitive().function
    if function is None:
        raise RuntimeError("this torch has no single-tensor all-gather: nothing to time")
    return function


def _rebind_by_hand(tensor: Any) -> None:
    """What a rebind asks of torch for two fresh slots, and nothing else."""
    import torch

    slots = [torch.empty_like(tensor), torch.empty_like(tensor)]
    for slot in slots:
        slot.set_()
    flat = torch.empty((2 * tensor.shape[0],), dtype=tensor.dtype, device=tensor.device)
    storage = flat.untyped_storage()
    for index, slot in enumerate(slots):
        slot.set_(storage, index * tensor.shape[0], tensor.shape, tensor.stride())
    _single_call()(flat, tensor)


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


# What user code does: dist.all_gather looked up at call time, so every variant
# is reached through the same caller. It is compiled into a namespace of its own
# because memgather's frames are skipped when looking for the caller: inside
# memgather.tools.overhead it would never count as user code.
_USER_CODE = """
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn


def call(tensor):
    dist.all_gather([torch.empty_like(tensor), torch.empty_like(tensor)], tensor)


def into(slots, tensor):
    dist.all_gather(slots, tensor)


def function(tensor):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation notice, torch's cost alike in every variant
        return dist_nn.all_gather(tensor)
"""
_user_namespace: Dict[str, Any] = {"__name__": "memgather_bench_user"}
exec(compile(_USER_CODE, "<memgather bench user code>", "exec"), _user_namespace)
_user_call = _user_namespace["call"]
_user_into = _user_namespace["into"]
_user_function = _user_namespace["function"]


def _time(function: Callable[[], None], calls: int, rounds: int) -> float:
    function()  # warm caches (the caller decision, torch's dispatch)
    per_round: List[float] = [t / calls * 1e6 for t in timeit.repeat(function, number=calls, repeat=rounds)]
    return statistics.median(per_round)


# The unpatched calls the other rows are measured against.
_BASELINES = ("torch", "direct slots: torch", "Function: torch")


def rows(results: Dict[str, float]) -> List[Tuple[str, float, Optional[float]]]:
    """(variant, us per call, added over its torch baseline; None for a baseline) for each variant."""
    return [(name, value, None if name in _BASELINES else value - results[_BASES.get(name, "torch")])
            for name, value in results.items()]


def table(results: Dict[str, float]) -> str:
    lines = ["variant                            us/call   added vs torch"]
    for name, value, added in rows(results):
        lines.append(f"{name:<34} {value:7.2f}   {'' if added is None else format(added, '+7.2f')}")
    lines.append(f"non-target adds {results['non-target'] - results['bare wrapper']:+.2f} us over the bare wrapper; "
                 f"below threshold {results['below threshold'] - results['non-target']:+.2f} us over non-target")
    own_rebind = results["rewired (rebind)"] - results["torch's calls of a rebind"]
    own_direct = results["direct slots: rewired"] - results["direct slots: single call alone"]
    lines.append(f"memgather's own Python beyond the torch calls it makes: {own_rebind:+.2f} us (rebind), "
                 f"{own_direct:+.2f} us (direct slots)")
    return "\n".join(lines)
