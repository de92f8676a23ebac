"""Every reason to fall back is reached, and falling back changes nothing.

Each case runs torch's all_gather and memgather's on real gloo ranks with the
same arguments: both must raise the same exception type, or both succeed with
the same bytes, and memgather must report the expected reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.distributed as dist

import memgather
from memgather import Reason, compat
from tests.conftest import EAGER, unwrap
from tests.ranks import BAD_INPUTS, compare_bad_input, compare_mixed_dtypes, compare_peer_dependent
from tests.releases import requires_fake_backend

EXPECTED_REASON = {
    "not_a_list": "not_a_list",
    "wrong_length": "wrong_length",
    "slot_not_a_tensor": "not_a_tensor",
    "input_not_a_tensor": "not_a_tensor",
    "slot_subclass": "slot_subclass",
    "input_torch_function": "torch_function",
    "sparse_input": "unsupported_layout",
    "conj_input": "unsupported_layout",
    "dtype_mismatch": "dtype_mismatch",
    "device_mismatch": "device_mismatch",
    "meta_device": "backend",
    "uneven_slots": "uneven_slots",
    "slot_requires_grad": "slot_requires_grad",
    "inference_slots": "inference_tensor",
    "duplicate_slot": "duplicate_slot",
    "input_is_other_rank_view": "input_overlaps_output",
    "input_is_own_fresh_slot": "input_overlaps_output",
    "slot_view_held": "slots_shared",
    "slot_storage_held": "slots_shared",
    "permuted_slots": "slot_not_contiguous",
    "overlapping_slots": "slots_shared" if compat.can_prove_exclusive() else "cannot_prove_exclusive",
    "input_views_other_slot": "input_overlaps_output",
}

BIG = 655360  # float32 elements: 2.5 MiB per rank, on gloo's broadcast route
SMALL = 3


# Not rebound (something else holds the slot's memory), but on gloo's broadcast route
# filled where they lie: the kept view or storage then sees the gathered data, as under
# torch (compared above). On the single route they fall back (slots_shared, below).
FILLED_IN_SLOTS = {"slot_view_held", "slot_storage_held"}
if not compat.can_prove_exclusive():
    # Where no rebind can be proven (torch 1.13.1, 2.0.1), the rebind that this case's
    # input (its own fresh slot) rules out is never tried: the slots are filled where they lie.
    FILLED_IN_SLOTS.add("input_is_own_fresh_slot")


def test_every_bad_input_has_an_expected_reason() -> None:
    assert set(EXPECTED_REASON) == set(BAD_INPUTS)


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_same_outcome_as_torch(pools: Any, name: str) -> None:
    # EAGER: small gloo calls are otherwise left to torch before their slots are even looked at
    for rank, result in enumerate(unwrap(pools(2, **EAGER).run(compare_bad_input, name))):
        assert result["got"] == result["want"], f"rank {rank}: torch {result['want']}, memgather {result['got']}"
        if name in FILLED_IN_SLOTS:
            assert result["strategy"] == {"in_slots": 1}, f"rank {rank}: {result}"
        else:
            assert result["fallbacks"] == {EXPECTED_REASON[name]: 1}, f"rank {rank}: {result['fallbacks']}"


def test_single_route_mixed_decisions_meet_on_the_wire(pools: Any) -> None:
    """Rank 0 rewires (async: the single-tensor call), rank 1 falls back (torch's list call):
    both still meet on the wire and give torch's bytes."""
    first, second = unwrap(pools(2, **EAGER).run(compare_peer_dependent, SMALL, 1, True))
    if compat.gloo_has_single_tensor():
        assert first["strategy"] == {"rebind": 1}
        assert second["fallbacks"] == {"slots_shared": 1}
    else:  # no single-tensor call on this gloo: both stay with torch, before their slots are looked at
        assert first["fallbacks"] == second["fallbacks"] == {"backend": 1}
    for result in (first, second):
        assert result["got"] == result["want"]


def test_large_gather_falls_back_on_every_rank_when_one_must(pools: Any) -> None:
    """The broadcast route is a different protocol: one rank's fallback takes all ranks along."""
    first, second = unwrap(pools(2).run(compare_peer_dependent, BIG, 1, False, "strided"))
    assert first["fallbacks"] == {"peer_fallback": 1}
    assert second["fallbacks"] == {"slot_not_contiguous": 1}
    for result in (first, second):
        assert result["got"] == result["want"]


def test_ranks_disagreeing_on_dtype_fall_back_without_check(pools: Any) -> None:
    for result in unwrap(pools(2).run(compare_mixed_dtypes, BIG, False)):
        assert result["fallbacks"] == {"uneven_ranks": 1}
        assert result["got"] == result["want"]


def test_not_initialized_raises_what_torch_raises() -> None:
    assert not dist.is_initialized()
    with pytest.raises(Exception) as torch_error:  # ValueError on torch 2.13, RuntimeError on 2.0.1
        dist.all_gather([torch.empty(3)], torch.ones(3))
    memgather.reset_stats()
    with pytest.raises(torch_error.type) as ours:
        memgather.all_gather([torch.empty(3)], torch.ones(3))
    assert str(ours.value) == str(torch_error.value)
    assert dict(memgather.stats().fallbacks) == {"not_initialized": 1}


def _run_script(body: str) -> Any:
    """Run ``body`` in a fresh interpreter; it prints one JSON line last."""
    prelude = textwrap.dedent(
        """
        import json, warnings
        warnings.simplefilter("ignore")
        import torch, torch.distributed as dist
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@requires_fake_backend
def test_coalescing_manager_is_left_to_torch() -> None:
    # gloo refuses coalescing outright; torch's no-op "fake" backend queues ops.
    got = _run_script(
        """
        import memgather
        from torch.distributed.distributed_c10d import _coalescing_manager
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        with _coalescing_manager(device=torch.device("cpu")):
            memgather.all_gather([torch.empty(3) for _ in range(2)], torch.ones(3))
        print(json.dumps(dict(memgather.stats().fallbacks)))
        """
    )
    assert got == {"coalescing": 1}


@requires_fake_backend
def test_compiled_function_is_left_to_torch() -> None:
    got = _run_script(
        """
        import memgather
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        def f(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            memgather.all_gather(slots, t)
            return slots
        torch.compile(f, backend="eager")(torch.ones(3))
        print(json.dumps(dict(memgather.stats().fallbacks)))
        """
    )
    assert got == {"compiling": 1}


def test_torch_without_single_tensor_primitive() -> None:
    # torch < 1.9 lacks all three primitives and does not install on Python >= 3.9;
    # removing them from this torch reaches the same code path.
    got = _run_script(
        """
        for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
            if hasattr(dist, name):  # all_gather_single arrived in 2.13
                delattr(dist, name)
        import memgather
        import tempfile  # a file rendezvous: torch 2.0 reads tcp port 0 as a missing port
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        slots = [torch.empty(3)]
        memgather.all_gather(slots, torch.arange(3.0))
        print(json.dumps({"fallbacks": dict(memgather.stats().fallbacks),
                          "reason": memgather.primitive().reason, "data": slots[0].tolist()}))
        """
    )
    assert got["fallbacks"] == {"no_primitive": 1}
    assert "has none of" in got["reason"]
    assert got["data"] == [0.0, 1.0, 2.0]


@requires_fake_backend
def test_torch_without_storage_use_count() -> None:
    # torch 2.0.1 has no _storage_Use_Count (DESIGN.md); removing it reaches that path.
    # The "fake" backend gives a group of 2 in one process, so fresh slots need a rebind.
    got = _run_script(
        """
        del torch._C._storage_Use_Count
        import memgather
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        memgather.all_gather([torch.empty(3) for _ in range(2)], torch.arange(3.0))
        print(json.dumps(dict(memgather.stats().fallbacks)))
        """
    )
    assert got == {"cannot_prove_exclusive": 1}


def test_every_reason_is_reached_somewhere() -> None:
    """The reasons this file and test_differential.py assert cover the whole enum."""
    covered = set(EXPECTED_REASON.values()) | {
        "uneven_ranks", "peer_fallback", "not_initialized", "coalescing", "compiling",
        "no_primitive", "cannot_prove_exclusive", "not_in_group", "empty", "below_threshold",
    }
    # input_not_contiguous is reachable only on NCCL (the route that reads raw
    # memory); no GPU here, so test_routes.py checks the route table instead.
    assert covered | {"input_not_contiguous"} == {reason.value for reason in Reason}
