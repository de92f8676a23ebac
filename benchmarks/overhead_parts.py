"""Where a rewired call's microseconds go: each step of memgather's path, timed alone.

    python benchmarks/overhead_parts.py [--calls 20000]

On torch's no-op ``fake`` backend with legacy NCCL's route (as ``benchmarks/overhead.py``
gives it) and two fresh 4 KiB slots a call, each step of a rebind is timed on its
own, the best of five rounds: binding the call, planning it (the preconditions, the
route, the slot checks that prove a rebind safe), taking the plan a call site kept
instead (``memgather.engine.kept``: its facts re-checked; where the call site's code
proves the slots made like the input, all but two of them), the rebind's torch calls
and the single-tensor call, and the bookkeeping (the statistics; plain CPU slots are
parked as they are released, and their version counters need no setting back). The
whole call, through the wrapper, closes the table; the steps add up to less than it
(the calls between them, and timing each step apart warms its caches). The two fresh
slots every row allocates are timed first and taken off.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: the repository root, for ``benchmarks``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(calls: int) -> List[Tuple[str, float]]:
    """(step, microseconds per call) for each step, fresh slots' allocation taken off."""
    os.environ["MEMGATHER_NCCL_MIN_BYTES"] = "0"
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import memgather
    from benchmarks import overhead, user_code
    from memgather.engine import kept, planner, routes, slots
    from memgather.engine.call import Call, bind

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    overhead.treat_fake_as_legacy_nccl()
    memgather.patch([user_code.__name__])
    tensor = torch.ones(1024)

    def fresh() -> List[Any]:
        return [torch.empty_like(tensor), torch.empty_like(tensor)]

    def call_of(tensor_list: List[Any]) -> Call:
        return Call(tensor_list, tensor, None, False, (tensor_list, tensor), {}, False, False, False)

    plan = planner.plan(call_of(fresh()))
    route = plan.route
    assert plan.strategy is memgather.Strategy.PARKED_REBIND and route is not None, plan

    def best(function: Callable[[], Any]) -> float:
        function()
        return min(timeit.repeat(function, number=calls, repeat=5)) / calls * 1e6

    allocation = best(fresh)
    site = kept.Site()  # a call site's holder: its plan kept from the first call on
    planner.plan(call_of(fresh()), site)
    assert site.kept is not None, "the rebind's plan was not kept"
    steps = [
        ("bind the call", lambda: bind((fresh(), tensor), {}, False, False, False)),
        ("plan it (preconditions, route, slot checks)", lambda: planner.plan(call_of(fresh()))),
        ("take the call site's kept plan (facts re-checked)", lambda: kept.reuse(site, call_of(fresh()))),
        (
            "the same, the slots proven made like the input",
            lambda: kept.reuse(site, call_of(fresh()), True),
        ),
        (
            "rebind's torch calls + the single-tensor call",
            lambda: routes.run(route, slots.rebind(fresh(), parked=True), tensor, None, False, released=False),
        ),
        ("bookkeeping (statistics)", lambda: _bookkeeping(fresh(), plan)),
        ("the whole rewired call, through the wrapper", lambda: user_code.call(tensor)),
    ]
    results = [(name, best(step) - allocation) for name, step in steps]
    memgather.unpatch()
    results.append(("torch's own call, unpatched", best(lambda: user_code.call(tensor)) - allocation))
    return results


def _bookkeeping(tensor_list: List[Any], plan: Any) -> None:
    """The statistics of one call (``tensor_list``: the fresh slots every row allocates, taken off)."""
    from memgather.engine import counters

    counters.record("rebind", route=plan.route.name, saved=0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/overhead_parts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per round (default 20000)")
    args = parser.parse_args(argv)
    print("step                                                  us/call")
    for name, value in measure(args.calls):
        print(f"{name:<52} {value:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
