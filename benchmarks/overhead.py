"""Microseconds memgather adds to one call of ``all_gather``.

    python benchmarks/overhead.py [--calls 20000] [--rounds 7]

Timed in-process on torch's no-op ``fake`` backend, where the collective costs
nothing, so what remains is the Python around it. memgather itself has no route
for a backend that moves nothing: on the fake backend every call goes to torch
(reason ``backend``), and there would be nothing of memgather's to time. So this
benchmark, in its own process only, gives the fake backend legacy NCCL's
treatment (``fake_as_legacy_nccl``): the same threshold
(``MEMGATHER_NCCL_MIN_BYTES``) and a single-tensor route, so that what is timed is
memgather's own Python on the path a small or a rewired NCCL call takes. Ways to
call ``all_gather`` of two 4 KiB slots (the calls are in ``benchmarks/user_code.py``):

- torch: the unpatched function, fresh slots each call;
- bare wrapper: a wrapt ``FunctionWrapper`` whose wrapper only looks its
  caller's code object up in a dict (the floor for any caller-scoped wrapper);
- non-target: memgather patched, the caller not a target;
- below threshold: the caller a target, the call under the NCCL threshold
  (what a small NCCL call costs: it goes to torch at once);
- rewired (rebind): the threshold set to 0, fresh slots rebound to one buffer, the
  call site's kept plan taken (``memgather.engine.kept``), as in a loop;
- rewired (rebind), planned in full: the same with no plan kept, as a call site's
  first call is, and every CUDA call;
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

import argparse
import contextlib
import os
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

# ``python benchmarks/overhead.py``: the repository root, for memgather and benchmarks.user_code.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

DEFAULT_CALLS = 20000
DEFAULT_ROUNDS = 7

# Rows measured against the row named in the pair, not against plain "torch".
_BASES: Dict[str, str] = {
    "direct slots: rewired": "direct slots: torch",
    "direct slots: single call alone": "direct slots: torch",
    "Function: non-target": "Function: torch",
    "Function: rewired": "Function: torch",
}


# The rebind again, with no plan kept on the call site: every call planned in full, as a site's
# first call is, and every CUDA call (memgather keeps the plans of CPU calls only).
_FULL = "rewired (rebind), planned in full"


@contextlib.contextmanager
def _planned_in_full() -> Iterator[None]:
    """No plan is kept on a call site in the block (``memgather.engine.kept``)."""
    from memgather.engine import kept

    def keep_nothing(site: Any, call: Any, plan: Any, facts: Any) -> None:
        site.kept = None

    with _replaced(kept, "keep", keep_nothing):
        yield


# What a variant times under: unpatched, the bare wrapper, or memgather patched for a target.
_TORCH, _BARE = "torch", "bare"
_NO_TARGET = "memgather_no_such_target"


def treat_fake_as_legacy_nccl() -> Callable[[], None]:
    """Give torch's fake backend legacy NCCL's route and threshold in this process; returns what undoes it.

    ``memgather.engine.routes.single_route`` and ``gathered_limit`` are replaced by
    wrappers that answer for ``backend == "fake"`` as for legacy NCCL, and defer to the
    originals otherwise: the single-tensor call (``routes.SINGLE_STAGED``; legacy NCCL's
    own ``SINGLE_IN_PLACE`` would count a saved temporary the fake backend never had)
    from ``world`` x the NCCL threshold (``MEMGATHER_NCCL_MIN_BYTES``) on. The planner
    reads both, and ``routes.choose`` reads ``single_route``, as module attributes at
    call time; ``core.configure`` drops what the planner already worked out per group.
    Harmless where memgather itself has a route for the fake backend.
    """
    from memgather.engine import core, routes

    single_route, gathered_limit = routes.single_route, routes.gathered_limit

    def fake_single_route(backend: str, *args: Any, **kwargs: Any) -> Optional[routes.Route]:
        if backend == "fake":
            return routes.SINGLE_STAGED
        return single_route(backend, *args, **kwargs)

    def fake_gathered_limit(
        backend: str,
        device_type: str,
        nccl_flavour: Optional[str],
        world: int,
        gloo_min_bytes: Optional[int] = None,
        nccl_min_bytes: Optional[int] = None,
    ) -> int:
        if backend == "fake":  # the limit legacy NCCL's CUDA calls get, from the library's own rule
            return gathered_limit("nccl", "cuda", "legacy", world, gloo_min_bytes, nccl_min_bytes)
        return gathered_limit(backend, device_type, nccl_flavour, world, gloo_min_bytes, nccl_min_bytes)

    routes.single_route, routes.gathered_limit = fake_single_route, fake_gathered_limit
    core.configure(core.settings())

    def undo() -> None:
        routes.single_route, routes.gathered_limit = single_route, gathered_limit
        core.configure(core.settings())

    return undo


@contextlib.contextmanager
def fake_as_legacy_nccl() -> Iterator[None]:
    """In the block, the fake backend has legacy NCCL's route and threshold (``treat_fake_as_legacy_nccl``)."""
    undo = treat_fake_as_legacy_nccl()
    try:
        yield
    finally:
        undo()


def measure(calls: int = DEFAULT_CALLS, rounds: int = DEFAULT_ROUNDS) -> Dict[str, float]:
    """Median microseconds per call of each variant.

    The variants take turns, one round each, ``rounds`` times over: a machine that
    slows down for a while then slows every variant alike, where timing one variant's
    rounds after another's put the slowdown into some rows and not others (rows moved
    by microseconds from one invocation to the next).
    """
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks import user_code
    from memgather.engine import core

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    tensor = torch.ones(1024)
    buffer = torch.empty(2048)
    direct = list(buffer.chunk(2))
    single = _single_call()
    park = torch.empty(0)  # where the by-hand rebind parks the slots it releases
    # (name, how it runs, the NCCL threshold set to 0, the call)
    variants: List[Tuple[str, str, bool, Callable[[], Any]]] = [
        ("torch", _TORCH, False, lambda: user_code.call(tensor)),
        ("bare wrapper", _BARE, False, lambda: user_code.call(tensor)),
        ("non-target", _NO_TARGET, False, lambda: user_code.call(tensor)),
        ("below threshold", "*", False, lambda: user_code.call(tensor)),
        ("rewired (rebind)", "*", True, lambda: user_code.call(tensor)),
        (_FULL, "*", True, lambda: user_code.call(tensor)),
        (
            "torch's calls of a rebind",
            _TORCH,
            True,
            lambda: user_code.rebind_by_hand(
                [torch.empty_like(tensor), torch.empty_like(tensor)], tensor, single, park
            ),
        ),
        ("direct slots: torch", _TORCH, True, lambda: user_code.into(direct, tensor)),
        ("direct slots: rewired", "*", True, lambda: user_code.into(direct, tensor)),
        ("direct slots: single call alone", _TORCH, True, lambda: single(buffer, tensor)),
        ("Function: torch", _TORCH, True, lambda: user_code.function(tensor)),
        ("Function: non-target", _NO_TARGET, True, lambda: user_code.function(tensor)),
        ("Function: rewired", user_code.__name__, True, lambda: user_code.function(tensor)),
    ]
    times: Dict[str, List[float]] = {name: [] for name, *_ in variants}
    counts: Dict[str, int] = {}
    with fake_as_legacy_nccl():
        try:
            for _ in range(rounds):
                for name, runs, zero, call in variants:
                    with (
                        _environment("MEMGATHER_NCCL_MIN_BYTES", "0" if zero else None),
                        _running(runs) as rewired,
                        _planned_in_full() if name == _FULL else contextlib.nullcontext(),
                    ):
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
            raise RuntimeError(
                f"variant {name!r} was {'not ' if expected else ''}rewired: its timing would be meaningless"
            )


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


def _time(function: Callable[[], None], calls: int) -> float:
    """Microseconds per call of one round of ``calls`` calls."""
    function()  # warm caches (the caller decision, torch's dispatch)
    return timeit.timeit(function, number=calls) / calls * 1e6


# The unpatched calls the other rows are measured against.
_BASELINES = ("torch", "direct slots: torch", "Function: torch")


def rows(results: Dict[str, float]) -> List[Tuple[str, float, Optional[float]]]:
    """(variant, us per call, added over its torch baseline; None for a baseline) for each variant."""
    return [
        (name, value, None if name in _BASELINES else value - results[_BASES.get(name, "torch")])
        for name, value in results.items()
    ]


def table(results: Dict[str, float]) -> str:
    lines = ["variant                            us/call   added vs torch"]
    for name, value, added in rows(results):
        lines.append(f"{name:<34} {value:7.2f}   {'' if added is None else format(added, '+7.2f')}")
    lines.append(
        f"non-target adds {results['non-target'] - results['bare wrapper']:+.2f} us over the bare wrapper; "
        f"below threshold {results['below threshold'] - results['non-target']:+.2f} us over non-target"
    )
    own_rebind = results["rewired (rebind)"] - results["torch's calls of a rebind"]
    own_direct = results["direct slots: rewired"] - results["direct slots: single call alone"]
    lines.append(
        f"memgather's own Python beyond the torch calls it makes: {own_rebind:+.2f} us (rebind), "
        f"{own_direct:+.2f} us (direct slots)"
    )
    own_full = results[_FULL] - results["torch's calls of a rebind"]
    lines.append(
        f"as a multiple of torch's own list call in this run ({results['torch']:.2f} us): "
        f"{own_rebind / results['torch']:.2f} x (rebind), "
        f"{own_direct / results['direct slots: torch']:.2f} x (direct slots)"
    )
    lines.append(
        f"a rebind planned in full (a call site's first call; every CUDA call): {own_full:+.2f} us, "
        f"{own_full / results['torch']:.2f} x"
    )
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/overhead.py",
        description="Microseconds memgather adds to one all_gather call of two 4 KiB slots, per way of calling "
        "(unpatched, a bare wrapper, not a target, below the threshold, rewired, direct slots, inside an "
        "autograd Function), each against torch's own call, in this process on torch's no-op 'fake' "
        "backend (the collective costs nothing), which the benchmark gives legacy NCCL's route: what remains is "
        "memgather's own Python. The variants take turns; a row is the median of the rounds.",
    )
    parser.add_argument(
        "--calls", type=_positive, default=DEFAULT_CALLS, help=f"calls per variant and round (default {DEFAULT_CALLS})"
    )
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=DEFAULT_ROUNDS,
        help=f"rounds, each variant once per round (default {DEFAULT_ROUNDS})",
    )
    args = parser.parse_args(argv)
    print(table(measure(args.calls, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
