"""memgather.engine.planner: what it keeps per group and device type (``_known``)."""

from __future__ import annotations

from typing import Iterator, List

import pytest
import torch

from memgather import config
from memgather.engine import core, groups, planner


class _Group:
    """Stands for a process group: only its identity and a weak reference matter here."""


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    planner.configure(config.Settings())
    yield
    core.configure()  # this process's own settings back


def _same_id_after_free() -> List[_Group]:
    """A group learned about and freed, then a new one at its address: [the new one], or [] if
    this interpreter put it elsewhere."""
    old = _Group()
    planner._learn(old, groups.GroupInfo(2, 0, "gloo"), "cpu")
    address = id(old)
    del old  # freed at once (no cycle): CPython hands its memory to the next object of its size
    new = _Group()
    return [new] if id(new) == address else []


def test_a_new_group_at_a_freed_groups_address_is_worked_out_again() -> None:
    found = _same_id_after_free()
    if not found:
        pytest.skip("the interpreter gave no new object the freed group's address")
    new_info = groups.GroupInfo(3, 1, "gloo")
    known = planner._on_device(found[0], torch.ones(2), new_info)
    assert known is not None and known.info is new_info  # not the freed group's world of 2


def test_what_a_group_takes_is_kept_per_device_type_and_emptied_by_configure() -> None:
    group = _Group()
    info = groups.GroupInfo(2, 0, "cpu:gloo,cuda:nccl", "legacy")
    on_cpu = planner._on_device(group, torch.ones(2), info)
    on_meta = planner._on_device(group, torch.ones(2, device="meta"), info)
    assert on_cpu is not None and on_meta is not None
    assert on_cpu.limit == 2 * (2 << 20) and on_cpu.synchronous is not None  # gloo's threshold and broadcasts
    assert on_meta.limit == 0 and on_meta.synchronous is None  # no backend for meta tensors: never below, no route
    assert planner._on_device(group, torch.ones(3), None) is on_cpu  # kept: found without the description
    planner.configure(config.Settings(gloo_min_bytes=0))
    assert planner._on_device(group, torch.ones(2), None) is None  # emptied; the group is not described here
    assert planner._on_device(group, torch.ones(2), info).limit == 0  # worked out again, under the new setting
