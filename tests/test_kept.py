"""memgather.engine.kept: a call site's plan, kept for its next call.

A loop's calls take the plan its first call made, and every fact that plan rests on, changed
between two calls, sends the next call back to the full plan, with torch's outcome. The rank
bodies run one call site (``_site``) under torch alone and under memgather, step by step,
and count the full plans (``planner._plan``) each memgather call made.
"""

from __future__ import annotations

import contextlib
import textwrap
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import memgather
from memgather import compat
from memgather.engine import core, planner, strategies
from memgather.engine.reasons import Strategy
from tests.conftest import EAGER, run_on_fake, unwrap
from tests.ranks import as_bytes, group_for

NUMEL = 6

Built = Tuple[List[Any], torch.Tensor, Dict[str, Any], Any]  # slots, input, the call's keywords, what is kept alive


def _filled(rank: int, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(int(torch.Size(shape).numel())) + 100 * rank).reshape(shape).to(dtype)


def _fresh(rank: int, world: int, dtype: torch.dtype = torch.float32, shape: Tuple[int, ...] = (NUMEL,)) -> Built:
    return [torch.zeros(shape, dtype=dtype) for _ in range(world)], _filled(rank, shape, dtype), {}, None


def _slots_of(dtype: torch.dtype, shape: Tuple[int, ...]) -> Callable[[int, int], Built]:
    def build(rank: int, world: int) -> Built:
        slots, given_tensor, kwargs, _ = _fresh(rank, world)
        return [torch.zeros(shape, dtype=dtype) for _ in range(world)], given_tensor, kwargs, None

    return build


def _one_slot(change: Callable[[List[torch.Tensor]], Any]) -> Callable[[int, int], Built]:
    def build(rank: int, world: int) -> Built:
        slots, given_tensor, kwargs, _ = _fresh(rank, world)
        return slots, given_tensor, kwargs, change(slots)

    return build


def _same_twice(rank: int, world: int) -> Built:
    slot = torch.zeros(NUMEL)
    return [slot] * world, _filled(rank, (NUMEL,)), {}, None


def _input_is_a_slot(rank: int, world: int) -> Built:
    slots, given_tensor, kwargs, _ = _fresh(rank, world)
    slots[rank] = given_tensor
    return slots, given_tensor, kwargs, None


def _adjacent(rank: int, world: int) -> Built:
    return list(torch.zeros(world * NUMEL).chunk(world)), _filled(rank, (NUMEL,)), {}, None


# DeepSpeed's pattern: the slots are views, in rank order, of one buffer kept across calls.
_BUFFERS: Dict[str, torch.Tensor] = {}


def _chunks(order: str, input_in: Optional[str] = None) -> Callable[[int, int], Built]:
    def build(rank: int, world: int) -> Built:
        buffer = _BUFFERS.setdefault(order, torch.zeros((world + 1) * NUMEL))
        slots = [buffer[i * NUMEL : (i + 1) * NUMEL] for i in range(world)]
        if order == "reversed":
            slots.reverse()
        elif order == "gap":
            slots[-1] = buffer[world * NUMEL :]
        given_tensor = _filled(rank, (NUMEL,))
        if input_in == "own":  # the input is its own rank's slot: allowed
            slots[rank].copy_(given_tensor)
            given_tensor = slots[rank]
        elif input_in == "other":  # the input is another rank's slot: torch's copies decide
            given_tensor = slots[(rank + 1) % world]
            given_tensor.copy_(_filled(rank, (NUMEL,)))
        return slots, given_tensor, {}, None

    return build


def _strided(rank: int, world: int) -> Built:
    slots, given_tensor, kwargs, _ = _fresh(rank, world)
    slots[0] = torch.zeros(2 * NUMEL)[::2]
    return slots, given_tensor, kwargs, None


def _conj_input(rank: int, world: int) -> Built:
    slots, given_tensor, kwargs, _ = _fresh(rank, world, torch.complex64)
    return slots, given_tensor.conj(), kwargs, None


def _in_group(rank: int, world: int) -> Built:
    slots, given_tensor, _, _ = _fresh(rank, world)
    return slots, given_tensor, {"group": group_for(tuple(range(world)))}, None


def _async(rank: int, world: int) -> Built:
    slots, given_tensor, _, _ = _fresh(rank, world)
    return slots, given_tensor, {"async_op": True}, None


def _inference(rank: int, world: int) -> Built:
    with torch.inference_mode():
        return _fresh(rank, world)


def _inference_slots(rank: int, world: int) -> Built:
    """Slots and input made in inference mode, the call made outside it (torch refuses to write them there)."""
    with torch.inference_mode():
        return _fresh(rank, world)


def _input_shape(rank: int, world: int) -> Built:
    slots, _, kwargs, _ = _fresh(rank, world)
    return slots, _filled(rank, (NUMEL - 1,)), kwargs, None


def _inference_input(rank: int, world: int) -> Built:
    slots, _, kwargs, _ = _fresh(rank, world)
    with torch.inference_mode():
        given_tensor = _filled(rank, (NUMEL,))
    return slots, given_tensor, kwargs, None


def _neg_input(rank: int, world: int) -> Built:
    """A float32 input like the fresh calls', but for its negative bit (the imaginary part of a conjugate)."""
    slots, _, kwargs, _ = _fresh(rank, world)
    return slots, _filled(rank, (NUMEL,), torch.complex64).conj().imag, kwargs, None


class _PassFunctions(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _PassDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _configure_again() -> None:
    core.configure(replace(core.settings()))  # the same settings, configured anew: as any patch() does


def _patch_again() -> None:
    memgather.patch([__name__])


# name -> (build the call's arguments, the block it runs in, what runs just before it)
STEPS: Dict[str, Tuple[Callable[[int, int], Built], Callable[[], Any], Optional[Callable[[], None]]]] = {
    "fresh": (_fresh, contextlib.nullcontext, None),
    "shape": (lambda r, w: _fresh(r, w, shape=(3, 2)), contextlib.nullcontext, None),
    "dtype": (lambda r, w: _fresh(r, w, torch.float64), contextlib.nullcontext, None),
    "slot_dtype": (_slots_of(torch.float64, (NUMEL,)), contextlib.nullcontext, None),
    "slot_shape": (_slots_of(torch.float32, (NUMEL - 1,)), contextlib.nullcontext, None),
    "slot_requires_grad": (_one_slot(lambda slots: slots[1].requires_grad_()), contextlib.nullcontext, None),
    "view_kept": (_one_slot(lambda slots: slots[0][:2]), contextlib.nullcontext, None),
    "storage_held": (_one_slot(lambda slots: slots[1].untyped_storage()), contextlib.nullcontext, None),
    "exported_to_numpy": (_one_slot(lambda slots: slots[0].numpy()), contextlib.nullcontext, None),
    "same_slot_twice": (_same_twice, contextlib.nullcontext, None),
    "input_is_a_slot": (_input_is_a_slot, contextlib.nullcontext, None),
    "adjacent_slots": (_adjacent, contextlib.nullcontext, None),
    "strided_slot": (_strided, contextlib.nullcontext, None),
    "chunks": (_chunks("in_order"), contextlib.nullcontext, None),
    "chunks_reversed": (_chunks("reversed"), contextlib.nullcontext, None),
    "chunks_with_a_gap": (_chunks("gap"), contextlib.nullcontext, None),
    "chunks_input_is_its_slot": (_chunks("in_order", "own"), contextlib.nullcontext, None),
    "chunks_input_is_anothers_slot": (_chunks("in_order", "other"), contextlib.nullcontext, None),
    "conj_input": (_conj_input, contextlib.nullcontext, None),
    "input_shape": (_input_shape, contextlib.nullcontext, None),
    "neg_input": (_neg_input, contextlib.nullcontext, None),
    "inference_input": (_inference_input, contextlib.nullcontext, None),
    "inference_slots": (_inference_slots, contextlib.nullcontext, None),
    "group": (_in_group, contextlib.nullcontext, None),
    "async": (_async, contextlib.nullcontext, None),
    "inference": (_inference, torch.inference_mode, None),
    "function_mode": (_fresh, _PassFunctions, None),
    "dispatch_mode": (_fresh, _PassDispatch, None),
    "configured_again": (_fresh, contextlib.nullcontext, _configure_again),
    "patched_again": (_fresh, contextlib.nullcontext, _patch_again),
}
# The facts a kept plan rests on, each changed between two calls of one site.
CHANGES = sorted(set(STEPS) - {"fresh", "chunks"} - {name for name in STEPS if name.startswith("chunks_")})
# The same for a plan kept for slots that are views of one buffer (DIRECT).
DIRECT_CHANGES = sorted(
    {name for name in STEPS if name.startswith("chunks_")} | {"fresh", "view_kept", "dtype", "group", "inference"}
)
# Changes of what the call runs under, not of the call itself.
_SAME_CALL = frozenset(("configured_again", "patched_again"))


def _site(slots: List[Any], given_tensor: torch.Tensor, **kwargs: Any) -> None:
    """The one call site every step gathers from."""
    work = dist.all_gather(slots, given_tensor, **kwargs)
    if work is not None:
        work.wait()


def _observe(name: str, rank: int, world: int, patched: bool) -> Tuple[Any, ...]:
    build, block, before = STEPS[name]
    if before is not None and patched:
        before()
    slots, given_tensor, kwargs, kept = build(rank, world)
    with block():
        try:
            _site(slots, given_tensor, **kwargs)
        except Exception as error:  # noqa: BLE001 - the outcome is what is compared
            return ("raise", type(error).__name__, str(error))
    del kept
    return (
        "ok",
        [as_bytes(s) for s in slots],
        [None if s.is_inference() else s._version for s in slots],
        [s.requires_grad for s in slots],
    )


@contextlib.contextmanager
def _counting_full_plans() -> Iterator[List[int]]:
    counted = [0]
    full = planner._plan

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted[0] += 1
        return full(*args, **kwargs)

    planner._plan = counting  # type: ignore[assignment]  # counts, then plans as ever
    try:
        yield counted
    finally:
        planner._plan = full  # type: ignore[assignment]  # put back


def kept_steps(ctx: Any, names: List[str]) -> Dict[str, Any]:
    """Each step's outcome under torch, and under memgather with the full plans its call made."""
    _BUFFERS.clear()  # each run gathers into buffers of its own, their version counters from 0
    want = [_observe(name, ctx.rank, ctx.world, False) for name in names]
    _BUFFERS.clear()
    got: List[Tuple[Any, ...]] = []
    memgather.patch([__name__])
    try:
        with _counting_full_plans() as counted:
            for name in names:
                memgather.reset_stats()
                before = counted[0]
                outcome = _observe(name, ctx.rank, ctx.world, True)
                snapshot = memgather.stats()
                got.append((outcome, counted[0] - before, dict(snapshot.by_strategy), dict(snapshot.fallbacks)))
    finally:
        memgather.unpatch()
    return {"want": want, "got": got}


def _run(pools: Any, names: List[str]) -> List[Dict[str, Any]]:
    return unwrap(pools(2, **EAGER).run(kept_steps, names))


def test_a_loop_takes_the_plan_its_first_call_made(pools: Any) -> None:
    for rank, result in enumerate(_run(pools, ["fresh"] * 4 + ["async"] * 3)):
        outcomes = [entry[0] for entry in result["got"]]
        assert outcomes == result["want"], f"rank {rank}"
        assert [entry[1] for entry in result["got"]] == [1, 0, 0, 0, 1, 0, 0], f"rank {rank}: {result['got']}"
        # sync gloo calls fill fresh slots in place (broadcasts), async ones rebind (the single call)
        assert all(entry[2] == {"in_slots": 1} for entry in result["got"][:4]), result["got"]
        if compat.gloo_has_single_tensor():
            assert all(entry[2] == {"rebind": 1} for entry in result["got"][4:]), result["got"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_fact_changed_between_two_calls_gets_the_full_plan(pools: Any, change: str) -> None:
    names = ["fresh", "fresh", change, "fresh", "fresh"]
    for rank, result in enumerate(_run(pools, names)):
        got = result["got"]
        assert [entry[0] for entry in got] == result["want"], f"rank {rank}: {change}"
        full_plans = [entry[1] for entry in got]
        # The change is planned in full; so is the next call where its facts changed back (not where
        # only the settings were configured anew: the plan kept then is the fresh calls'); then kept again.
        # (A torch-function mode's call is planned in full more than once: as if the mode were not there.)
        back = 0 if change in _SAME_CALL else 1
        assert full_plans[2] >= 1, f"rank {rank}: {change}: {got}"
        assert full_plans[:2] + full_plans[3:] == [1, 0, back, 0], f"rank {rank}: {change}: {got}"


@pytest.mark.parametrize("change", DIRECT_CHANGES)
def test_a_fact_changed_between_two_direct_calls_gets_the_full_plan(pools: Any, change: str) -> None:
    names = ["chunks", "chunks", change, "chunks", "chunks"]
    for rank, result in enumerate(_run(pools, names)):
        got = result["got"]
        assert [entry[0] for entry in got] == result["want"], f"rank {rank}: {change}"
        assert got[0][2] == {"direct": 1} and got[1][2] == {"direct": 1}, got
        full_plans = [entry[1] for entry in got]
        if change == "chunks_input_is_its_slot":  # DIRECT allows it: the kept plan holds, and is taken
            assert full_plans == [1, 0, 0, 0, 0], f"rank {rank}: {got}"
            continue
        assert full_plans[2] >= 1, f"rank {rank}: {change}: {got}"
        assert full_plans[:2] + full_plans[3:] == [1, 0, 1, 0], f"rank {rank}: {change}: {got}"


def test_slots_kept_under_inference_mode_are_not_taken_for_a_call_outside_it(pools: Any) -> None:
    """Inference slots pass under inference mode; outside it, where their keys are the same, only the
    mode tells the call apart: torch refuses to write them, and so must the call's plan."""
    names = ["inference", "inference", "inference_slots", "inference"]
    for rank, result in enumerate(_run(pools, names)):
        got = result["got"]
        assert [entry[0] for entry in got] == result["want"], f"rank {rank}"
        assert result["want"][2][0] == "raise", result["want"]
        assert [entry[1] for entry in got] == [1, 0, 1, 1], f"rank {rank}: {got}"


# Slots of every kind the kept check must tell from fresh ones, built beside an input.
_KINDS = (
    "fresh",
    "view_kept",
    "storage_held",
    "numpy",
    "requires_grad",
    "float64",
    "short",
    "inference",
    "conj",
    "neg",
    "strided",
    "permuted",
    "input",
    "repeat",
    "parameter",
    "shared_memory",
    "dlpack",
    "sparse",
    "emptied",
)


def _slot(kind: str, tensor: torch.Tensor, kept: List[Any], earlier: List[torch.Tensor]) -> Any:
    if kind == "view_kept":
        slot = torch.zeros(4, 3)
        kept.append(slot[0])
    elif kind == "storage_held":
        slot = torch.zeros(4, 3)
        kept.append(slot.untyped_storage())
    elif kind == "numpy":
        slot = torch.zeros(4, 3)
        kept.append(slot.numpy())
    elif kind == "requires_grad":
        slot = torch.zeros(4, 3, requires_grad=True)
    elif kind == "float64":
        slot = torch.zeros(4, 3, dtype=torch.float64)
    elif kind == "short":
        slot = torch.zeros(3, 3)
    elif kind == "inference":
        with torch.inference_mode():
            slot = torch.zeros(4, 3)
    elif kind == "conj":
        slot = torch.zeros(4, 3, dtype=torch.complex64).conj()
    elif kind == "neg":
        slot = torch.zeros(4, 3, dtype=torch.complex64).conj().imag
    elif kind == "strided":
        slot = torch.zeros(4, 6)[:, ::2]
    elif kind == "permuted":
        slot = torch.zeros(3, 4).t()
    elif kind == "input":
        slot = tensor
    elif kind == "repeat" and earlier:
        slot = earlier[-1]
    elif kind == "parameter":
        slot = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    elif kind == "shared_memory":
        slot = torch.zeros(4, 3).share_memory_()
    elif kind == "dlpack":
        slot = torch.zeros(4, 3)
        kept.append(torch.utils.dlpack.to_dlpack(slot))
    elif kind == "sparse":
        slot = torch.zeros(4, 3).to_sparse()
    elif kind == "emptied":  # its storage resized away (as FSDP frees a flat parameter): address 0
        slot = torch.empty(0)
        slot.set_(torch.UntypedStorage(96), 12 * len(earlier), (4, 3), (3, 1))  # type: ignore[call-overload]
        slot.untyped_storage().resize_(0)
    else:
        slot = torch.zeros(4, 3)
    return slot


@settings(max_examples=400, deadline=None)
@given(kinds=st.lists(st.sampled_from(_KINDS), min_size=2, max_size=4), input_kind=st.sampled_from(["plain", "conj"]))
def test_the_kept_check_passes_only_slots_choose_rebinds(kinds: List[str], input_kind: str) -> None:
    """``rebinds_as_kept`` is the kept plan's one-pass stand-in for ``choose``: whatever it passes,
    ``choose`` must rebind (the converse need not hold: what it refuses is planned in full)."""
    tensor = torch.ones(4, 3) if input_kind == "plain" else torch.ones(4, 3, dtype=torch.complex64).conj()
    kept: List[Any] = []
    slots: List[Any] = []
    for kind in kinds:
        slots.append(_slot(kind, tensor, kept, slots))
    reference = torch.zeros(4, 3, dtype=tensor.dtype)
    keys = compat.dispatch_keys(reference)  # type: ignore[misc]  # present on every torch tox runs
    if strategies.rebinds_as_kept(slots, tensor, tensor.shape, keys):
        assert strategies.choose(slots, tensor, len(slots), 0) is Strategy.REBIND, kinds
    if all(kind == "fresh" for kind in kinds) and input_kind == "plain":
        assert strategies.rebinds_as_kept(slots, tensor, tensor.shape, keys)  # fresh slots pass
    del kept


@pytest.mark.parametrize("holder", ["none", "python", "storage", "view"])
def test_the_kept_check_of_a_slots_memory_says_what_cpu_slot_facts_says(holder: str) -> None:
    slot = torch.zeros(8)
    kept: Any = {"none": None, "python": slot, "storage": slot.untyped_storage(), "view": slot[2:]}[holder]
    rebindable = compat.exclusive_cpu_slots([slot], unpinned=True)  # as strategies.rebinds_as_kept reads it
    assert rebindable == (compat.cpu_slot_facts(slot) == (True, True))
    assert rebindable is (holder in ("none", "python"))
    del kept


def test_the_single_routes_wait_ends_at_once_for_a_buffer_nothing_else_holds() -> None:
    flat = torch.empty(16)
    held = compat.hold(flat)
    assert held is not None
    compat.await_release_of(flat, held, timeout_s=5.0)  # returns at once: nobody else holds it
    extra = [flat]  # a Python reference taken after the hold was read: waited for, up to the bound
    import time

    start = time.monotonic()
    compat.await_release_of(flat, held, timeout_s=0.2)
    assert time.monotonic() - start >= 0.2
    del extra


def test_the_single_route_waits_for_its_buffer_only_where_a_cat_is_armed_for_it() -> None:
    """A rebind's buffer is waited for (``compat.hold``, then ``compat.await_release_of``) where an elided cat's proof will
    read who holds it, and gather()'s result; a rebind with no cat armed returns at once. The cat is
    elided all the same."""
    out = run_on_fake(
        _FULL_PLANS_COUNTED
        + textwrap.dedent("""
        from memgather import compat
        waits = [0]
        hold = compat.hold  # read right before the single call, where its buffer is then waited for
        def counted_hold(tensor):
            waits[0] += 1
            return hold(tensor)  # (read a frame deeper: the wait after it ends at once)
        compat.hold = counted_hold
        for elide in (False, True):
            memgather.patch(["user_code"], elide=elide)
            core.configure(replace(core.settings(), nccl_min_bytes=0))
            memgather.reset_stats()
            waits[0] = 0
            for _ in range(3):
                slots = user["call"](16)
                whole = torch.cat(slots)
                del slots
            stats = memgather.stats()
            print(elide, waits[0], stats.rewired, stats.elided, tuple(whole.shape))
        waits[0] = 0
        memgather.gather(torch.ones(4))
        print("gather", waits[0])
    """)
    )
    assert out.split("\n")[:3] == ["False 0 3 0 (8,)", "True 3 3 3 (8,)", "gather 1"], out


def test_a_kept_plan_keeps_no_group_alive() -> None:
    """A plan kept for calls on a subgroup holds the group weakly: dropped by the program, it is freed."""
    out = run_on_fake("""
        import gc, weakref
        exec(compile('def call_on(group):\\n'
                     '    t = torch.ones(4)\\n'
                     '    dist.all_gather([torch.empty_like(t), torch.empty_like(t)], t, group=group)\\n',
                     '<user>', 'exec'), user)
        memgather.patch(["user_code"])
        from dataclasses import replace
        core.configure(replace(core.settings(), nccl_min_bytes=0))  # every call rewired
        group = dist.new_group([0, 1])
        for _ in range(3):
            user["call_on"](group)
        print(dict(memgather.stats().by_strategy))
        freed = weakref.ref(group)
        dist.destroy_process_group(group)
        del group
        gc.collect()
        print(freed() is None)
    """)
    assert out.split("\n")[:2] == ["{'rebind': 3}", "True"], out


# A run_on_fake body's start: memgather patched for user_code with every call rewired, and each full
# plan counted in ``counted[0]``; ``after_plan[0]``, where set, runs after each full plan.
_FULL_PLANS_COUNTED = """
from dataclasses import replace
from memgather.engine import kept, planner
memgather.patch(["user_code"])
core.configure(replace(core.settings(), nccl_min_bytes=0))
full, counted, after_plan = planner._plan, [0], [None]
def counting(*args, **kwargs):
    counted[0] += 1
    made = full(*args, **kwargs)
    if after_plan[0] is not None:
        after_plan[0]()
    return made
planner._plan = counting
"""


def test_each_place_a_code_gathers_from_keeps_a_plan_of_its_own() -> None:
    """Two gathers of two shapes in one function, and one Function applied from two lines: each
    place plans its first call in full and its next calls take that plan, not the other place's."""
    out = run_on_fake(
        _FULL_PLANS_COUNTED
        + textwrap.dedent("""
        exec(compile('class Gather(torch.autograd.Function):\\n'
                     '    @staticmethod\\n'
                     '    def forward(ctx, t):\\n'
                     '        dist.all_gather([torch.empty_like(t), torch.empty_like(t)], t)\\n'
                     '        return t.clone()\\n'
                     'def two(a, b):\\n'
                     '    dist.all_gather([torch.empty_like(a), torch.empty_like(a)], a)\\n'
                     '    dist.all_gather([torch.empty_like(b), torch.empty_like(b)], b)\\n'
                     'def applied(a, b):\\n'
                     '    Gather.apply(a)\\n'
                     '    Gather.apply(b)\\n',
                     '<user>', 'exec'), user)
        a, b = torch.ones(4), torch.ones(8)
        for name in ("two", "applied"):
            counted[0] = 0
            memgather.reset_stats()
            for _ in range(5):
                user[name](a, b)
            print(name, counted[0], dict(memgather.stats().by_strategy))
    """)
    )
    assert out.split("\n")[:2] == ["two 2 {'rebind': 10}", "applied 2 {'rebind': 10}"], out


def test_a_code_that_gathers_from_more_places_than_it_holds_sites_for_still_keeps_plans() -> None:
    """Past the sites a code holds, its places share one: calls that repeat one another take its plan."""
    out = run_on_fake(
        _FULL_PLANS_COUNTED
        + textwrap.dedent("""
        places = kept._MAX_SITES + 6
        exec(compile('def many(t):\\n' + '    dist.all_gather([torch.empty_like(t), torch.empty_like(t)], t)\\n' * places,
                     '<user>', 'exec'), user)
        t = torch.ones(4)
        print(kept._MAX_SITES)
        for _ in range(3):
            counted[0] = 0
            user["many"](t)
            print(counted[0])
    """)
    )
    held, *rounds = (int(line) for line in out.split())
    assert rounds == [held + 1, 0, 0], out  # one full plan a site held and one for the rest, then none


def test_a_plan_made_while_the_settings_changed_is_not_taken_under_the_new_ones() -> None:
    """A configure() while a call is planned (another thread's): the plan was made under the old
    settings, so the site's next call is planned in full, on a described group and on a new one."""
    out = run_on_fake(
        _FULL_PLANS_COUNTED
        + textwrap.dedent("""
        def configure_once():
            after_plan[0] = None
            core.configure(replace(core.settings()))  # new settings, as another thread's configure()
        for per_rank in (64, 128):  # the group's first call, then a described group's (another shape)
            after_plan[0] = configure_once
            counted[0] = 0
            for _ in range(3):
                user["call"](per_rank)
            print(counted[0])
    """)
    )
    assert out.split("\n")[:2] == ["2", "2"], out


def test_a_kept_plan_is_not_taken_where_its_group_changed() -> None:
    """Inside a coalescing block, on a subgroup torch's table no longer lists, and on a default group
    made anew, a site's next call is planned in full (and torch's call, where the plan says so)."""
    out = run_on_fake(
        _FULL_PLANS_COUNTED
        + textwrap.dedent("""
        from torch.distributed.distributed_c10d import _coalescing_manager
        from torch.testing._internal.distributed.fake_pg import FakeStore
        exec(compile('def call_on(t, group=None):\\n'
                     '    dist.all_gather([torch.empty_like(t), torch.empty_like(t)], t, group=group)\\n',
                     '<user>', 'exec'), user)
        t = torch.ones(4)
        def step(label, **kwargs):
            counted[0] = 0
            user["call_on"](t, **kwargs)
            print(label, counted[0])
        step("first")
        step("again")
        with _coalescing_manager(device=torch.device("cpu")):
            step("coalescing")
        step("after")  # (the coalesced call's plan, torch's, replaced the kept one)
        step("after again")
        group = dist.new_group([0, 1])
        step("subgroup", group=group)
        step("subgroup again", group=group)
        dist.destroy_process_group(group)
        step("subgroup destroyed", group=group)
        dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        step("default group made anew")
        step("default group again")
    """)
    )
    assert out.split("\n")[:10] == [
        "first 1",
        "again 0",
        "coalescing 1",
        "after 1",
        "after again 0",
        "subgroup 1",
        "subgroup again 0",
        "subgroup destroyed 1",
        "default group made anew 1",
        "default group again 0",
    ], out


_PIECES = ("in_place", "another_index", "fresh", "another_buffer", "strided", "inference", "grad", "numpy_part")
_INPUTS = ("fresh", "own_slot", "another_slot", "overlapping", "buffer_tail", "conj")


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=4),
    input_kind=st.sampled_from(_INPUTS),
    rank=st.integers(0, 3),
)
def test_the_kept_direct_check_passes_only_slots_choose_gathers_into_directly(
    pieces: List[str], input_kind: str, rank: int
) -> None:
    """``direct_as_kept`` is the kept plan's one-pass stand-in for ``choose``'s DIRECT: whatever it
    passes, ``choose`` must answer DIRECT."""
    world = len(pieces)
    rank %= world
    buffer = torch.zeros((world + 1) * 3)
    other = torch.zeros(world * 3)
    with torch.inference_mode():
        frozen = torch.zeros(world * 3)
    array = numpy.zeros(world * 3, dtype=numpy.float32)  # parts of it: adjacent, each a storage of its own
    slots: List[torch.Tensor] = []
    for index, piece in enumerate(pieces):
        if piece == "another_index":
            slots.append(buffer[((index + 1) % world) * 3 : ((index + 1) % world + 1) * 3])
        elif piece == "fresh":
            slots.append(torch.zeros(3))
        elif piece == "another_buffer":
            slots.append(other[index * 3 : (index + 1) * 3])
        elif piece == "strided":
            slots.append(torch.zeros(6)[::2])
        elif piece == "inference":
            slots.append(frozen[index * 3 : (index + 1) * 3])
        elif piece == "grad":
            slots.append(torch.zeros(3, requires_grad=True))
        elif piece == "numpy_part":
            slots.append(torch.from_numpy(array[index * 3 : (index + 1) * 3]))
        else:
            slots.append(buffer[index * 3 : (index + 1) * 3])
    tensor = {
        "fresh": lambda: torch.ones(3),
        "own_slot": lambda: slots[rank],
        "another_slot": lambda: slots[(rank + 1) % world],
        "overlapping": lambda: buffer[1:4],
        "buffer_tail": lambda: buffer[world * 3 :],
        "conj": lambda: torch.ones(3, dtype=torch.complex64).conj(),
    }[input_kind]()
    keys = compat.dispatch_keys(buffer[:3])  # type: ignore[misc]  # present on every torch tox runs
    if strategies.direct_as_kept(slots, tensor, tensor.shape, keys, rank):
        assert strategies.choose(slots, tensor, world, rank) is Strategy.DIRECT, (pieces, input_kind, rank)
    if all(piece == "in_place" for piece in pieces) and input_kind in ("fresh", "own_slot"):
        assert strategies.direct_as_kept(slots, tensor, tensor.shape, keys, rank)  # views in order pass
