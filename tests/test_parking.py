"""Parking: a rebind of plain CPU slots releases each by pointing it at an empty tensor of its dtype.

``slot.data = park`` drops the slot's storage as ``set_()`` does but is no in-place operation, so
the slot's version counter stays; the one ``set_`` into the buffer then steps it once, as torch's
one copy into each slot does. Checked here: the slots as ``slots.rebind`` leaves them, parked or
not; which slots are parked; and on the fake backend, a loop's calls (taken from the wrapper
straight to the writer, ``core.rewire_kept``) against torch's: version counters, grad, layout.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any, Callable, List

import pytest
import torch

from memgather import compat
from memgather.engine import slots
from tests.conftest import run_on_fake

needs_rebind = pytest.mark.skipif(not compat.can_prove_exclusive(), reason="no storage use count: no rebind")
needs_keys = pytest.mark.skipif(slots.PARKING_KEYS is None, reason="this torch does not park (slots.PARKING_KEYS)")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.complex64]
SHAPES = [(4,), (2, 3), (), (2, 3, 1, 1)]


def _fresh(shape: Any, dtype: torch.dtype) -> List[torch.Tensor]:
    like = torch.ones(shape, dtype=dtype)
    if len(shape) == 4:
        like = like.contiguous(memory_format=torch.channels_last)  # a stride of its own on the dims of size 1
    return [torch.empty_like(like) for _ in range(3)]


def _sharing_a_counter(shape: Any, dtype: torch.dtype) -> List[torch.Tensor]:
    """Three slots that each hold their storage alone; the first two share one version counter."""
    first = torch.ones(shape, dtype=dtype)
    second = first.view(shape)
    second.set_(torch.ones(shape, dtype=dtype).untyped_storage(), 0, first.shape, first.stride())
    return [first, second, torch.ones(shape, dtype=dtype)]


def _seen(tensor_list: List[torch.Tensor]) -> List[Any]:
    return [
        (s._version, s.shape, s.stride(), s.dtype, s.storage_offset(), compat.dispatch_keys(s), s.requires_grad)
        for s in tensor_list
    ]


@needs_keys
@pytest.mark.parametrize("make", [_fresh, _sharing_a_counter], ids=["fresh", "sharing_a_counter"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_parked_rebind_leaves_the_slots_as_a_released_one_set_back(
    make: Callable[[Any, torch.dtype], List[torch.Tensor]], shape: Any, dtype: torch.dtype
) -> None:
    """Parked, the slots end as a rebind by ``set_()`` whose counters ``mark_written`` set back leaves
    them: one step per slot (a counter two slots share, two), the same layout, keys and views."""
    parked, released = make(shape, dtype), make(shape, dtype)
    assert slots.parkable(parked)
    before = slots.versions(released)
    assert slots.versions(parked) == before
    flat_parked = slots.rebind(parked, parked=True)
    flat_released = slots.rebind(released)
    slots.mark_written(released, before)
    assert _seen(parked) == _seen(released)
    steps = [2, 2, 1] if make is _sharing_a_counter else [1, 1, 1]
    assert [s._version for s in parked] == [version + step for version, step in zip(before, steps)]
    assert all(s.untyped_storage().data_ptr() == flat_parked.untyped_storage().data_ptr() for s in parked)
    assert flat_parked.shape == flat_released.shape
    assert all(p.numel() == 0 for p in slots._parks.values() if p is not None)  # a park is never given memory


@needs_keys
@pytest.mark.parametrize("parked", [True, False], ids=["parked", "released"])
def test_a_rebind_that_fails_after_the_release_gives_every_slot_memory_of_its_own(
    monkeypatch: pytest.MonkeyPatch, parked: bool
) -> None:
    """Anything that fails between the release and the last set_ (here the huge-page advice): no slot
    is left released or parked on the park, each has fresh memory of its shape, and the error is raised."""

    def failing(flat: torch.Tensor) -> None:
        raise RuntimeError("advice failed")

    monkeypatch.setattr(slots.pages, "MIN_BYTES", 0)
    monkeypatch.setattr(slots.pages, "advise", failing)
    tensor_list = [torch.ones(2, 3, 1, 1).contiguous(memory_format=torch.channels_last) for _ in range(3)]
    strides = [s.stride() for s in tensor_list]
    assert slots.parkable(tensor_list)  # as the plan asks before a parked rebind: it makes the park
    with pytest.raises(RuntimeError, match="advice failed"):
        slots.rebind(tensor_list, parked=parked)
    assert [s.stride() for s in tensor_list] == strides
    assert all(s.shape == (2, 3, 1, 1) and s.untyped_storage().nbytes() == 6 * 4 for s in tensor_list)
    assert len({s.untyped_storage().data_ptr() for s in tensor_list}) == 3
    park = slots.parking(torch.float32)
    assert park is not None and park.untyped_storage().nbytes() == 0


@needs_keys
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # forward_ad's import
@pytest.mark.parametrize("parked", [True, False], ids=["parked", "released"])
def test_a_slot_that_refuses_set_leaves_no_other_slot_without_memory(parked: bool) -> None:
    """In a forward-AD dual level, a slot that carries a tangent refuses set_ (the plan sends such calls
    to torch; here rebind is called straight): every slot, that one too, gets memory of its own back."""
    import torch.autograd.forward_ad as forward_ad

    with forward_ad.dual_level():
        carrying = torch.zeros(4)
        carrying.copy_(forward_ad.make_dual(torch.zeros(4), torch.ones(4)))
        tensor_list = [torch.zeros(4), carrying, torch.zeros(4)]
        assert slots.parkable(tensor_list)  # (as the plan asks: the park of their dtype made)
        with pytest.raises(NotImplementedError):
            slots.rebind(tensor_list, parked=parked)
    assert all(s.shape == (4,) and s.untyped_storage().nbytes() == 16 for s in tensor_list)
    assert len({s.untyped_storage().data_ptr() for s in tensor_list}) == 3


@needs_keys
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_park_cannot_grow_or_be_written(dtype: torch.dtype) -> None:
    """Every slot parked, in any call, shares its park's storage while it is parked: code that runs
    then (a finalizer, a tracer) and reaches a parked slot finds 0 bytes that refuse to grow."""
    park = slots.parking(dtype)
    assert park is not None
    parked = torch.ones(4, dtype=dtype)
    parked.data = park
    with pytest.raises(RuntimeError, match="not resizable"):
        parked.resize_(1 << 20)
    with pytest.raises(RuntimeError, match="not resizable"):
        parked.untyped_storage().resize_(1 << 20)
    assert park.untyped_storage().nbytes() == 0 and park.shape == (0,)


@needs_keys
def test_only_plain_cpu_slots_are_parked() -> None:
    plain = [torch.empty(4), torch.empty(4)]
    assert slots.parkable(plain)
    with torch.inference_mode():
        inference = [torch.empty(4), torch.empty(4)]
    assert not slots.parkable(inference)  # .data = would give them a plain tensor's keys
    assert not slots.parkable([torch.empty(4), torch.randn(4)._neg_view()])
    assert not slots.parkable([torch.empty(4), torch.empty(4, device="meta")])
    assert not slots.parkable([torch.empty(4), torch.empty(4).to_sparse()])
    assert not slots.parkable([])


def test_where_torch_does_not_park_as_probed_nothing_is_parked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots, "PARKING_KEYS", None)
    assert not slots.parkable([torch.empty(4), torch.empty(4)])
    monkeypatch.setattr(torch.Tensor, "data", property(lambda t: t.detach(), lambda t, new: t.set_()))
    assert slots._parking_keys() is None  # a .data = that steps the counter, as set_() does, fails the probe


_TRANSFORMS = """
import json
from dataclasses import replace
exec(compile('import torch.distributed as dist\\ndef site(slots, t):\\n    dist.all_gather(slots, t)\\n',
             '<user>', 'exec'), user)
t = torch.arange(4.0)
def run():
    seen, made = [], []
    def gathering(x):
        got = made.pop()  # plain slots, made outside the transform: the kept plan's check must refuse it
        user["site"](got, t)
        seen.append([[s._version, list(s.shape), s.requires_grad] for s in got])
        return (x * 2).sum()
    for _ in range(2):  # outside any transform: the second call takes the plan the first kept
        made.append([torch.empty_like(t), torch.empty_like(t)])
        gathering(torch.ones(3))
    for transform in (torch.func.grad, torch.func.vmap):
        made.append([torch.empty_like(t), torch.empty_like(t)])
        try:
            transform(gathering)(torch.ones(3))
            seen.append("returned")
        except Exception as error:
            seen.append(["raised", type(error).__name__])
    for _ in range(2):  # kept anew (the transforms' calls kept none)
        made.append([torch.empty_like(t), torch.empty_like(t)])
        gathering(torch.ones(3))
    import torch.autograd.forward_ad as forward_ad
    with forward_ad.dual_level():  # a slot that carries a tangent: forward AD refuses set_ on it
        carrying = torch.empty_like(t)
        carrying.copy_(forward_ad.make_dual(torch.zeros(4), torch.ones(4)))
        made.append([carrying, torch.empty_like(t)])
        try:
            gathering(torch.ones(3))
        except Exception as error:
            seen.append(["raised", type(error).__name__])
    return seen
want = run()
memgather.patch(["user_code"])
core.configure(replace(core.settings(), nccl_min_bytes=0))
memgather.reset_stats()
got = run()
print(json.dumps([want, got, dict(memgather.stats().by_strategy), dict(memgather.stats().fallbacks)]))
"""


@needs_rebind
@needs_keys
def test_under_a_torch_func_transform_or_in_a_dual_level_the_call_is_torchs() -> None:
    """Under ``torch.func.grad`` or ``vmap`` (plain tensors captured from outside), memgather's in-place
    layout is no operation of the transformed program; in a forward-AD dual level a slot may carry a
    tangent, which forward AD refuses set_ on: the call goes to torch, kept plan or not."""
    want, got, strategies, fallbacks = json.loads(run_on_fake(textwrap.dedent(_TRANSFORMS)).splitlines()[-1])
    assert got == want
    assert fallbacks["functorch"] >= 2 and fallbacks["forward_ad"] == 1, fallbacks
    assert strategies == {"rebind": 4, "fallback": fallbacks["functorch"] + 1}, (strategies, fallbacks)


# One call site, gathering in a loop: each case's calls after its first take the plan kept on it.
_LOOP = """
import json, sys
from dataclasses import replace
from memgather.engine import core
handled = [0]  # calls that reached core.handle, rather than the writer straight from the wrapper
real = core.handle
def counting(*args, **kwargs):
    handled[0] += 1
    return real(*args, **kwargs)
core.handle = counting
exec(compile('import torch.distributed as dist\\ndef site(slots, t):\\n    dist.all_gather(slots, t)\\n',
             '<user>', 'exec'), user)
def sharing(t):
    first = torch.empty_like(t)
    second = first.detach()  # (a view would hold its base: the first slot would not be held by Python alone)
    second.set_(torch.empty_like(t).untyped_storage(), 0, t.shape, t.stride())
    return [first, second]
def fresh(t):
    return [torch.empty_like(t), torch.empty_like(t)]
CASES = {
    "fresh": (lambda: torch.ones(256), fresh, None),
    "float64": (lambda: torch.ones(256, dtype=torch.float64), fresh, None),
    "bool": (lambda: torch.ones(256, dtype=torch.bool), fresh, None),
    "scalar": (lambda: torch.tensor(3.0), fresh, None),
    "channels_last": (lambda: torch.ones(2, 3, 1, 1).contiguous(memory_format=torch.channels_last), fresh, None),
    "sharing_a_counter": (lambda: torch.ones(256), sharing, None),
    "input_requires_grad": (lambda: torch.ones(256, requires_grad=True), fresh, None),
    "no_grad": (lambda: torch.ones(256, requires_grad=True), fresh, torch.no_grad),
    "inference_mode_plain_slots": (lambda: torch.ones(256), fresh, torch.inference_mode),
    "inference_slots": (None, fresh, torch.inference_mode),
}
def observe(name):
    make_input, make_slots, block = CASES[name]
    seen = []
    for _ in range(3):
        if make_input is None:  # everything made in the block: inference tensors
            with block():
                t = torch.ones(256)
                got = make_slots(t)
                user["site"](got, t)
        else:
            t = make_input()
            got = make_slots(t)
            with block() if block is not None else torch.enable_grad():
                user["site"](got, t)
        seen.append([[s._version if not s.is_inference() else None, s.requires_grad, s.grad_fn is None,
                      list(s.shape), list(s.stride()), s.is_inference()] for s in got]
                    + [[t._version if not t.is_inference() else None, t.grad_fn is None]])
    return seen
names = sys.argv[1:] or list(CASES)
want = {name: observe(name) for name in CASES}
memgather.patch(["user_code"])
core.configure(replace(core.settings(), nccl_min_bytes=0))
got = {}
for name in CASES:
    handled[0] = 0
    memgather.reset_stats()
    got[name] = [observe(name), handled[0], dict(memgather.stats().by_strategy)]
print(json.dumps({"want": want, "got": got}))
"""


@needs_rebind
@needs_keys
def test_a_loops_kept_calls_leave_what_torchs_calls_leave() -> None:
    result = json.loads(run_on_fake(textwrap.dedent(_LOOP)).splitlines()[-1])
    for name, (seen, handled, strategies) in result["got"].items():
        want = result["want"][name]
        if name == "input_requires_grad" and want[0][0][1]:
            # Where the fake backend fills each slot with copy_ under autograd (torch 2.11's
            # does), torch's slots require grad there; a real backend writes them from C++,
            # which autograd never sees. memgather's must be what a real backend leaves.
            want = [[[*slot[:1], False, True, *slot[3:]] for slot in call[:-1]] + call[-1:] for call in want]
        assert seen == want, name
        assert strategies == {"rebind": 3}, (name, strategies)
        assert handled == _HANDLED.get(name, 1), (name, handled)


# Calls of each case that reached core.handle. Its first call is planned in full where the case
# changes a fact the plan kept by the case before rests on; the next two take the kept plan straight
# from the wrapper. An input that requires grad changes none (autograd is switched off around the
# writer); inference tensors are not parked, and their kept plan is taken through core.handle.
_HANDLED = {"input_requires_grad": 0, "no_grad": 0, "inference_slots": 3}
