"""What a profile shows of a call memgather handles: one memgather::all_gather range around its collectives, or torch's."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

import memgather
from memgather.engine.core import PROFILER_RANGE
from tests.conftest import EAGER, unwrap


def profiled_gathers(ctx: Any) -> Dict[str, List[str]]:
    """Event names of one rewired call and one torch call, each profiled alone."""
    t = torch.full((256,), float(ctx.rank))
    names: Dict[str, List[str]] = {}
    for name, call in (("memgather", memgather.all_gather), ("torch", dist.all_gather)):
        slots = [torch.empty_like(t) for _ in range(ctx.world)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call(slots, t)
        assert all(torch.equal(s, torch.full((256,), float(r))) for r, s in enumerate(slots))
        names[name] = [event.name for event in prof.events()]
    return names


def test_a_rewired_call_reads_as_one_range(pools: Any) -> None:
    for names in unwrap(pools(2, **EAGER).run(profiled_gathers)):
        assert names["memgather"].count(PROFILER_RANGE) == 1, names["memgather"]
        # Inside it: memgather's agreement round (a small all_gather) and one broadcast per rank.
        assert names["memgather"].count("gloo:broadcast") == 2, names["memgather"]
        assert PROFILER_RANGE not in names["torch"] and "gloo:all_gather" in names["torch"], names["torch"]



def profiled_fallbacks(ctx: Any) -> Dict[str, List[str]]:
    """Event names of two small calls memgather leaves to torch (the default threshold; the group
    described by a first call): one the plan's first lines settle, and one planned in full (its input
    a Parameter, which the first lines do not take)."""
    t = torch.full((4,), float(ctx.rank))
    memgather.all_gather([torch.empty_like(t) for _ in range(ctx.world)], t)  # describes the group
    names: Dict[str, List[str]] = {}
    for name, given in (("small", t), ("planned", torch.nn.Parameter(t.clone(), requires_grad=False))):
        slots = [torch.empty_like(t) for _ in range(ctx.world)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            memgather.all_gather(slots, given)
        assert all(torch.equal(s, torch.full((4,), float(r))) for r, s in enumerate(slots))
        names[name] = [event.name for event in prof.events()]
    return names


def test_a_call_left_to_torch_after_its_plan_reads_as_one_range_around_torchs_own(pools: Any) -> None:
    """A call turned away at once (the small one) opens no range, whose profiler ops a user's mode
    would see; one planned in full shows the range around torch's call."""
    for names in unwrap(pools(2).run(profiled_fallbacks)):
        assert PROFILER_RANGE not in names["small"] and "gloo:all_gather" in names["small"], names
        assert names["planned"].count(PROFILER_RANGE) == 1 and "gloo:all_gather" in names["planned"], names
