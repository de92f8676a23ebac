"""patch() / unpatch(): scoping to target callers, symmetry, idempotence, threads."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist
import wrapt

import memgather
from memgather import compat, cow
from memgather.patching import patcher
from tests.conftest import EAGER, unwrap
from tests.ranks import filled
from tests.sites.elision_settings import elided_sites

ORIGINAL = dist.distributed_c10d.all_gather
# all_gather_object from a target is memgather's own (memgather.engine.objects): one call, by parts.
OBJECT_GATHERS = 1


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


def test_what_a_patch_was_given_ends_with_the_next_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second patch() reads the environment as the user left it, not what the first one exported:
    arguments it leaves out fall back to the user's settings, and children see the second patch's."""
    import os
    import subprocess

    from memgather.engine import core

    monkeypatch.setenv("MEMGATHER_CHECK", "1")
    memgather.patch(["mypkg"], elide=True, force=True, verify=True, check=False)
    assert os.environ["MEMGATHER_ELIDE"] == "1" and os.environ["MEMGATHER_CHECK"] == "0"
    memgather.patch()
    settings = core.settings()
    assert (settings.elide, settings.force, settings.verify, settings.check) == (None, False, False, True)
    assert settings.targets == patcher.registry.select(None).names  # every built-in, not the first call's
    assert os.environ["MEMGATHER_ELIDE"] == "" and os.environ["MEMGATHER_CHECK"] == "1"
    child = subprocess.run(
        [sys.executable, "-c", "from memgather.engine import core; import memgather; s = core.settings();"
         " print(memgather.is_patched(), s.elide, s.force, s.check)"],
        capture_output=True, text=True, check=True, timeout=120,
    )
    assert child.stdout.split()[-4:] == ["True", "None", "False", "True"]
    memgather.unpatch()
    assert os.environ["MEMGATHER_CHECK"] == "1"
    assert all(name not in os.environ for name in ("MEMGATHER", "MEMGATHER_ELIDE", "MEMGATHER_FORCE"))


def test_a_patch_racing_another_does_not_take_its_export_for_the_users_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread's patch() exporting between this one's read of what was exported and its read of
    the environment: this one reads the environment again, under the lock."""
    from memgather import config
    from memgather.engine import core

    real_load, raced = config.load, []

    def load_after_another_patch(environ: Any = None) -> Any:
        if not raced:
            raced.append(True)
            memgather.patch(["mypkg"], elide=True)  # the other thread's, exporting MEMGATHER_ELIDE=1
        return real_load(environ)

    monkeypatch.setattr(config, "load", load_after_another_patch)
    memgather.patch(["mypkg"])
    assert raced and core.settings().elide is None


def test_a_setting_the_user_makes_while_patched_is_theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name the user sets after patch() is read by the next patch() and left alone by unpatch()."""
    import os

    from memgather.engine import core

    memgather.patch(["mypkg"], elide=True)
    os.environ["MEMGATHER_ELIDE"] = "0"
    memgather.patch(["mypkg"])
    assert core.settings().elide is False
    memgather.unpatch()
    assert os.environ["MEMGATHER_ELIDE"] == "0"
    del os.environ["MEMGATHER_ELIDE"]


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


# (patch(elide=...), MEMGATHER_ELIDE): the user's setting, where there is one, wins both ways.
SETTINGS = {"unset": (None, None), "patch-on": (True, None), "env-on": (None, "1"), "patch-off": (False, None),
            "env-off": (None, "0"), "patch-off-over-env-on": (False, "1")}


@pytest.mark.skipif(not compat.can_prove_exclusive(), reason="no storage use count: no rebind, nothing to elide")
@pytest.mark.parametrize("setting", SETTINGS)
def test_elision_defaults_to_what_the_call_site_proves(pools: Any, setting: str) -> None:
    """Unset, the code decides: MoCo's helper is elided; a function that reads a slot after scaling the
    cat's result in place is elided only where the result is copy-on-write, and gets torch's values
    either way. Forced on where the result is the buffer itself, that function sees the scaled values
    in its slot (the hazard the proof keeps it from); forced off, nothing is elided."""
    elide, env_elide = SETTINGS[setting]
    chosen = elide if elide is not None else (None if env_elide is None else env_elide == "1")
    for result in unwrap(pools(2, **EAGER).run(elided_sites, elide, env_elide)):
        assert result["moco"] == {"elided": int(chosen is not False), "torch_values": True}, result
        scaled = result["scale_then_read_slot"]
        assert scaled["elided"] == int(chosen is True or (chosen is None and cow.works())), result
        hazard = chosen is True and not cow.works()
        assert scaled["torch_values"] is not hazard and scaled["slot_scaled"] is hazard, result


def settings_after_patch(ctx: Any) -> dict:
    """What direct calls default to before patch(), under patch(check=True) with a new threshold, after unpatch()."""
    import os

    import torch

    from memgather.engine import core

    def small_call() -> dict:
        memgather.reset_stats()
        slots = [torch.empty(4) for _ in range(ctx.world)]
        memgather.all_gather(slots, torch.full((4,), float(ctx.rank)))
        assert all(torch.equal(s, torch.full((4,), float(r))) for r, s in enumerate(slots))
        return {"fallbacks": dict(memgather.stats().fallbacks), "rewired": memgather.stats().rewired}

    before = small_call()  # this pool's worker has no MEMGATHER_GLOO_MIN_BYTES: 16 bytes stay with torch
    os.environ["MEMGATHER_GLOO_MIN_BYTES"] = "0"
    memgather.patch(["tests.sites.target_caller"], check=True)
    try:
        during = small_call()
        during["check"] = core.settings().check
    finally:
        memgather.unpatch()
        del os.environ["MEMGATHER_GLOO_MIN_BYTES"]
        core.configure()
    after = small_call()
    return {"before": before, "during": during, "after_check": core.settings().check, "after": after}


def test_patch_applies_what_it_is_given_to_direct_calls(pools: Any) -> None:
    """Settings are not frozen at import: patch() re-reads them, and what it was given reaches direct calls."""
    for result in unwrap(pools(2).run(settings_after_patch)):
        assert result["before"] == {"fallbacks": {"below_threshold": 1}, "rewired": 0}, result
        assert result["during"] == {"fallbacks": {}, "rewired": 1, "check": True}, result
        assert result["after_check"] is False and result["after"]["rewired"] == 0, result


# Run on every rank of a pool (tests/pool.py): each takes the rank's context first and
# returns plain data for the test above to assert on.


def scoped_calls(ctx: Any, targets: List[str]) -> Dict[str, Any]:
    """Which callers memgather rewires under patch(targets)."""
    from tests.sites import from_import_caller, other_caller, target_caller

    result: Dict[str, Any] = {}
    memgather.patch(targets)
    try:
        for name, module in (("target", target_caller), ("other", other_caller), ("from_import", from_import_caller)):
            memgather.reset_stats()
            slots = module.gather(filled(ctx.rank))
            result[name] = {"rewired": memgather.stats().rewired,
                            "correct": all(torch.equal(s, filled(r)) for r, s in enumerate(slots))}
        memgather.reset_stats()
        objects = from_import_caller.gather_objects({"rank": ctx.rank})
        result["objects"] = {"rewired": memgather.stats().rewired, "correct": objects == [{"rank": r} for r in range(ctx.world)]}
        memgather.reset_stats()
        with memgather.disabled():
            target_caller.gather(filled(ctx.rank))
        result["disabled"] = {"calls": memgather.stats().calls}
    finally:
        memgather.unpatch()
    memgather.reset_stats()
    target_caller.gather(filled(ctx.rank))
    result["after_unpatch"] = {"calls": memgather.stats().calls}
    return result


def test_unpatch_puts_the_engine_back_on_its_settings_from_before_the_first_patch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """patch() hands the engine what it was given over the environment; unpatch() does not read the
    environment back (it still says what patch() exported, or what the caller set since)."""
    from memgather.engine import core

    before = core.settings()
    monkeypatch.setenv("MEMGATHER_GLOO_MIN_BYTES", "0")
    monkeypatch.setenv("MEMGATHER_CHECK", "1")
    memgather.patch(["mypkg"], verify=True)
    try:
        during = core.settings()
        memgather.patch(["mypkg"])  # a second patch() replaces the settings, not the ones to go back to
    finally:
        memgather.unpatch()
    assert (during.gloo_min_bytes, during.check, during.verify, during.targets) == (0, True, True, ("mypkg",))
    assert core.settings() is before
