"""The route table: which collective for which backend, device, size and mode."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from benchmarks.overhead import fake_as_legacy_nccl
from memgather.engine import routes
from tests.conftest import unwrap

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
MIB = 1 << 20
# The NCCL default per rank for 3 ranks: (90 + 10) us x 3.35 TB/s / (2 x 3), rounded up to a whole MiB, as
# routes' docstring derives it (tests/test_nccl_threshold.py checks the rule itself).
NCCL_3 = 54 << 20


@pytest.mark.parametrize(
    "backend,device,async_op,expected",
    [
        ("gloo", CPU, False, routes.BROADCAST),
        ("gloo", CPU, True, routes.SINGLE_STAGED),
        ("gloo", CUDA, False, None),
        ("nccl", CPU, False, None),
        ("fake", CPU, False, None),  # torch's no-op backend moves nothing: no route (benchmarks give it one)
        ("mpi", CPU, False, None),
        ("", CPU, False, None),
    ],
)
def test_choose(backend: str, device: torch.device, async_op: bool, expected: object) -> None:
    assert routes.choose(backend, device, async_op) is expected


@pytest.mark.parametrize(
    "backend,flavour,expected",
    [
        ("nccl", "legacy", routes.SINGLE_IN_PLACE),
        ("nccl-legacy", "legacy", routes.SINGLE_IN_PLACE),
        ("nccl", "nccl2", None),  # fills the slots itself: nothing to save but an elided cat (elided_route)
        ("nccl2", "nccl2", None),
        ("nccl", None, None),  # an NCCL group of a class memgather has not read (e.g. nccl-lazy)
    ],
)
def test_nccl_by_flavour(backend: str, flavour: Any, expected: object) -> None:
    for async_op in (False, True):
        assert routes.choose(backend, CUDA, async_op, nccl_flavour=flavour) is expected
    assert routes.choose(backend, CPU, False, nccl_flavour=flavour) is None


@pytest.mark.parametrize(
    "backend,device_type,flavour,per_rank,below",
    [
        ("gloo", "cpu", None, 4 << 10, True),
        ("gloo", "cpu", None, 2 * MIB - 1, True),
        ("gloo", "cpu", None, 2 * MIB, False),
        ("gloo", "cuda", None, 4 << 10, False),  # no route at all: the backend decides, not a threshold
        ("nccl", "cuda", "legacy", NCCL_3 - 1, True),
        ("nccl", "cuda", "legacy", NCCL_3, False),
        ("nccl-legacy", "cuda", "legacy", 4 << 10, True),
        ("nccl", "cuda", "nccl2", NCCL_3 - 1, True),  # ProcessGroupNCCL2's elided calls: the same rule
        ("nccl", "cuda", "nccl2", NCCL_3, False),
        ("nccl", "cuda", None, 4 << 10, False),  # an NCCL class memgather has not read: no route at all
        ("nccl", "cpu", "legacy", 4 << 10, False),
        ("fake", "cpu", None, 4 << 10, False),  # no route at all
        ("mpi", "cpu", None, 4 << 10, False),
    ],
)
def test_below_threshold(backend: str, device_type: str, flavour: Any, per_rank: int, below: bool) -> None:
    assert (per_rank * 3 < routes.gathered_limit(backend, device_type, flavour, 3)) is below


@pytest.mark.parametrize("backend,flavour,expected", [
    ("nccl", "nccl2", routes.SINGLE_EVERY_RANK), ("nccl2", "nccl2", routes.SINGLE_EVERY_RANK),
    ("nccl", "legacy", None), ("nccl", None, None), ("gloo", None, None), ("fake", None, None),
])
def test_elided_route(backend: str, flavour: Any, expected: object) -> None:
    """Only ProcessGroupNCCL2 on CUDA has a route of its own for elided calls; on the CPU none has."""
    assert routes.elided_route(backend, CUDA, flavour) is expected
    assert routes.elided_route(backend, CPU, flavour) is None


def test_the_benchmarks_give_the_fake_backend_legacy_nccls_route_and_threshold_in_their_block() -> None:
    """benchmarks/overhead.py's stand-in: routes.choose reaches the replaced single_route through the module."""
    with fake_as_legacy_nccl():
        assert routes.choose("fake", CPU, False) is routes.SINGLE_STAGED
        assert routes.single_route("fake", CPU) is routes.SINGLE_STAGED
        assert routes.gathered_limit("fake", "cpu", None, 3) == 3 * NCCL_3
        assert routes.gathered_limit("fake", "cpu", None, 2, nccl_min_bytes=0) == 0
        assert routes.choose("gloo", CPU, False) is routes.BROADCAST  # every other backend as before
        assert routes.gathered_limit("gloo", "cpu", None, 2) == 2 * routes.BROADCAST_MIN_BYTES_PER_RANK
    assert routes.choose("fake", CPU, False) is None
    assert routes.gathered_limit("fake", "cpu", None, 3) == 0


def test_thresholds_are_adjustable() -> None:
    assert routes.gathered_limit("gloo", "cpu", None, 2, gloo_min_bytes=0) == 0
    assert routes.gathered_limit("gloo", "cpu", None, 2, gloo_min_bytes=4 * MIB) == 8 * MIB
    assert routes.gathered_limit("nccl", "cuda", "legacy", 2, nccl_min_bytes=0) == 0
    assert routes.gathered_limit("nccl", "cuda", "legacy", 2, nccl_min_bytes=4 * MIB) == 8 * MIB
    assert routes.gathered_limit("nccl", "cuda", "nccl2", 2, nccl_min_bytes=4 * MIB) == 8 * MIB


def test_nccl_flavour_is_told_by_the_groups_cuda_backend_class() -> None:
    """The classes can only be built with a GPU: stand-ins named like them, as _get_backend returns them."""
    from memgather import compat

    def group_with(name: str) -> Any:
        backend = type(name, (), {})()
        return type("ProcessGroup", (), {"_get_backend": lambda self, device: backend})()

    assert compat.nccl_flavour(group_with("ProcessGroupNCCL")) == "legacy"
    assert compat.nccl_flavour(group_with("ProcessGroupNCCL2")) == "nccl2"
    assert compat.nccl_flavour(group_with("ProcessGroupNCCLLazy")) is None


def test_a_gloo_group_has_no_nccl_flavour(pools: Any) -> None:
    assert unwrap(pools(2).run(flavour_of_world)) == [[None, None]] * 2


def flavour_of_world(ctx: Any) -> List[Any]:
    """A real gloo group: its _get_backend(cuda) raises, and describe() records no flavour."""
    import torch.distributed as dist

    from memgather import compat
    from memgather.engine import groups

    return [compat.nccl_flavour(dist.GroupMember.WORLD), groups.describe(None).nccl]


def test_only_the_broadcast_route_needs_agreement_and_only_nccl_needs_contiguous_input() -> None:
    assert [r.needs_agreement for r in (routes.SINGLE_STAGED, routes.SINGLE_IN_PLACE, routes.BROADCAST)] == [False, False, True]
    assert [r.contiguous_input_only for r in (routes.SINGLE_STAGED, routes.SINGLE_IN_PLACE, routes.BROADCAST)] == [False, True, False]


@pytest.mark.parametrize(
    "name,device,expected",
    [("gloo", CPU, "gloo"), ("NCCL", CUDA, "nccl"), ("cpu:gloo,cuda:nccl", CPU, "gloo"),
     ("cpu:gloo,cuda:nccl", CUDA, "nccl"), ("cuda:nccl", CPU, "")],
)
def test_backend_for_device(name: str, device: torch.device, expected: str) -> None:
    assert routes.backend_for_device(name, device) == expected


def test_async_gloo_calls_leave_torch_alone_where_gloo_lacks_the_single_tensor_call() -> None:
    # torch < 2.2: gloo raises on all_gather_into_tensor, which torch's list call never does.
    assert routes.choose("gloo", CPU, True, gloo_single=False) is None
    assert routes.choose("gloo", CPU, False, gloo_single=False) is routes.BROADCAST


@pytest.mark.parametrize("version,expected", [
    ("2.0.1", False), ("2.1.2+cu121", False), ("2.2.0", True), ("2.2.0a0+git8ac9b20", True),
    ("2.13.0+cpu", True), ("1.13.1", False), ("10.0", True),
])
def test_gloo_single_tensor_support_by_torch_release(version: str, expected: bool) -> None:
    from memgather import compat

    assert (compat._release(version) >= compat.GLOO_SINGLE_TENSOR_SINCE) is expected


def test_the_ring_where_the_group_spans_hosts_or_where_set() -> None:
    broadcast = routes.choose("gloo", CPU, False)
    assert broadcast is routes.BROADCAST
    assert routes.settle(broadcast, "auto", True, torch.float32) is routes.RING
    assert routes.settle(broadcast, "auto", True, torch.complex64) is routes.RING
    assert routes.settle(broadcast, "auto", False, torch.float32) is routes.BROADCAST
    assert routes.settle(broadcast, "ring", False, torch.float32) is routes.RING
    assert routes.settle(broadcast, "broadcast", True, torch.float32) is routes.BROADCAST
    # gloo's collectives refuse these on some or all releases; its point-to-point transfers would not
    for dtype in (torch.bool, torch.bfloat16, torch.int16):
        assert routes.settle(broadcast, "ring", True, dtype) is routes.BROADCAST
    for other in (routes.SINGLE_STAGED, routes.SINGLE_IN_PLACE):  # only the in-place gloo route moves
        assert routes.settle(other, "ring", True, torch.float32) is other
    assert routes.RING.needs_agreement and routes.RING.in_place and routes.RING.saves_temp


def test_host_key_is_the_same_for_processes_of_one_host_and_a_non_negative_int64() -> None:
    import subprocess
    import sys

    from memgather.engine import hosts

    code = "from memgather.engine import hosts; print(hosts.key())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert int(other.stdout) == hosts.key()
    assert 0 <= hosts.key() < 1 << 63


def host_routes(ctx: Any, keys: List[int], setting: str) -> Dict[str, Any]:
    """Rank r pretends to run on host keys[r]; one 4 MiB gather, and the routes it took."""
    import memgather
    from memgather import config
    from memgather.engine import core, hosts

    saved = hosts._key
    hosts._key = keys[ctx.rank]
    core.configure(config.Settings(gloo_route=setting))
    try:
        memgather.reset_stats()
        slots = [torch.empty(1 << 20) for _ in range(ctx.world)]
        memgather.all_gather(slots, torch.full((1 << 20,), float(ctx.rank)))
        correct = all(torch.equal(s, torch.full((1 << 20,), float(r))) for r, s in enumerate(slots))
        stats = memgather.stats()
        return {"correct": correct, "routes": dict(stats.by_route), "fallbacks": dict(stats.fallbacks)}
    finally:
        hosts._key = saved
        core.configure()


@pytest.mark.parametrize("keys,setting,route", [
    ([7, 7, 7], "auto", "broadcast"),
    ([7, 7, 9], "auto", "ring"),  # one rank elsewhere: the whole group takes the ring
    ([7, 9, 11], "broadcast", "broadcast"),
    ([7, 7, 7], "ring", "ring"),
])
def test_every_rank_takes_the_route_the_host_keys_call_for(pools: Any, keys: List[int], setting: str, route: str) -> None:
    for result in unwrap(pools(3).run(host_routes, keys, setting)):
        assert result == {"correct": True, "routes": {route: 1}, "fallbacks": {}}, result


def mixed_routes(ctx: Any) -> Dict[str, Any]:
    """Rank 0 is set to the ring, the others to the broadcasts: they must not meet on two protocols."""
    import memgather
    from memgather import config
    from memgather.engine import core

    core.configure(config.Settings(gloo_route="ring" if ctx.rank == 0 else "broadcast"))
    try:
        memgather.reset_stats()
        slots = [torch.empty(1 << 20) for _ in range(ctx.world)]
        memgather.all_gather(slots, torch.full((1 << 20,), float(ctx.rank)))
        correct = all(torch.equal(s, torch.full((1 << 20,), float(r))) for r, s in enumerate(slots))
        return {"correct": correct, "fallbacks": dict(memgather.stats().fallbacks)}
    finally:
        core.configure()


def test_ranks_set_to_different_routes_all_fall_back(pools: Any) -> None:
    for result in unwrap(pools(2).run(mixed_routes)):
        assert result == {"correct": True, "fallbacks": {"peer_fallback": 1}}, result


@pytest.mark.parametrize("version,setting,expected", [
    ("2.13.0+cpu", None, "legacy"), ("2.13.0", "1", "legacy"),  # no ProcessGroupNCCL2 to opt into
    ("2.14.1", None, "legacy"), ("2.14.1", "1", "nccl2"), ("2.14.1", "0", "legacy"),
    ("2.15.0", None, "nccl2"), ("2.15.0", "0", "legacy"), ("2.15.0", "1", "nccl2"), ("2.16.0a0+git1", None, "nccl2"),
])
def test_default_nccl_flavour_by_release_and_setting(version: str, setting: Any, expected: str) -> None:
    from memgather import compat

    assert compat.default_nccl_flavour(version, setting) == expected
