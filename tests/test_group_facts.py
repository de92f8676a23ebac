"""memgather.engine.group_facts: what calls on a group take, kept per group and device type."""

from __future__ import annotations

from typing import Iterator, List

import pytest
import torch

from memgather import config
from memgather.engine import core, group_facts, groups, planner
from tests.conftest import run_on_fake


class _Group:
    """Stands for a process group: only its identity and a weak reference matter here."""


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    planner.configure(config.Settings())
    yield
    core.configure()  # this process's own settings back


def _same_id_after_free() -> List[_Group]:
    """A group learned about and freed, then a new one at its address: [the new one], or [] if
    none of 100000 new objects took it."""
    old = _Group()
    group_facts.work_out(old, groups.GroupInfo(2, 0, "gloo"), "cpu")
    address = id(old)
    del old  # freed at once (no cycle): its memory goes back to CPython's pool for objects of its size
    held = []  # new objects kept alive, so that each takes another free block, until one takes that one
    for _ in range(100000):
        held.append(_Group())
        if id(held[-1]) == address:
            return held[-1:]
    return []


def test_a_new_group_at_a_freed_groups_address_is_worked_out_again() -> None:
    found = _same_id_after_free()
    if not found:
        pytest.skip("the interpreter gave no new object the freed group's address")
    new_info = groups.GroupInfo(3, 1, "gloo")
    known = group_facts.lookup(found[0], torch.ones(2), new_info)
    assert known is not None and known.info is new_info  # not the freed group's world of 2


def test_what_a_group_takes_goes_with_the_group_and_stays_while_it_lives() -> None:
    alive = [_Group() for _ in range(300)]  # more groups than any bound a cache might have
    for group in alive:
        group_facts.work_out(group, groups.GroupInfo(2, 0, "gloo"), "cpu")
    assert all(group_facts.lookup(group, torch.ones(2), None) is not None for group in alive)
    del group
    alive.pop()
    assert group_facts.kept() == 299  # the freed group's entry went with it


def test_what_a_group_takes_is_kept_per_device_type_and_emptied_by_configure() -> None:
    group = _Group()
    info = groups.GroupInfo(2, 0, "cpu:gloo,cuda:nccl", "legacy")
    on_cpu = group_facts.lookup(group, torch.ones(2), info)
    on_meta = group_facts.lookup(group, torch.ones(2, device="meta"), info)
    assert on_cpu is not None and on_meta is not None
    assert on_cpu.limit == 2 * (2 << 20) and on_cpu.synchronous is not None  # gloo's threshold and broadcasts
    assert on_meta.limit == 0 and on_meta.synchronous is None  # no backend for meta tensors: never below, no route
    assert group_facts.lookup(group, torch.ones(3), None) is on_cpu  # kept: found without the description
    planner.configure(config.Settings(gloo_min_bytes=0))
    assert group_facts.lookup(group, torch.ones(2), None) is None  # emptied; the group is not described here
    assert group_facts.lookup(group, torch.ones(2), info).limit == 0  # worked out again, under the new setting


def test_a_call_working_out_its_group_while_configure_runs_keeps_nothing_from_before() -> None:
    """A thread paused inside work_out, after it read the thresholds, while another's patch() sets new
    ones: its entry must not outlive that configure() (the later calls here were left to torch)."""
    out = run_on_fake("""
        import threading
        from memgather import config
        from memgather.engine import routes
        t = torch.ones(16 << 10)  # 64 KiB per rank: under the default 1 MiB threshold
        call = lambda: memgather.all_gather([torch.empty_like(t), torch.empty_like(t)], t)
        call()  # the group described
        core.configure(config.Settings())  # what it takes forgotten, as by any patch()
        original, paused, resumed = routes.choose, threading.Event(), threading.Event()
        def held_choose(*args, **kwargs):  # work_out calls it after reading the thresholds
            if threading.current_thread().name == "worker":
                paused.set()
                assert resumed.wait(timeout=60)  # until the other thread has re-configured
            return original(*args, **kwargs)
        routes.choose = held_choose
        worker = threading.Thread(target=call, name="worker")
        worker.start()
        assert paused.wait(timeout=60)
        core.configure(config.Settings(nccl_min_bytes=0))  # another thread's patch(): rewire everything
        resumed.set()
        worker.join()
        routes.choose = original
        memgather.reset_stats()
        for _ in range(3):
            call()
        print(dict(memgather.stats().by_strategy))
    """)
    assert out.strip() == "{'rebind': 3}"


def test_meta_tensors_go_to_torch_with_check_on_as_with_it_off() -> None:
    """Meta tensors have no data: check mode's exchange of them raised where torch's call does not."""
    out = run_on_fake("""
        t = torch.ones(4, device="meta")
        slots = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(slots, t)  # torch's call: fine on this backend
        memgather.all_gather(slots, t, check=True)
        gathered = memgather.gather(t, check=True)
        print(tuple(gathered.shape), gathered.device, dict(memgather.stats().fallbacks))
    """)
    assert out.strip() == "(8,) meta {'backend': 2}"
