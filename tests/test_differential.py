"""memgather.all_gather against torch's own all_gather, bit for bit, on real gloo ranks.

Every generated case runs twice on every rank of a pool: the original
all_gather into one set of slots, memgather's into another built the same way.
The bytes of every slot must match, the caller's tensor objects must be kept,
and the strategy memgather reports must be the one expected, so that a silent
fallback cannot pass for a rewire.
"""

from __future__ import annotations

import math
import random
from typing import Any, Dict, List

import pytest
import torch

from memgather import compat
from memgather.engine import routes
from memgather.engine.routes import BROADCAST_MIN_BYTES_PER_RANK
from tests.conftest import EAGER, unwrap
from tests.ranks import differential
from tests.releases import EMPTY_KILLS_GLOO, gloo_gathers_empty_tensors

DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool", "complex64"]
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8}
SHAPES = [(), (0,), (0, 3), (7,), (4, 3), (2, 3, 4), (2, 1, 3, 2), (3, 0, 2), (1, 5)]
LAYOUTS = ["contiguous", "strided", "permuted"]
SLOTS = ["empty_like", "zeros_like", "ones_like", "clone", "views", "views_input_in_slot"]
FRESH = {"empty_like", "zeros_like", "ones_like", "clone"}
SUBGROUPS = {1: [None], 2: [None, (1,)], 3: [None, (0, 2)], 4: [None, (1, 2, 3), (0, 3)]}
WORLDS = [1, 2, 3, 4]


def _cases() -> List[Dict[str, Any]]:
    rng = random.Random(20261129)
    cases = []
    for world in WORLDS:
        for dtype in DTYPES:
            for index in range(9):
                cases.append({
                    "world": world,
                    "dtype": dtype,
                    "shape": SHAPES[index],
                    "layout": rng.choice(LAYOUTS),
                    "slots": rng.choice(SLOTS),
                    "async": rng.random() < 0.3,
                    "group": rng.choice(SUBGROUPS[world]),
                })
        # Large enough per rank for gloo's broadcast route, in each slot layout.
        for slots in ["empty_like", "views", "views_input_in_slot"]:
            cases.append({"world": world, "dtype": "float32", "shape": (1024, 520), "layout": "strided",
                          "slots": slots, "async": False, "group": None})
        cases.append({"world": world, "dtype": "int8", "shape": (3 << 20,), "layout": "contiguous",
                      "slots": "zeros_like", "async": True, "group": None})
    for seed, case in enumerate(cases):
        case["seed"] = seed
    return cases


CASES = _cases()


def _case_id(case: Dict[str, Any]) -> str:
    shape = "x".join(map(str, case["shape"])) or "scalar"
    group = "sub" + "".join(map(str, case["group"])) if case["group"] else "world"
    mode = "async" if case["async"] else "sync"
    return f"w{case['world']}-{case['dtype']}-{shape}-{case['layout']}-{case['slots']}-{group}-{mode}"


def expected(case: Dict[str, Any], member: bool, threshold: int, in_place: str = "broadcast") -> Dict[str, Any]:
    """What memgather must report for this case on one rank, rewiring gloo calls from ``threshold`` bytes per rank.

    Two capabilities of the running torch change the answer (test_releases checks
    both against the releases measured and against a real gloo group): whether
    gloo has the single-tensor all-gather that async calls take, and whether a
    slot can be proven to hold its storage alone, which a rebind needs.
    """
    numel = math.prod(case["shape"])
    if not member:
        return _fallback("not_in_group")
    if numel * ITEMSIZE[case["dtype"]] < threshold:  # decided before the slots are looked at
        return _fallback("below_threshold")
    if case["async"] and not compat.gloo_has_single_tensor():
        return _fallback("backend")  # no route for an async gloo call on this torch
    if numel == 0:
        return _fallback("empty")
    if in_place == "ring" and getattr(torch, case["dtype"]) not in routes.RING_DTYPES:
        in_place = "broadcast"  # what gloo's collectives refuse on some release keeps their errors
    route = "single_staged" if case["async"] else in_place
    size = len(case["group"]) if case["group"] else case["world"]
    permuted = case["layout"] == "permuted" and sum(d > 1 for d in case["shape"]) > 1
    if case["slots"] not in FRESH:
        return {"strategy": "direct", "route": route}
    if size == 1 and not permuted:  # one fresh slot is trivially a region of its own
        return {"strategy": "direct", "route": route}
    if route != "single_staged":  # broadcasts and the ring fill the caller's slots where they lie
        return _fallback("slot_not_contiguous") if permuted else {"strategy": "in_slots", "route": route}
    if not compat.can_prove_exclusive():
        return _fallback("cannot_prove_exclusive")
    return _fallback("slot_not_contiguous") if permuted else {"strategy": "rebind", "route": route}


def _fallback(reason: str) -> Dict[str, Any]:
    return {"strategy": "fallback", "reason": reason}


# The default threshold leaves small gloo calls to torch; threshold 0 rewires every
# call, so that every dtype and shape (0-d included) goes through the rewired paths.
# "ring": every call rewired, sync gloo calls set to the ring of point-to-point transfers
# (MEMGATHER_GLOO_ROUTE=ring, as where a group's ranks run on several hosts) instead of the broadcasts.
THRESHOLDS = {"default": ({}, BROADCAST_MIN_BYTES_PER_RANK), "eager": (EAGER, 0),
              "ring": ({**EAGER, "MEMGATHER_GLOO_ROUTE": "ring"}, 0)}
_results: Dict[Any, List[Any]] = {}


def _results_for(pools: Any, world: int, threshold: str) -> List[Any]:
    """Run every case of one world size in a single round trip to its pool."""
    if (world, threshold) not in _results:
        batch = [c for c in CASES if c["world"] == world and _runnable(c)]
        per_rank = unwrap(pools(world, **THRESHOLDS[threshold][0]).run(differential, batch, timeout_s=240))
        _results[world, threshold] = [dict(zip(range(world), row)) for row in zip(*per_rank)]
    return _results[world, threshold]


def _runnable(case: Dict[str, Any]) -> bool:
    """Whether the case can run in a shared pool on this torch (torch's own call must not kill it)."""
    return gloo_gathers_empty_tensors() or math.prod(case["shape"]) > 0


def test_enough_cases() -> None:
    assert len(CASES) >= 300
    assert {c["dtype"] for c in CASES} == set(DTYPES)
    assert {c["world"] for c in CASES} == set(WORLDS)
    assert any(c["group"] for c in CASES) and any(c["async"] for c in CASES)


@pytest.mark.parametrize("threshold", sorted(THRESHOLDS))
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_torch_bit_for_bit(pools: Any, case: Dict[str, Any], threshold: str) -> None:
    if not _runnable(case):
        pytest.skip(EMPTY_KILLS_GLOO)
    index = [c for c in CASES if c["world"] == case["world"] and _runnable(c)].index(case)
    for rank, got in _results_for(pools, case["world"], threshold)[index].items():
        if got["raised"] != [None, None]:
            # This torch rejects the call (gloo before 2.2 has no bfloat16): so must memgather.
            assert got["raised"][0] == got["raised"][1], f"rank {rank}: torch / memgather raised {got['raised']}"
            continue
        want = expected(case, got["member"], THRESHOLDS[threshold][1], "ring" if threshold == "ring" else "broadcast")
        assert got["equal"], f"rank {rank}: gathered bytes differ from torch's"
        assert got["meta_equal"], f"rank {rank}: slot shapes or dtypes differ from torch's"
        assert got["identity_kept"], f"rank {rank}: the caller's tensor objects were replaced"
        assert got["return_kind"][0] == got["return_kind"][1], f"rank {rank}: return {got['return_kind']}"
        assert got["work_answers"][0] == got["work_answers"][1], f"rank {rank}: the work's answers differ"
        assert got["strategy"] == {want["strategy"]: 1}, f"rank {rank}: {got}"
        if want["strategy"] == "fallback":
            assert got["fallbacks"] == {want["reason"]: 1}, f"rank {rank}: {got}"
        else:
            assert got["route"] == {want["route"]: 1}, f"rank {rank}: {got}"
            if want["strategy"] != "in_slots":
                assert got["one_buffer"], f"rank {rank}: slots do not share one buffer"
            assert got["versions_bumped"], f"rank {rank}: slot version counters not bumped"
