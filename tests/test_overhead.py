"""The small-call fast path and ``benchmarks/overhead.py``, on torch's no-op fake backend.

The fake backend is given legacy NCCL's route and threshold (``run_on_fake`` applies
``benchmarks.overhead.treat_fake_as_legacy_nccl``; memgather has none for it): a call under the NCCL
threshold goes to torch from the wrapper, without ``core.handle`` (the full path); from the
threshold on it is rewired. Each case runs in a process of its own, since the
fake group is this process's default group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_on_fake


def test_a_small_call_on_a_known_group_is_settled_by_the_first_lines_of_the_plan() -> None:
    out = run_on_fake("""
        memgather.patch(["user_code"])
        user["call"](64 << 10)  # a group not seen before: the full path, which describes it
        from memgather.engine import planner
        def refuse(*args, **kwargs):
            raise AssertionError("planned in full")
        full_path, planner._plan = planner._plan, refuse
        user["call"](64 << 10)  # 64 KiB per rank: under the 1 MiB threshold, settled by plan()'s first lines
        planner._plan = full_path
        user["call"](1 << 20)  # at the threshold: rewired
        print(dict(memgather.stats().by_strategy), dict(memgather.stats().fallbacks))
    """, {"MEMGATHER_NCCL_MIN_BYTES": str(1 << 20)})
    assert out.strip() == "{'fallback': 2, 'rebind': 1} {'below_threshold': 2}"


def test_the_default_nccl_threshold_keeps_a_64_mib_call_of_two_ranks_with_torch() -> None:
    """The fake backend, given legacy NCCL's threshold: 72 MiB per rank at 2 ranks (memgather.engine.routes)."""
    out = run_on_fake("""
        memgather.patch(["user_code"])
        user["call"](64 << 20)
        print(dict(memgather.stats().fallbacks))
    """, {})
    assert out.strip() == "{'below_threshold': 1}"


@pytest.mark.parametrize("setting,expected", [("0", "{'rebind': 1} {}"), (str(2 << 20), "{'fallback': 1} "
                                                                             "{'below_threshold': 1}")])
def test_the_nccl_threshold_setting_moves_it(setting: str, expected: str) -> None:
    out = run_on_fake("""
        memgather.patch(["user_code"])
        user["call"](1 << 20)
        print(dict(memgather.stats().by_strategy), dict(memgather.stats().fallbacks))
    """, {"MEMGATHER_NCCL_MIN_BYTES": setting})
    assert out.strip() == expected


def test_a_threshold_changed_by_a_later_patch_reaches_the_fast_path() -> None:
    """The threshold a group's calls were found under is kept (group_facts) until the next patch()."""
    out = run_on_fake("""
        import os
        os.environ["MEMGATHER_NCCL_MIN_BYTES"] = str(2 << 20)
        memgather.patch(["user_code"])
        for _ in range(2):
            user["call"](1 << 20)  # the group described, then the fast path: under 2 MiB per rank
        os.environ["MEMGATHER_NCCL_MIN_BYTES"] = "0"
        memgather.patch(["user_code"])
        user["call"](1 << 20)  # the same group and device: rewired now
        os.environ["MEMGATHER_NCCL_MIN_BYTES"] = str(2 << 20)
        memgather.unpatch()  # direct calls: back on the settings from before the first patch()
        memgather.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4))
        print(dict(memgather.stats().by_strategy), dict(memgather.stats().fallbacks))
    """, {})
    assert out.strip() == "{'fallback': 3, 'rebind': 1} {'below_threshold': 3}"


def test_a_new_default_group_of_another_size_is_not_taken_for_the_old_one() -> None:
    """What the old group's calls took (its world of 2) must not decide for a world of 3."""
    out = run_on_fake("""
        memgather.patch(["user_code"])
        user["call"](64 << 10)
        user["call"](64 << 10)  # fast path: below the threshold, two slots for a world of 2
        dist.destroy_process_group()  # the old group may be freed, and the new one take its id
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
        user["call"](64 << 10)  # two slots: wrong for 3 (the fake backend does not mind)
        print(dict(memgather.stats().fallbacks))
    """, {})
    assert out.strip() == "{'below_threshold': 2, 'wrong_length': 1}", out


def test_a_call_with_check_on_takes_the_full_path() -> None:
    out = run_on_fake("""
        memgather.patch(["user_code"], check=True)
        reached = []
        full_path = core.handle
        core.handle = lambda *args, **kwargs: reached.append(1) or full_path(*args, **kwargs)
        user["call"](64 << 10)
        print(len(reached))
    """, {})
    assert out.strip() == "1"


def test_small_gather_takes_the_single_call() -> None:
    out = run_on_fake("""
        out = memgather.gather(torch.ones(8))
        stats = memgather.stats()
        print(tuple(out.shape), dict(stats.by_strategy), dict(stats.by_route), stats.calls, stats.rewired)
    """, {})
    assert out.strip() == "(16,) {'into_result': 1} {'single_staged': 1} 1 0"  # gather's own call: not a rewire


def test_small_gather_inside_coalescing_is_left_to_torch() -> None:
    out = run_on_fake("""
        from torch.distributed.distributed_c10d import _coalescing_manager
        with _coalescing_manager(device=torch.device("cpu")):
            memgather.gather(torch.ones(8))
        print(dict(memgather.stats().by_strategy))
    """, {})
    assert out.strip() == "{'fallback': 1}"  # torch's list call, queued as torch queues it (not the single call)


def test_small_cpu_calls_on_a_per_device_gloo_group_take_the_fast_path(tmp_path: Path) -> None:
    """A group made with "cpu:gloo" (or torch's default "cpu:gloo,cuda:nccl"): gloo for CPU tensors."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import torch, torch.distributed as dist
        dist.init_process_group("cpu:gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        import memgather
        from memgather.engine import planner
        exec(compile('import torch, torch.distributed as dist\\n'
                     'def call(t): dist.all_gather([torch.empty_like(t)], t)\\n', '<user>', 'exec'),
             user := {{'__name__': 'user_code'}})
        memgather.patch(["user_code"])
        user["call"](torch.ones(8))  # describes the group
        def refuse(*args, **kwargs):
            raise AssertionError("planned in full")
        planner._plan = refuse
        user["call"](torch.ones(8))
        print(dict(memgather.stats().fallbacks))
        dist.destroy_process_group()
    """)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'below_threshold': 2}"


def test_bench_overhead_times_each_variant_as_named() -> None:
    out = run_on_fake("""
        from benchmarks import overhead
        results = overhead.measure(calls=50, rounds=1)  # raises where a variant was or was not rewired against its name
        memgather.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4))
        assert dict(memgather.stats().fallbacks) == {"below_threshold": 1}, "measure() left its threshold behind"
        print(sorted(results))
        print(overhead.table(results).splitlines()[0])
    """, {})
    names, header = out.strip().splitlines()
    assert names == str(sorted([
        "torch", "bare wrapper", "non-target", "below threshold", "rewired (rebind)",
        "rewired (rebind), planned in full", "torch's calls of a rebind", "direct slots: torch", "direct slots: rewired", "direct slots: single call alone", "Function: torch",
        "Function: non-target", "Function: rewired"]))
    assert header.split() == ["variant", "us/call", "added", "vs", "torch"]


def test_the_benchmark_gives_the_fake_backend_legacy_nccls_route_in_its_block_only() -> None:
    """memgather has no route for a backend that moves nothing; fake_as_legacy_nccl gives it one, then takes it back."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.append({str(ROOT)!r})
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        import memgather
        from benchmarks.overhead import fake_as_legacy_nccl
        def gather():
            memgather.reset_stats()
            memgather.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4))
            return dict(memgather.stats().by_strategy), dict(memgather.stats().fallbacks)
        print(gather())
        with fake_as_legacy_nccl():
            print(gather())
        print(gather())
    """)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TORCH_DISTRIBUTED_DEBUG": "OFF", "MEMGATHER_NCCL_MIN_BYTES": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["({'fallback': 1}, {'backend': 1})", "({'rebind': 1}, {})",
                                        "({'fallback': 1}, {'backend': 1})"]
