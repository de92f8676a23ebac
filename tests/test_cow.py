"""memgather.cow: torch's copy-on-write clone, as probed at import, and what an elided cat's snapshot does.

The probe's rules are each held by a stand-in ``_lazy_clone`` that breaks one of them.
The release tests (tests/test_releases.py) run the probe on every torch in the matrix.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from memgather import cow

# torch releases whose lazy clone passes the probe, as measured (tests/test_releases.py runs it on each
# release): here the probe must pass, so that a fault of the probe cannot quietly skip these tests.
PASSES_THE_PROBE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)
needs_cow = pytest.mark.skipif(
    not (cow.works() or PASSES_THE_PROBE), reason=f"no copy-on-write here: {cow.why_not()}"
)


@needs_cow
def test_a_snapshot_is_a_fresh_tensor_sharing_memory_until_either_side_is_written() -> None:
    buffer = torch.arange(12, dtype=torch.float64)
    slots = list(buffer.view(3, 4).unbind(0))
    snapshot = cow.snapshot(buffer)
    assert snapshot._base is None and snapshot._version == 0 and snapshot.grad_fn is None
    assert torch._C._is_cow_tensor(snapshot) and torch._C._is_cow_tensor(slots[1])
    slots[1].mul_(-1)  # the slots' side copies; the snapshot keeps what the buffer held
    assert snapshot.tolist() == list(map(float, range(12)))
    snapshot.add_(100)  # and the other way round
    assert buffer[:4].tolist() == [0.0, 1.0, 2.0, 3.0]


@needs_cow
def test_it_serves_cpu_tensors_only() -> None:
    assert cow.serves(torch.empty(2))
    assert not cow.serves(torch.empty(2, device="meta"))


def _probe_with(monkeypatch: Any, clone: Callable[[torch.Tensor], torch.Tensor]) -> str:
    monkeypatch.setattr(cow, "_lazy_clone", clone)
    return cow._probed()


@needs_cow
@pytest.mark.parametrize(
    "name,clone,why",
    [
        ("a real copy", lambda t: t.clone(), "torch._lazy_clone did not make a copy-on-write pair"),
        ("a view", lambda t: torch._lazy_clone(t).view(t.shape),
         "torch._lazy_clone's result is not a fresh tensor of the source's shape"),
        ("a written result", lambda t: torch._lazy_clone(t).add_(0), "torch._lazy_clone did not make a copy-on-write pair"),
        ("other values", lambda t: torch._lazy_clone(t + 1), "torch._lazy_clone did not make a copy-on-write pair"),
        ("a missing function", None, "this torch has no torch._lazy_clone"),
        ("a raising function", lambda t: (_ for _ in ()).throw(RuntimeError("boom")), "the probe failed: RuntimeError: boom"),
    ],
)
def test_the_probe_refuses_a_clone_that_breaks_a_rule(monkeypatch: Any, name: str, clone: Any, why: str) -> None:
    assert _probe_with(monkeypatch, clone) == why, name


def _in_turn(*clones: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A stand-in whose n-th call is ``clones[n]``'s (the last one's from then on)."""
    calls = iter(clones)
    last = [clones[-1]]

    def clone(tensor: torch.Tensor) -> torch.Tensor:
        last[0] = next(calls, last[0])
        return last[0](tensor)

    return clone


_KEPT: list = []


def _keeping_a_twin(tensor: torch.Tensor) -> torch.Tensor:
    """A lazy clone with a twin that outlives the probe's references: its first write must copy."""
    clone = torch._lazy_clone(tensor)
    _KEPT.append(torch._lazy_clone(clone))
    return clone


@needs_cow
@pytest.mark.parametrize(
    "name,clone,why",
    [
        ("values of its own", lambda t: t + 1, "torch._lazy_clone's result differs from its source"),
        ("a second clone sharing its source", _in_turn(torch._lazy_clone, lambda t: _sharing(t)),
         "a write into the clone reached the source"),
        ("a third clone sharing its source's pointer", _in_turn(torch._lazy_clone, torch._lazy_clone, lambda t: _sharing(t)),
         "data_ptr() of a clone whose source lives shares the source's memory"),
        ("another side that lives on", _keeping_a_twin, "a clone whose source is gone copied on its first write"),
    ],
)
def test_the_probe_refuses_a_clone_that_breaks_a_later_rule(monkeypatch: Any, name: str, clone: Any, why: str) -> None:
    """Each later rule by a stand-in that keeps the rules before it (``_is_cow`` as torch's)."""
    if name == "values of its own":
        monkeypatch.setattr(cow, "_is_cow", lambda tensor: True)  # as if it were copy-on-write
    try:
        assert _probe_with(monkeypatch, clone) == why, name
    finally:
        _KEPT.clear()


def test_the_probe_passes_the_releases_known_to_pass() -> None:
    """torch 2.12 and later: the probe passes (a fault in it must not pass for a torch without copy-on-write)."""
    assert cow.works() is PASSES_THE_PROBE, cow.why_not()


def _sharing(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of its own over ``tensor``'s memory: what a clone that copies nothing on write would give."""
    shared = torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage(), 0, tensor.shape)
    torch._C._autograd._unsafe_set_version_counter((shared,), (0,))  # as new (set_ counted a write)
    return shared


@needs_cow
def test_the_probe_refuses_a_clone_whose_writes_reach_the_other_side(monkeypatch: Any) -> None:
    monkeypatch.setattr(cow, "_is_cow", lambda tensor: True)  # as if it were copy-on-write
    assert _probe_with(monkeypatch, _sharing) == "a write into the source reached the clone"


@needs_cow
def test_the_probe_passes_this_torch_and_runs_outside_modes() -> None:
    from torch.overrides import TorchFunctionMode

    class Refusing(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            raise AssertionError(f"the probe was seen by a mode: {func}")

    with Refusing(), torch.inference_mode():
        assert cow._probed() == ""


def test_the_growth_probe_says_what_this_torch_does() -> None:
    """torch 2.12 and 2.13 cannot write a copy-on-write storage grown before any write: the probe
    says so, and what it says is what torch does."""
    if not cow.works():
        assert not cow.grows()
        return
    clone = torch._lazy_clone(torch.zeros(4))
    clone.resize_(8)
    try:
        clone.fill_(1)
        grew = True
    except RuntimeError as error:
        assert "ctx != nullptr" in str(error)
        grew = False
    assert cow.grows() is grew


def test_importing_does_not_probe_growth() -> None:
    """The growth probe trips torch's own assertion on 2.12 and 2.13 (slow to report under
    TORCH_SHOW_CPP_STACKTRACES=1): it runs when first asked, never at import."""
    import subprocess
    import sys

    code = "import memgather.cow as c; assert c._GROWS is None; c.grows(); assert c._GROWS is not None; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
