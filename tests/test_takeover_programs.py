"""Programs that torch runs, through the taken-over helpers: memgather on against memgather off.

Each program runs on every rank of a real gloo group, first with memgather unpatched, then
patched for the helpers' verbatim copies (``tests/library_code``) with every threshold off, and
hands back everything a caller can see: values, dtypes, shapes, strides, ``requires_grad``,
gradients and tangents, versions, classes, errors, warnings, the ops a mode saw. A program whose
ranks took different ways would hang or abort here (every pool runs under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` too, which checks that every rank issues matching collectives).
"""

from __future__ import annotations

import threading
import unittest.mock
import warnings
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

import memgather
from memgather.patching import helpers
from tests.conftest import EAGER, unwrap
from tests.library_code import lightning_distributed, monai_dist, torchmetrics_1_8, torchmetrics_distributed
from tests.ranks import OpRecorder, as_bytes, group_for
from tests.test_padded import _register

DETAIL = {**EAGER, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
HELPERS: Dict[str, Callable[[torch.Tensor], Any]] = {
    "torchmetrics": torchmetrics_distributed.gather_all_tensors,
    "torchmetrics 1.8": torchmetrics_1_8.gather_all_tensors,
    "lightning": lightning_distributed._gather_all_tensors,
    "monai": lambda x: monai_dist.evenly_divisible_all_gather(x, concat=True),
    "monai list": lambda x: monai_dist.evenly_divisible_all_gather(x, concat=False),
}


def _seen(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            plain = value.detach()
            return (type(value).__name__, as_bytes(plain.resolve_conj().resolve_neg()), value.dtype,
                    tuple(value.shape), value.stride(), value.requires_grad, value._version)
    if isinstance(value, (list, tuple)):
        return [_seen(v) for v in value]
    return repr(value)


def _each_way(program: Callable[[], Any], targets: Any = ("tests.library_code",)) -> Dict[str, Any]:
    """``program()`` unpatched, then patched for the helpers' copies (or ``targets``)."""
    _register()
    theirs = program()
    memgather.patch(list(targets))
    try:
        taken = sorted(helpers.taken_over())
        memgather.reset_stats()
        ours = program()
        unpadded = memgather.stats().by_strategy.get("unpadded", 0)
    finally:
        memgather.unpatch()
    return {"same": theirs == ours, "theirs": theirs, "ours": ours, "taken": taken, "unpadded": unpadded}


def _rows(rank: int, extra: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange((3 + 2 * rank + extra) * 2, dtype=torch.float64).reshape(-1, 2) + 100 * rank).to(dtype)


def _guarded(function: Callable[[], Any]) -> Any:
    try:
        return function()
    except Exception as error:  # noqa: BLE001 - the error is what is compared
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"


def plain_inputs(ctx: Any) -> Dict[str, Any]:
    """The baseline: each helper on plain uneven rows, taken over (``unpadded`` counts them)."""
    return _each_way(lambda: [_seen(helper(_rows(ctx.rank))) for helper in HELPERS.values()])


def flagged_inputs(ctx: Any, flag: str, ranks: List[int], names: List[str]) -> Dict[str, Any]:
    """A conjugate or negative-bit input on some ranks: the library's own way on every rank. (MONAI's own
    gather of a conjugate input raises on the longest rank alone, whose rows it does not pad: torch's
    ranks then part, so no program here gives it one there.)"""

    def program() -> Any:
        given = _rows(ctx.rank, dtype=torch.complex64)
        if ctx.rank in ranks:
            given = given.conj() if flag == "conj" else torch._neg_view(given)
        return [_guarded(lambda: _seen(HELPERS[name](given))) for name in names]

    return _each_way(program)


def functorch_programs(ctx: Any) -> Dict[str, Any]:
    """``torch.func.grad`` and ``vjp`` through each helper."""

    def program() -> Any:
        out = []
        for helper in HELPERS.values():
            def loss(x: torch.Tensor, helper: Any = helper) -> torch.Tensor:
                gathered = helper(x)
                return (torch.cat(gathered) if isinstance(gathered, list) else gathered).pow(2).sum()

            out.append(_guarded(lambda: _seen(torch.func.grad(loss)(_rows(ctx.rank)))))
            out.append(_guarded(lambda: _seen(torch.func.vjp(loss, _rows(ctx.rank))[1](torch.tensor(1.0)))))
        return out

    return _each_way(program)


def forward_ad_programs(ctx: Any) -> Dict[str, Any]:
    """Dual inputs: the results' tangents as torch's."""
    import torch.autograd.forward_ad as fwad

    def program() -> Any:
        out = []
        for helper in HELPERS.values():
            with fwad.dual_level():
                x = fwad.make_dual(_rows(ctx.rank), torch.ones_like(_rows(ctx.rank)))
                gathered = helper(x)
                parts = gathered if isinstance(gathered, list) else [gathered]
                out.append([(_seen(fwad.unpack_dual(p).primal), _seen(fwad.unpack_dual(p).tangent)) for p in parts])
        return out

    return _each_way(program)


class Strict(torch.Tensor):
    """A subclass whose ``__torch_function__`` knows only what the libraries' code calls."""

    UNKNOWN = frozenset({"element_size", "data_ptr", "untyped_storage", "storage_offset", "is_conj", "is_neg",
                         "is_quantized", "is_meta", "set_", "new_empty", "view", "stride"})

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "") or getattr(getattr(func, "__get__", None), "__name__", "")
        if name in cls.UNKNOWN:
            return NotImplemented
        return super().__torch_function__(func, types, args, kwargs or {})


def strict_subclass(ctx: Any) -> Dict[str, Any]:
    return _each_way(lambda: [_guarded(lambda: _seen(h(_rows(ctx.rank).as_subclass(Strict)))) for h in HELPERS.values()])


def counted_ops(ctx: Any) -> Dict[str, Any]:
    """A dispatch mode that records every op: it sees the library's ops, none of memgather's."""
    def program() -> Any:
        out = []
        for helper in HELPERS.values():
            given = _rows(ctx.rank)
            with OpRecorder() as recorder:
                result = helper(given)
            out.append((_seen(result), recorder.ops))
        return out

    return _each_way(program)


def versions_then_backward(ctx: Any) -> Dict[str, Any]:
    """An in-place write into one returned entry, then backward through another: the library's entries
    have independent version counters, and so must memgather's."""

    def program() -> Any:
        out = []
        for name in ("torchmetrics", "torchmetrics 1.8", "lightning", "monai list"):
            entries = HELPERS[name](_rows(ctx.rank))
            weight = torch.ones(2, requires_grad=True)
            other = entries[1 - ctx.rank] if name != "lightning" else entries[1]
            product = (weight * other).sum()
            with torch.no_grad():
                entries[0].add_(1) if entries[0] is not other else None
            out.append(_guarded(lambda: (product.backward(), _seen(weight.grad))[1]))
            out.append([e._version for e in entries])
        return out

    return _each_way(program)


def warnings_seen(ctx: Any) -> Dict[str, Any]:
    """Warnings, with the file and line they are attributed to (filters by module read these)."""

    def program() -> Any:
        out = []
        for helper in HELPERS.values():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                helper(_rows(ctx.rank))
            out.append([(w.category.__name__, str(w.message)[:60], w.filename, w.lineno) for w in caught])
        return out

    return _each_way(program)


def under_inference_mode(ctx: Any) -> Dict[str, Any]:
    """Each helper under ``torch.inference_mode()`` (Lightning runs its validation and test loops, metrics'
    ``compute()`` included, so): inference tensors have no version counter."""

    def program() -> Any:
        out = []
        for helper in HELPERS.values():
            with torch.inference_mode():
                found = _guarded(lambda: helper(_rows(ctx.rank)))
            parts = found if isinstance(found, list) else [found]
            out.append([(_seen_plain(p), p.is_inference()) if isinstance(p, torch.Tensor) else p for p in parts])
        return out

    return _each_way(program)


def _seen_plain(value: torch.Tensor) -> Any:
    """``_seen`` without the version, which an inference tensor does not have."""
    return (type(value).__name__, as_bytes(value), value.dtype, tuple(value.shape), value.stride(), value.requires_grad)


def wrapped_after_patch(ctx: Any) -> Dict[str, Any]:
    """A wrapper of the user's around ``torch.distributed.all_gather``, installed after ``patch()``, that does
    something after each call: it sees every call finish, as under torch (memgather keeps the library's way)."""

    def program() -> Any:
        seen: List[Any] = []
        underneath = dist.all_gather

        def wrapper(tensor_list: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(("start", tuple(tensor.shape)))
            done = underneath(tensor_list, tensor, *args, **kwargs)
            seen.append(("end", tuple(tensor.shape)))
            return done

        dist.all_gather = wrapper
        try:
            results = [_seen(HELPERS[name](_rows(ctx.rank))) for name in ("torchmetrics", "lightning", "monai")]
        finally:
            dist.all_gather = underneath
        return results, seen

    return _each_way(program)


def kept_lists(ctx: Any) -> Dict[str, Any]:
    """A caller that keeps the returned lists: every entry a plain ``torch.Tensor``, on every call."""

    def program() -> Any:
        return [[type(t) is torch.Tensor for t in HELPERS[name](_rows(ctx.rank))]
                for name in ("torchmetrics", "lightning", "monai list") for _ in range(3)]

    return _each_way(program)


def _cat_with_shapes(given: torch.Tensor, shapes: Any) -> torch.Tensor:
    import ignite.distributed as idist

    return torch.cat(idist.all_gather_tensors_with_shapes(given, shapes))  # proven: armed, the cat elided


def ignite_programs(ctx: Any) -> Dict[str, Any]:
    """Ignite's own ``all_gather_tensors_with_shapes``, taken over: plain rows, shapes that say fewer rows than
    the tensor has (Ignite's negative padding crops it), shapes that are not whole numbers, a 0-d shape list,
    a kept list, and a caller that concatenates at once."""
    import ignite.distributed as idist

    def program() -> Any:
        given = _rows(ctx.rank)
        shapes = [[3 + 2 * r, 2] for r in range(ctx.world)]
        out = []
        for case in (shapes, [[n - 1, 2] for n, _ in shapes], [[float(n), 2.0] for n, _ in shapes], shapes):
            found = _guarded(lambda: idist.all_gather_tensors_with_shapes(given, case))
            out.append(_seen(found))
            out.append([type(t) is torch.Tensor for t in found] if isinstance(found, list) else None)
        # A group given as its ranks (Ignite makes it), and a group without this rank (Ignite hands the tensor back).
        out.append(_seen(idist.all_gather_tensors_with_shapes(given, shapes, group=list(range(ctx.world)))))
        alone = group_for((0,))
        out.append(_seen(idist.all_gather_tensors_with_shapes(given, shapes[:1], group=alone)))
        # Shapes Ignite cannot read as a tensor (a generator, a map), a group that is none: its own errors.
        out.append(_guarded(lambda: idist.all_gather_tensors_with_shapes(given, (shape for shape in shapes))))
        out.append(_guarded(lambda: idist.all_gather_tensors_with_shapes(given, map(list, shapes))))
        out.append(_guarded(lambda: idist.all_gather_tensors_with_shapes(given, shapes, group="abc")))
        # Its own warnings (it slices with a list of slices), with the file and line they are attributed to.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            idist.all_gather_tensors_with_shapes(given, shapes)
        out.append([(w.category.__name__, str(w.message)[:60], w.filename, w.lineno) for w in caught])
        # Shapes of bools: Ignite's own code refuses them (a bool tensor's subtraction), where one row of
        # one column would otherwise read as a whole shape.
        single = torch.ones(1, 1) * ctx.rank
        out.append(_guarded(lambda: _seen(idist.all_gather_tensors_with_shapes(single, [[True, True]] * ctx.world))))
        cat = _cat_with_shapes(given, shapes)
        out.append((_seen(cat), torch._C._is_cow_tensor(cat)))
        return out

    found = _each_way(program, ["ignite"])
    # The one difference: the proven cat returns a copy-on-write snapshot of the gathered tensor.
    cow = [found["theirs"][-1][1], found["ours"][-1][1]]
    found["same"] = found["theirs"][:-1] == found["ours"][:-1] and found["theirs"][-1][0] == found["ours"][-1][0]
    found["cow"] = cow
    return found


def refused_list_index(ctx: Any) -> Dict[str, Any]:
    """On a torch that refused a list of slices as an index (torch 2.x warns that it will), the releases
    whose code slices so (torchmetrics 1.0 to 1.8, Lightning) keep their own way, which meets the refusal
    as the library does; torchmetrics 1.9's tuple index is taken over as before."""
    from memgather.patching import padded

    probed = list(padded._probed)
    padded._probed[:] = [None]  # as the probe finds it on such a torch
    try:
        found = _each_way(lambda: [_seen(HELPERS[name](_rows(ctx.rank))) for name in ("torchmetrics 1.8", "lightning")])
        memgather.patch(["tests.library_code"])
        try:
            memgather.reset_stats()
            torchmetrics_distributed.gather_all_tensors(_rows(ctx.rank))
            found["tuple index taken over"] = memgather.stats().by_strategy.get("unpadded", 0)
        finally:
            memgather.unpatch()
    finally:
        padded._probed[:] = probed
    return found


def mocked_in_a_group(ctx: Any) -> Dict[str, Any]:
    """A test's mock of ``torch.distributed.all_gather`` inside a real group: Ignite's code gathers through the
    mock (its fake values), and memgather, which sees it, leaves the whole call to Ignite."""
    import ignite.distributed as idist

    def fake(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> None:
        for slot in tensor_list:
            slot.fill_(7)

    shapes = [[3 + 2 * r, 2] for r in range(ctx.world)]
    idist.all_gather_tensors_with_shapes(_rows(ctx.rank), shapes)  # Ignite's first call: its model set up

    def program() -> Any:
        with unittest.mock.patch.object(dist, "all_gather", side_effect=fake):
            return _guarded(lambda: _seen(idist.all_gather_tensors_with_shapes(_rows(ctx.rank), shapes)))

    return _each_way(program, ["ignite"])


def repatched_meanwhile(ctx: Any) -> Dict[str, Any]:
    """``memgather.patch()`` again, with the settings in force, from a thread while this one gathers through
    a helper: every call takes the same way on every rank."""
    _register()
    memgather.patch(["tests.library_code"])
    stop = threading.Event()

    def repatch() -> None:
        while not stop.is_set():
            memgather.patch(["tests.library_code"])

    thread = threading.Thread(target=repatch)
    thread.start()
    try:
        got = [torch.cat(torchmetrics_distributed.gather_all_tensors(_rows(ctx.rank, extra=i))).tolist()
               for i in range(30)]
    finally:
        stop.set()
        thread.join()
        memgather.unpatch()
    want = [torch.cat([_rows(r, extra=i) for r in range(ctx.world)]).tolist() for i in range(30)]
    return {"same": got == want}


def compiled_with_recompiles(ctx: Any, fullgraph: bool) -> Dict[str, Any]:
    """A compiled step whose rows vary on rank 0 only: rank 0 passes Dynamo's recompile limit and runs the
    step eagerly while rank 1 runs it compiled. Every rank must still issue the same collectives."""
    import torch._dynamo

    def program() -> Any:
        torch._dynamo.reset()
        step = torch.compile(lambda x: torch.cat(torchmetrics_distributed.gather_all_tensors(x)).sum(),
                             dynamic=False, fullgraph=fullgraph)
        return [_guarded(lambda: float(step(_rows(ctx.rank, extra=i if ctx.rank == 0 else 0)))) for i in range(4)]

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with unittest.mock.patch.object(config, name, 1):
        found = _each_way(program)
    found["theirs"] = [str(value).split(":")[0] for value in found["theirs"]]  # an error's type, where torch raises
    found["ours"] = [str(value).split(":")[0] for value in found["ours"]]
    found["same"] = found["theirs"] == found["ours"]
    return found


PROGRAMS = [
    ("plain", plain_inputs, ()),
    ("conj on rank 0", flagged_inputs, ("conj", [0], list(HELPERS))),
    ("neg on rank 1", flagged_inputs, ("neg", [1], list(HELPERS))),
    ("conj on every rank", flagged_inputs, ("conj", [0, 1], ["torchmetrics", "torchmetrics 1.8", "lightning"])),
    ("torch.func", functorch_programs, ()),
    ("forward AD", forward_ad_programs, ()),
    ("strict subclass", strict_subclass, ()),
    ("dispatch mode", counted_ops, ()),
    ("write then backward", versions_then_backward, ()),
    ("warnings", warnings_seen, ()),
    ("kept lists", kept_lists, ()),
    ("inference mode", under_inference_mode, ()),
    ("a wrapper installed after patch()", wrapped_after_patch, ()),
]


@pytest.mark.parametrize("environment", [EAGER, DETAIL], ids=["eager", "detail"])
@pytest.mark.parametrize("label, program, args", PROGRAMS, ids=[label for label, _, _ in PROGRAMS])
def test_a_program_sees_what_torch_gives(pools: Any, environment: Dict[str, str], label: str, program: Any,
                                          args: Any) -> None:
    for rank, got in enumerate(unwrap(pools(2, **environment).run(program, *args))):
        assert got["same"], (rank, label, got["theirs"], got["ours"])
        assert len(got["taken"]) == 5, got["taken"]
    if label == "plain":
        assert got["unpadded"] == len(HELPERS), got


@pytest.mark.parametrize("environment", [EAGER, DETAIL], ids=["eager", "detail"])
def test_ignites_helper_taken_over_answers_as_its_own_code(pools: Any, environment: Dict[str, str]) -> None:
    for rank, got in enumerate(unwrap(pools(2, **environment).run(ignite_programs))):
        assert got["same"], (rank, got["theirs"], got["ours"])
        assert got["taken"] == ["ignite.distributed.utils.all_gather_tensors_with_shapes"], got
        # The plain, kept, warned and concatenated calls, and rank 0's in a group of its own (a group given as ranks
        # is left to Ignite's code; rank 1, outside the group, gets its tensor back from Ignite).
        assert got["unpadded"] == (5 if rank == 0 else 4) and got["cow"] == [False, True], (rank, got)


def test_ignites_helper_compiles_with_fullgraph_without_a_group() -> None:
    """No process group: Ignite's serial model, traced as its own code (the trampoline is followed)."""
    import ignite.distributed as idist
    import torch._dynamo

    def compiled() -> Any:
        torch._dynamo.reset()
        step = torch.compile(lambda x: torch.cat(idist.all_gather_tensors_with_shapes(x, [[3]])) * 2, fullgraph=True)
        return _guarded(lambda: _seen(step(torch.ones(3))))

    found = _each_way(compiled, ["ignite"])
    assert found["same"] and "Error" not in repr(found["ours"]), found
    assert found["taken"] == ["ignite.distributed.utils.all_gather_tensors_with_shapes"], found


def test_a_list_index_this_torch_refuses_keeps_the_librarys_own_way(pools: Any) -> None:
    for got in unwrap(pools(2, **EAGER).run(refused_list_index)):
        assert got["same"] and got["unpadded"] == 0, got
        assert got["tuple index taken over"] == 1, got


def test_a_mock_inside_a_real_group_gets_the_librarys_code(pools: Any) -> None:
    for got in unwrap(pools(2, **EAGER).run(mocked_in_a_group)):
        assert got["same"] and got["unpadded"] == 0, got


def test_a_thread_re_patching_meanwhile_leaves_every_call_on_one_way(pools: Any) -> None:
    for got in unwrap(pools(2, **DETAIL).run(repatched_meanwhile)):
        assert got["same"], got


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
def test_a_compiled_step_with_recompiles_on_one_rank(pools: Any, fullgraph: bool) -> None:
    for rank, got in enumerate(unwrap(pools(2, **EAGER, MEMGATHER_TEST_POOL="compile").run(
            compiled_with_recompiles, fullgraph))):
        assert got["same"], (rank, got["theirs"], got["ours"])


def compiled_under_memgather(ctx: Any) -> List[float]:
    import torch._dynamo

    _register()
    memgather.patch(["tests.library_code"])
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    try:
        with unittest.mock.patch.object(config, name, 1):
            torch._dynamo.reset()
            step = torch.compile(lambda x: torch.cat(torchmetrics_distributed.gather_all_tensors(x)).sum(),
                                 dynamic=False)
            return [float(step(_rows(ctx.rank, extra=i if ctx.rank == 0 else 0))) for i in range(4)]
    finally:
        memgather.unpatch()


def test_a_compiled_step_with_recompiles_on_one_rank_issues_matching_collectives(pools: Any) -> None:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL. (torch's own run of this program fails that check: its compiled
    rank gathers through functional collectives, its eager rank through the list all_gather. memgather's
    graph break runs the helper eagerly on every rank.)"""
    want = [float(sum(_rows(r, extra=i if r == 0 else 0).sum() for r in range(2))) for i in range(4)]
    for got in unwrap(pools(2, **DETAIL, MEMGATHER_TEST_POOL="compile detail").run(compiled_under_memgather)):
        assert got == want, (got, want)


def test_mocked_distributed_without_a_process_group_gets_the_librarys_code() -> None:
    """A unit test's mocks of torch.distributed, no group initialised: the library's code runs against them."""
    _register()

    def gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
        for index, slot in enumerate(tensor_list):
            slot.copy_(tensor if index == 0 else torch.zeros_like(tensor) + index)

    def program() -> Any:
        with unittest.mock.patch.object(dist, "get_world_size", return_value=2), \
                unittest.mock.patch.object(dist, "get_rank", return_value=0), \
                unittest.mock.patch.object(dist, "barrier"), \
                unittest.mock.patch.object(dist, "all_gather", side_effect=gather):
            return [_guarded(lambda: _seen(torchmetrics_distributed.gather_all_tensors(torch.ones(3, 2)))),
                    _guarded(lambda: _seen(lightning_distributed._gather_all_tensors(torch.ones(3, 2))))]

    found = _each_way(program)
    assert found["same"] and "Error" not in repr(found["ours"]), found
