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
  DeepSpeed ZeRO's pattern,
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


# What a variant times under: unpatched, the bare wrapper, or memgather patched for a target.
_TORCH, _BARE = "torch", "bare"
_NO_TARGET = "memgather_no_such_target"


def measure(calls: int = 20000, rounds: int = 7) -> Dict[str, float]:
    """Median microseconds per call of each variant.

    The variants take turns, one round each, ``rounds`` times over: a machine that
    slows down for a while then slows every variant alike, where timing one variant's
    rounds after another's put the slowdown into some rows and not others (rows moved
    by microseconds from one invocation to the next).
    """
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memgather.engine import core

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    tensor = torch.ones(1024)
    buffer = torch.empty(2048)
    direct = list(buffer.chunk(2))
    single = _single_call()
    # (name, how it runs, the NCCL threshold set to 0, the call)
    variants: List[Tuple[str, str, bool, Callable[[], Any]]] = [
        ("torch", _TORCH, False, lambda: _user_call(tensor)),
        ("bare wrapper", _BARE, False, lambda: _user_call(tensor)),
        ("non-target", _NO_TARGET, False, lambda: _user_call(tensor)),
        ("below threshold", "*", False, lambda: _user_call(tensor)),
        ("rewired (rebind)", "*", True, lambda: _user_call(tensor)),
        ("torch's calls of a rebind", _TORCH, True, lambda: _rebind_by_hand(tensor)),
        ("direct slots: torch", _TORCH, True, lambda: _user_into(direct, tensor)),
        ("direct slots: rewired", "*", True, lambda: _user_into(direct, tensor)),
        ("direct slots: single call alone", _TORCH, True, lambda: single(buffer, tensor)),
        ("Function: torch", _TORCH, True, lambda: _user_function(tensor)),
        ("Function: non-target", _NO_TARGET, True, lambda: _user_function(tensor)),
        ("Function: rewired", "memgather_bench_user", True, lambda: _user_function(tensor)),
    ]
    times: Dict[str, List[float]] = {name: [] for name, *_ in variants}
    counts: Dict[str, int] = {}
    try:
        for _ in range(rounds):
            for name, runs, zero, call in variants:
                with _environment("MEMGATHER_NCCL_MIN_BYTES", "0" if zero else None), _running(runs) as rewired:
                    times[name].append(_time(call, calls))
                if runs not in (_TORCH, _BARE):
                    counts[name] = counts.get(name, 0) + rewired()
    finally:
        core.configure()  # the last unpatch() read the threshold of 0: not for whatever this process does next
    _check_counts(counts)
    return {name: statistics.median(values) for name, values in times.items()}


def _check_counts(counts: Dict[str, int]) -> None:
    """Every variant did what its name says; else its timing would be meaningless."""
    for name, rewired in counts.items():
        expected = "rewired" in name
        if bool(rewired) != expected:
            raise RuntimeError(f"variant {name!r} was {'not ' if expected else ''}rewired: its timing would be "
                               "meaningless")


@contextlib.contextmanager
def _running(runs: str) -> Iterator[Callable[[], int]]:
    """Unpatched (``_TORCH``), under the bare wrapper (``_BARE``), or memgather patched for the target
    ``runs``; yields what tells how many calls memgather rewired in the block."""
    import torch.distributed as dist
    import wrapt

    import memgather

    if runs == _TORCH:
        yield lambda: 0
        return
    if runs == _BARE:
        seen: Dict[Any, bool] = {}

        def lookup_only(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            seen.get(sys._getframe(1).f_code)
            return wrapped(*args, **kwargs)

        with _replaced(dist, "all_gather", wrapt.FunctionWrapper(dist.all_gather, lookup_only)):
            yield lambda: 0
        return
    memgather.patch([runs])
    try:
        memgather.reset_stats()
        yield lambda: memgather.stats().rewired
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
def _environment(name: str, value: Optional[str]) -> Iterator[None]:
    """``name`` set to ``value`` in the block (None: left as it is)."""
    if value is None:
        yield
        return
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


def _time(function: Callable[[], None], calls: int) -> float:
    """Microseconds per call of one round of ``calls`` calls."""
    function()  # warm caches (the caller decision, torch's dispatch)
    return timeit.timeit(function, number=calls) / calls * 1e6


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
