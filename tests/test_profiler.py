"""What a profile shows of a rewired call: one memgather::all_gather range around memgather's own collectives."""

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

