"""What a program can observe of a rewired call beyond the gathered bytes, against torch alone.

Each program runs on two real gloo ranks twice: torch's all_gather, then memgather's, on
slots built the same way; every field a program can read is compared.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import memgather
from tests.conftest import EAGER, unwrap
from tests.ranks import filled, work_answers

_KEY = torch._C.DispatchKey.ADInplaceOrView
GUARDS: Dict[str, Callable[[], Any]] = {
    "below_ad_inplace_or_view": lambda: torch._C._AutoDispatchBelowADInplaceOrView(),
    "exclude_ad_inplace_or_view": lambda: torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)),
    "below_autograd": lambda: torch._C._AutoDispatchBelowAutograd(),
    "inference_mode": lambda: torch.inference_mode(),
    "no_grad": lambda: torch.no_grad(),
    "none": contextlib.nullcontext,
}
SLOTS = ("empty_like", "views_of_one_tensor", "one_counter_shared")


def _slots(kind: str, t: torch.Tensor) -> List[torch.Tensor]:
    if kind == "empty_like":
        return [torch.empty_like(t) for _ in range(2)]
    if kind == "views_of_one_tensor":
        return list(torch.empty(2 * t.shape[0], *t.shape[1:]).chunk(2))
    base = torch.empty_like(t)
    return [base, base.view(t.shape)]  # two slots, one version counter (overlapping: torch's call)


def _observed(gather: Any, guard: str, kind: str, async_op: bool, rank: int) -> Dict[str, Any]:
    t = filled(rank, (64, 3))
    out = _slots(kind, t)
    with GUARDS[guard]():
        work = gather(out, t, async_op=async_op)
        if async_op:
            work.wait()
    return {
        "versions": [s._version for s in out],
        "values": [s.tolist() for s in out],
        "answers": work_answers(work, out) if async_op else None,
    }


def guarded_calls(ctx: Any) -> List[Tuple[Any, ...]]:
    rows = []
    for guard in GUARDS:
        for kind in SLOTS:
            for async_op in (False, True):
                want = _observed(dist.all_gather, guard, kind, async_op, ctx.rank)
                memgather.reset_stats()
                got = _observed(memgather.all_gather, guard, kind, async_op, ctx.rank)
                rewired = memgather.stats().rewired
                rows.append((guard, kind, async_op, want, got, rewired))
    return rows


def test_version_counters_under_dispatch_guards_are_torchs(pools: Any) -> None:
    """A guard that excludes ADInplaceOrView leaves torch's slots at version 0: memgather's too."""
    for rows in unwrap(pools(2, **EAGER).run(guarded_calls)):
        for guard, kind, async_op, want, got, _ in rows:
            assert got == want, f"{guard}, {kind}, async_op={async_op}"
        rewired = {(guard, kind) for guard, kind, _, _, _, count in rows if count}
        # The guards that exclude the key, on slots memgather rewires (the shared counter goes to torch).
        assert {("below_ad_inplace_or_view", "empty_like"), ("exclude_ad_inplace_or_view", "views_of_one_tensor")} <= rewired


# In a dict: patch() rebinds a target module's own names for torch's all_gather to memgather's.
TORCH = {"all_gather": dist.distributed_c10d.all_gather}


@contextlib.contextmanager
def _patched_here() -> Iterator[None]:
    """memgather patched for this module's own calls, for the block."""
    memgather.patch([__name__])
    try:
        yield
    finally:
        memgather.unpatch()


def async_answers(ctx: Any) -> List[Tuple[Any, ...]]:
    """An async call's work from this module's own calls, patched for it, three times from one line
    (the later calls run on the plan kept at the call site), against torch's."""
    rows = []
    with _patched_here():
        for dtype in (torch.float32, torch.complex64, torch.int8):
            for gather in (TORCH["all_gather"], dist.all_gather) * 3:
                t = filled(ctx.rank, (64, 3), dtype)
                out = [torch.empty_like(t) for _ in range(2)]
                memgather.reset_stats()
                work = gather(out, t, async_op=True)
                work.wait()
                answers = work_answers(work, out)
                rows.append((str(dtype), gather is TORCH["all_gather"], answers, memgather.stats().rewired,
                             [s.tolist() for s in out]))
    return rows


def test_an_async_calls_work_answers_with_the_slots_as_torchs(pools: Any) -> None:
    """torch's work answers result() and its future with the slots themselves (a complex slot as its
    view_as_real view); a write through them steps the slot's own counter."""
    for rows in unwrap(pools(2, **EAGER).run(async_answers)):
        for want, got in zip(rows[0::2], rows[1::2]):
            assert want[1] and not got[1] and got[3] == 1, "torch's call, then memgather's rewired one"
            assert (got[2], got[4]) == (want[2], want[4]), got[0]
        assert rows[0][2]["result_is_slots"] == [True, True, True]


class Recording(TorchFunctionMode):
    """Records every function it sees; refuses the reads listed in ``refused``."""

    def __init__(self, refused: Tuple[str, ...] = ()) -> None:
        super().__init__()
        self.seen: List[str] = []
        self.refused = refused

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        self.seen.append(f"{name}{sorted(t.__name__ for t in types)}")
        if any(word in name for word in self.refused):
            raise RuntimeError(f"this mode refuses {name}")
        return func(*args, **(kwargs or {}))


class Watched(torch.Tensor):
    """A subclass whose __torch_function__ records what reaches it."""

    seen: List[str] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def _watched_calls(gather: Any, rank: int, numel: int) -> List[Any]:
    """Four calls from one line: plain, plain, under a recording mode, under a mode refusing reads;
    then slots of a watched subclass (the second call on the group)."""
    observed: List[Any] = []
    modes = [None, None, lambda: Recording(), lambda: Recording(("dtype", "shape", "numel", "element_size"))]
    for make in modes:
        t = filled(rank, (numel,))
        out = [torch.empty_like(t) for _ in range(2)]
        mode = make() if make else None
        try:
            with mode if mode is not None else contextlib.nullcontext():
                gather(out, t)
            observed.append((mode.seen if mode is not None else None, [s.tolist()[:4] for s in out]))
        except RuntimeError as error:
            observed.append(("raised", str(error)))
    Watched.seen = []
    t = filled(rank, (numel,))
    out = [torch.empty_like(t).as_subclass(Watched) for _ in range(2)]
    gather(out, t)
    observed.append((list(Watched.seen), [s.as_subclass(torch.Tensor).tolist()[:4] for s in out]))
    return observed


def watched_calls(ctx: Any) -> List[Any]:
    rows = []
    for numel in (16, 1 << 14, 1 << 20):
        want = _watched_calls(TORCH["all_gather"], ctx.rank, numel)
        with _patched_here():
            got = _watched_calls(dist.all_gather, ctx.rank, numel)
            rewired = memgather.stats().rewired
        rows.append((numel, want, got, rewired))
    return rows


def test_user_modes_and_subclass_slots_see_what_torchs_call_shows_them(pools: Any) -> None:
    """A function mode on a later call of a site whose plan is kept, a mode refusing reads of the
    input, and slots of a __torch_function__ subclass: each sees what it sees under torch's call."""
    for rows in unwrap(pools(2, **EAGER).run(watched_calls)):
        for numel, want, got, rewired in rows:
            assert rewired >= 2, numel  # the plain calls were rewired (the site's plan kept)
            assert got == want, numel


def empty_like_wrapped(ctx: Any) -> Tuple[int, int]:
    """A wrapper the program puts on torch.empty_like counts the program's calls only."""
    made = []
    original = torch.empty_like

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return original(*args, **kwargs)

    torch.empty_like = counting
    try:
        t = filled(ctx.rank, (1 << 14,))
        out = [torch.empty_like(t) for _ in range(2)]
        memgather.reset_stats()
        memgather.all_gather(out, t, check=True)  # check mode: the ranks exchange metadata rows first
    finally:
        torch.empty_like = original
    return len(made), memgather.stats().rewired


def test_a_wrapper_on_empty_like_sees_only_the_programs_calls(pools: Any) -> None:
    for made, rewired in unwrap(pools(2, **EAGER).run(empty_like_wrapped)):
        assert (made, rewired) == (2, 1)


def cat_under_mode(ctx: Any) -> List[Any]:
    rows = []
    for gather in (TORCH["all_gather"], lambda out, t: memgather.all_gather(out, t, elide=True)):
        t = filled(ctx.rank, (1 << 14,))
        out = [torch.empty_like(t) for _ in range(2)]
        gather(out, t)
        with Recording() as mode:
            result = torch.cat(out)
        rows.append((mode.seen, type(result).__name__, [type(s).__name__ for s in out], result[:3].tolist()))
    return rows


def test_a_mode_around_an_elided_cat_sees_the_armed_slots_class(pools: Any) -> None:
    """The one hook-visible difference docs/calls.md names: the armed slots' class in the mode's types;
    (torch's: none, plain tensors only); the result and the slots after the cat are plain tensors, the values torch's."""
    for (seen, kind, slot_kinds, values), got in unwrap(pools(2, **EAGER).run(cat_under_mode)):
        assert seen == ["_VariableFunctionsClass.cat[]"] and got[0] == ["_VariableFunctionsClass.cat['ElidableSlot']"]
        assert (got[1], got[2], got[3]) == (kind, slot_kinds, values) == ("Tensor", ["Tensor", "Tensor"], values)


def result_before_completion(ctx: Any) -> List[Any]:
    """``work.result()`` before the work completed: rank 1 comes 0.5 s late, so rank 0's cannot have."""
    import time

    rows = []
    with _patched_here():
        for gather in (TORCH["all_gather"], dist.all_gather):
            t = filled(ctx.rank, (64, 3))
            out = [torch.empty_like(t) for _ in range(2)]
            if ctx.rank == 1:
                time.sleep(0.5)
            work = gather(out, t, async_op=True)
            try:
                early: Any = ("returned", len(work.result()))
            except RuntimeError as error:
                early = ("raised", str(error))
            work.wait()
            rows.append((early if ctx.rank == 0 else None, [s.tolist() for s in out]))
    return rows


def test_result_before_completion_raises_as_torchs(pools: Any) -> None:
    results = unwrap(pools(2, **EAGER).run(result_before_completion))
    for want, got in results:
        assert got == want
    assert results[0][0][0][0] == "raised"  # torch's refusal on rank 0, which came first


class OwnSizes(torch.Tensor):
    """A __torch_dispatch__ wrapper subclass whose sizes are its own: its hook answers size reads."""

    seen: List[str] = []

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "OwnSizes":
        made = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, elem.size(), strides=elem.stride(), dtype=elem.dtype, device=elem.device,
            dispatch_sizes_strides_policy="sizes",
        )
        made.elem = elem
        return made

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(str(func))
        if func is torch.ops.aten.sym_size.default:
            return args[0].elem.size()
        if func is torch.ops.aten.sym_numel.default:
            return args[0].elem.numel()
        if func is torch.ops.aten.sym_stride.default:
            return args[0].elem.stride()
        if func is torch.ops.aten.sym_storage_offset.default:
            return args[0].elem.storage_offset()
        unwrap = lambda x: x.elem if isinstance(x, OwnSizes) else x  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def own_sizes_slots(ctx: Any) -> List[Any]:
    rows = []
    with _patched_here():
        for gather in (TORCH["all_gather"], dist.all_gather):
            t = filled(ctx.rank, (64, 3))
            out = [OwnSizes(torch.empty_like(t)) for _ in range(2)]
            OwnSizes.seen = []
            gather(out, t)
            rows.append((sorted(set(OwnSizes.seen)), [s.elem.tolist() for s in out]))
    return rows


def test_slots_with_their_own_sizes_see_memgathers_size_reads(pools: Any) -> None:
    """Pinned, as docs/calls.md names it: the values are torch's; the hook also sees sym_numel."""
    for want, got in unwrap(pools(2, **EAGER).run(own_sizes_slots)):
        assert got[1] == want[1]
        assert "aten.sym_numel.default" in set(got[0]) - set(want[0])
