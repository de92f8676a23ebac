"""patch() / unpatch(): scoping to target callers, symmetry, idempotence, threads."""

from __future__ import annotations

import inspect
import re
import sys
import threading
import types
from typing import Any, Iterator

import pytest
import torch.distributed as dist
import wrapt

import memgather
from memgather import patcher
from tests import jobs
from tests.conftest import EAGER, unwrap
from tests.ranks import scoped_calls
from tests.releases import requires_fake_backend

ORIGINAL = dist.distributed_c10d.all_gather
# all_gather_object gathers sizes, then bytes: through distributed_c10d.all_gather up to
# torch 2.13 (both rewired), through all_gather_single on 2.15 (nothing to rewire).
OBJECT_GATHERS = 2 if re.search(r"\ball_gather\(", inspect.getsource(dist.distributed_c10d.all_gather_object)) else 0


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("MEMGATHER", "MEMGATHER_TARGETS", "MEMGATHER_CHECK", "MEMGATHER_FORCE", "MEMGATHER_ELIDE", "MEMGATHER_VERIFY",
                 "MEMGATHER_REPORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    memgather.unpatch()
    assert dist.all_gather is ORIGINAL and dist.distributed_c10d.all_gather is ORIGINAL


def test_target_calls_are_rewired_and_others_are_not(pools: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(scoped_calls, ["tests.sites.target_caller", "tests.sites.from_import_caller"])):
        assert result["target"] == {"rewired": 1, "correct": True}
        assert result["other"] == {"rewired": 0, "correct": True}
        assert result["from_import"] == {"rewired": 1, "correct": True}
        assert result["objects"]["correct"] and result["objects"]["rewired"] == OBJECT_GATHERS
        assert result["disabled"] == {"calls": 0}
        assert result["after_unpatch"] == {"calls": 0}


def test_every_caller(pools: Any) -> None:
    for result in unwrap(pools(2, **EAGER).run(scoped_calls, ["*"])):
        assert result["target"]["rewired"] == result["other"]["rewired"] == 1


def test_patch_unpatch_restore_every_name() -> None:
    module = types.ModuleType("mg_test_target")
    module.all_gather = dist.all_gather  # what `from torch.distributed import all_gather` leaves
    sys.modules["mg_test_target"] = module
    try:
        assert memgather.patch(["mg_test_target"])
        assert isinstance(dist.all_gather, patcher.MemgatherWrapper)
        assert dist.distributed_c10d.all_gather is dist.all_gather is module.all_gather
        assert memgather.is_patched()
        assert memgather.unpatch()
        assert not memgather.is_patched()
        assert module.all_gather is ORIGINAL
        assert not memgather.unpatch()  # a second unpatch is a no-op
    finally:
        del sys.modules["mg_test_target"]


def test_patch_is_idempotent() -> None:
    memgather.patch(["a.b"])
    first = dist.all_gather
    memgather.patch(["c"])
    assert dist.all_gather is first and first.__wrapped__ is ORIGINAL


def test_patch_exports_settings_and_unpatch_restores_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("MEMGATHER_CHECK", "0")
    memgather.patch(["accelerate", "mypkg"], check=True, verify=True)
    assert os.environ["MEMGATHER"] == "1"
    assert os.environ["MEMGATHER_TARGETS"] == "accelerate,mypkg"
    assert os.environ["MEMGATHER_CHECK"] == "1" and os.environ["MEMGATHER_VERIFY"] == "1"
    memgather.unpatch()
    assert "MEMGATHER" not in os.environ and os.environ["MEMGATHER_CHECK"] == "0"
    assert "MEMGATHER_VERIFY" not in os.environ


def test_kill_switch_makes_patch_a_no_op(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MEMGATHER", "0")
    with caplog.at_level("INFO", logger="memgather"):
        assert memgather.patch() is False
    assert dist.all_gather is ORIGINAL and not memgather.is_patched()
    assert "MEMGATHER=0" in caplog.text


def test_wrapper_above_ours_is_kept_and_ours_disabled(caplog: pytest.LogCaptureFixture) -> None:
    memgather.patch(["x"])
    ours = dist.all_gather
    outer = wrapt.FunctionWrapper(ours, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    dist.all_gather = outer
    try:
        with caplog.at_level("WARNING", logger="memgather"):
            memgather.unpatch()
        assert dist.all_gather is outer and not memgather.is_patched()
        assert "another wrapper sits above memgather's on torch.distributed.all_gather" in caplog.text
        memgather.patch(["x"])  # re-enables in place: no second layer of ours
        assert dist.all_gather is outer and outer.__wrapped__ is ours and memgather.is_patched()
    finally:
        memgather.unpatch()
        dist.all_gather = ORIGINAL
        patcher._installed.clear()
        patcher._wrapper = None


def test_patch_and_unpatch_from_eight_threads_end_consistent() -> None:
    barrier = threading.Barrier(8)

    def churn(index: int) -> None:
        barrier.wait()
        for _ in range(50):
            memgather.patch(["t%d" % index])
            memgather.unpatch()
        memgather.patch(["t%d" % index])

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert memgather.is_patched()
    assert isinstance(dist.all_gather, patcher.MemgatherWrapper) and dist.all_gather.__wrapped__ is ORIGINAL
    assert dist.distributed_c10d.all_gather is dist.all_gather
    memgather.unpatch()
    assert dist.all_gather is ORIGINAL and dist.distributed_c10d.all_gather is ORIGINAL
    assert patcher._installed == []


def test_targets_argument_must_be_a_list() -> None:
    with pytest.raises(TypeError, match="did you mean"):
        memgather.patch("accelerate")
    with pytest.raises(ValueError, match="'not a module!' is neither a built-in target"):
        memgather.patch(["not a module!"])
    assert not memgather.is_patched()


ELIDE_SCRIPT = '''
import json, sys, types, warnings
warnings.simplefilter("ignore")
site = sys.argv[1]
sys.path.insert(0, site)
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import memgather
from memgather.elision import ElidableSlot

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
CODE = "import torch, torch.distributed as dist\\ndef gather(t):\\n    s = [torch.empty_like(t) for _ in range(2)]\\n    dist.all_gather(s, t)\\n    return s\\n"

def site_module(name):
    module = types.ModuleType(name)
    exec(compile(CODE, name.replace(".", "/") + ".py", "exec"), module.__dict__)
    sys.modules[name] = module
    return module

audited, unaudited = site_module("transformers.mg_site"), site_module("mmengine.mg_site")
memgather.patch(elide=json.loads(sys.argv[2]))
print(json.dumps([type(m.gather(torch.ones(3))[0]) is ElidableSlot for m in (audited, unaudited)]))
'''


@requires_fake_backend
@pytest.mark.parametrize(
    "elide_argument,environment,expected",
    [("null", {}, [True, False]), ("null", {"MEMGATHER_ELIDE": "0"}, [False, False]),
     ("true", {}, [True, True]), ("null", {"MEMGATHER_ELIDE": "1"}, [True, True]), ("false", {}, [False, False])],
    ids=["audited-only", "env-off", "patch-on", "env-on", "patch-off"],
)
def test_elision_defaults_to_audited_targets(tmp_path: Any, elide_argument: str, environment: Any, expected: Any) -> None:
    """Built-in targets found through real distribution metadata: transformers is audited, mmengine is not."""
    import json
    import subprocess

    for name, version in (("transformers", "4.40.0"), ("mmengine", "0.10.0")):
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    done = subprocess.run([sys.executable, "-c", ELIDE_SCRIPT, str(tmp_path), elide_argument],
                          capture_output=True, text=True, env=jobs.environment(**environment), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected
