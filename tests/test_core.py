"""memgather.all_gather / gather on real gloo ranks: check mode, gather(), async,
failure, memory, statistics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import memgather
from memgather import compat
from tests.conftest import EAGER, unwrap
from tests.releases import EMPTY_KILLS_GLOO, gloo_gathers_empty_tensors
from tests.ranks import (
    async_work,
    direct_in_place,
    failure_after_rebind,
    gather_result,
    peak_growth,
    uneven_check,
    small_calls_twice,
    uneven_inputs,
    warnings_raised,
)

BIG = 655360  # float32 elements: 2.5 MiB per rank, gloo's broadcast route

# What an async gloo call of fresh slots becomes on this torch (see test_releases):
# rebound where gloo has the single-tensor call and a slot can be proven to be
# its storage's only holder; left to torch otherwise.
ASYNC_FRESH = {"rebind": 1} if compat.gloo_has_single_tensor() and compat.can_prove_exclusive() else {"fallback": 1}
# A synchronous gloo call with elision asked for: rebound where that can be proven
# safe, else filled where the slots lie (the broadcasts write there either way).
ELIDED_FRESH = {"rebind": 1} if compat.can_prove_exclusive() else {"in_slots": 1}


@pytest.mark.parametrize("numel", [3, BIG], ids=["single-route", "broadcast-route"])
def test_check_raises_on_every_rank_naming_each_shape(pools: Any, numel: int) -> None:
    results = unwrap(pools(3).run(uneven_check, [numel, numel + 1, numel]))
    for result in results:
        assert result["raised"] and result["is_value_error"]
        assert result["shapes"] == [([numel], "torch.float32"), ([numel + 1], "torch.float32"), ([numel], "torch.float32")]
        for rank, size in enumerate([numel, numel + 1, numel]):
            assert f"rank {rank}: ({size},) float32" in result["message"]


@pytest.mark.parametrize("subgroup", [(0, 1, 2), (0, 2)])
def test_small_gloo_calls_pass_through_before_and_after_the_group_is_known(pools: Any, subgroup: Any) -> None:
    for rank, result in enumerate(unwrap(pools(3).run(small_calls_twice, subgroup))):
        if rank in subgroup:
            assert result == {"member": True, "same": True, "fallbacks": {"below_threshold": 2}}
        else:
            assert result == {"member": False}


def test_check_passes_even_shapes_and_still_rewires(pools: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(uneven_check, [5, 5])):
        assert result == {"raised": False, "strategy": {"in_slots": 1}, "correct": True}


@pytest.mark.parametrize(
    "shape,dtype,subgroup",
    [((), "float32", None), ((4, 3), "bfloat16", None), ((BIG,), "float32", None), ((2, 5), "int64", (0, 2)), ((0, 2), "float32", None)],
)
def test_gather_equals_cat_of_all_gather(pools: Any, shape: Any, dtype: str, subgroup: Any) -> None:
    if 0 in shape and not gloo_gathers_empty_tensors():
        pytest.skip(EMPTY_KILLS_GLOO)
    for result in unwrap(pools(3).run(gather_result, shape, dtype, subgroup)):
        if result["member"] and "raised" in result:  # this torch's gloo refuses the dtype
            assert result["raised"][0] is not None and result["raised"][0] == result["raised"][1], result
        elif result["member"]:
            assert result["shape"] == result["want_shape"]
            assert result["equal"]
            # Small gathers take torch's single-tensor call where gloo has one (else torch's
            # list call, which records no route); big ones the broadcasts.
            small = {"single": 1} if compat.gloo_has_single_tensor() else {}
            assert result["routes"] == ({"broadcast": 1} if shape == (BIG,) else small), result
        else:
            assert "not a member" in result["message"]


def test_gather_of_scalars_has_shape_world(pools: Any) -> None:
    for result in unwrap(pools(3).run(gather_result, (), "int32", None)):
        assert result["shape"] == [3]


def test_async_returns_torch_work_and_wait_completes(pools: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(async_work, 1000)):
        assert result == {"is_work": True, "completed": True, "strategy": ASYNC_FRESH, "correct": True}


def test_failed_collective_leaves_slots_valid(pools: Any) -> None:
    """A peer that never arrives: the error propagates, the slots stay allocated and shaped."""
    first, second = unwrap(pools(2, **EAGER).run(failure_after_rebind, 1000, timeout_s=120))
    assert second["skipped"]
    assert first["raised"] == "RuntimeError"
    assert first["strategy"] == ASYNC_FRESH  # where rebound, the storages were released before the failure
    assert first["identity_kept"] and first["allocated"]
    assert first["shapes"] == [[1000], [1000]]


def test_direct_writes_in_place(pools: Any) -> None:
    for result in unwrap(pools(3, **EAGER).run(direct_in_place, 1000)):
        assert result == {"strategy": {"direct": 1}, "pointers_kept": True, "same_storage": True, "correct": True}


MIB = 1 << 20
MEMORY_NUMEL = 12 * MIB  # 48 MiB float32 per rank: beyond glibc's mmap threshold, so frees reach the OS


@pytest.mark.parametrize("elide", [True, False], ids=["rebind", "in-slots"])
def test_rebind_never_holds_old_slots_and_buffer_at_once(pools: Any, elide: bool) -> None:
    """Zero-filled (resident) slots: were they alive when the buffer is filled, RSS would grow by
    the gathered size; released first, it barely moves. (With elision asked for, the slots are
    rebound to one buffer; without, gloo's broadcasts fill them where they lie.)"""
    for result in unwrap(pools(2).run(peak_growth, MEMORY_NUMEL, "zeros_like", True, elide)):
        assert result["correct"] and result["strategy"] == (ELIDED_FRESH if elide else {"in_slots": 1})
        assert result["growth"] < 0.25 * result["gathered"], result


def test_rebind_peak_growth_is_the_gathered_size(pools: Any) -> None:
    """Fresh empty_like slots: torch grows by about 2x the gathered size, memgather by 1x."""
    ours = unwrap(pools(2).run(peak_growth, MEMORY_NUMEL, "empty_like", True, True))
    torchs = unwrap(pools(2).run(peak_growth, MEMORY_NUMEL, "empty_like", False, False))
    for mine, theirs in zip(ours, torchs):
        assert mine["correct"] and theirs["correct"]
        assert mine["route"] == {"broadcast": 1} and mine["strategy"] == ELIDED_FRESH
        assert mine["growth"] <= 1.05 * mine["gathered"], mine
        assert theirs["growth"] >= 1.5 * theirs["gathered"], theirs


def test_stats_are_typed_printable_and_reset() -> None:
    memgather.reset_stats()
    empty = memgather.stats()
    assert isinstance(empty, memgather.Stats)
    assert (empty.calls, empty.rewired, empty.bytes_saved) == (0, 0, 0)
    with pytest.raises(Exception) as torchs:
        torch.distributed.all_gather([torch.empty(1)], torch.ones(1))  # no process group in this process
    with pytest.raises(torchs.type):  # ValueError on torch 2.13, RuntimeError on 2.0
        memgather.all_gather([torch.empty(1)], torch.ones(1))
    snapshot = memgather.stats()
    assert snapshot.calls == 1 and snapshot.fallbacks == {"not_initialized": 1}
    assert "1 calls, 0 rewired" in str(snapshot) and "not_initialized=1" in str(snapshot)
    with pytest.raises(TypeError):
        snapshot.fallbacks["x"] = 1  # a snapshot, not a live view
    memgather.reset_stats()
    assert memgather.stats().calls == 0


def test_primitive_is_reported_with_its_reason() -> None:
    chosen = memgather.primitive()
    assert chosen.name == compat.single_tensor_primitive().name and chosen.name in chosen.reason
    assert chosen.torch_version == torch.__version__


@pytest.mark.parametrize("env", [{}, EAGER], ids=["default-threshold", "every-gloo-call-rewired"])
def test_no_warning_from_memgathers_own_calls(pools: Any, env: Any) -> None:
    """all_gather_into_tensor and _all_gather_base warn on torch 2.13: memgather must not call them.
    Every warning is recorded (FutureWarning and DeprecationWarning included), on every route."""
    for caught in unwrap(pools(2, **env).run(warnings_raised)):
        assert caught == []


@pytest.mark.parametrize(
    "shapes,dtypes,named",
    [([[4, 3], [5, 3]], ["float32", "float32"], ["rank 0: (4, 3) float32", "rank 1: (5, 3) float32"]),
     ([[4, 3], [4, 2]], ["float32", "float32"], ["rank 0: (4, 3) float32", "rank 1: (4, 2) float32"]),
     ([[4, 3], [4, 3]], ["float32", "int32"], ["rank 0: (4, 3) float32", "rank 1: (4, 3) int32"])],
    ids=["first-dim", "trailing-dim", "dtype"],
)
def test_check_names_every_kind_of_unevenness(pools: Any, shapes: Any, dtypes: Any, named: Any) -> None:
    for result in unwrap(pools(2).run(uneven_inputs, shapes, dtypes, timeout_s=60)):
        assert result["raised"] and result["elapsed"] < 10
        for part in named:
            assert part in result["message"]
