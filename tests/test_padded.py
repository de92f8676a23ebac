"""The libraries' pad, gather, slice and cat, taken over: the library's own code against memgather's.

``tests/library_code`` holds verbatim copies of the helpers memgather takes over
(torchmetrics' ``gather_all_tensors``, MONAI's ``evenly_divisible_all_gather``), registered
here under the copies' module names with the very replacements and digests memgather ships.
Each rank calls a helper unpatched and then taken over, on the same input, and compares
everything the helper hands back: each tensor's bytes, dtype, shape, strides,
``requires_grad`` and whether it is the input itself, the error where the library raises,
and the ``torch.cat`` of a returned list.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from typing import Any, Dict, List, Tuple

import pytest
import torch

import memgather
from memgather.patching import helpers, library_helpers
from tests.conftest import EAGER, unwrap
from tests.library_code import (
    lightning_distributed,
    monai_dist,
    torchmetrics_1_5,
    torchmetrics_1_8,
    torchmetrics_distributed,
)
from tests.ranks import as_bytes, make_input

# Each registered shape's verbatim copy, by the helper it stands for.
COPIES = {
    "torchmetrics.gather_all_tensors": [m.__name__ for m in (torchmetrics_distributed, torchmetrics_1_8, torchmetrics_1_5)],
    "monai.evenly_divisible_all_gather": [monai_dist.__name__],
    "lightning_fabric._gather_all_tensors": [lightning_distributed.__name__],
}  # Ignite's helper reads Ignite's own computation model: the real one runs (test_ignite_takeover below)
TORCHMETRICS = (torchmetrics_distributed.gather_all_tensors, torchmetrics_1_8.gather_all_tensors,
                torchmetrics_1_5.gather_all_tensors)
DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool", "complex64"]


def _register() -> None:
    for helper in library_helpers.HELPERS:
        for module in COPIES.get(helper.key, ()):
            helpers.register(dataclasses.replace(helper, key=f"copy of {helper.key} in {module}", module=module))


def _cases(world: int, seed: int) -> List[Dict[str, Any]]:
    rng = random.Random(seed + world)
    cases = []
    for index, dtype in enumerate(DTYPES * 2):
        rows = [rng.choice([0, 1, 5, 33]) for _ in range(world)]
        if index % 4 == 0:
            rows[rng.randrange(world)] = 0  # a rank with no rows
        trailing = rng.choice([(), (3,), (2, 4)])
        shapes = [(n, *trailing) for n in rows]
        if index % 7 == 3 and trailing:  # ranks that differ past dim 0: the library's padded way
            shapes[-1] = (rows[-1], *(d + 1 for d in trailing))
        cases.append({"dtype": dtype, "shapes": shapes, "seed": index, "grad": index % 6 == 1 and dtype == "float32"})
    cases.append({"dtype": "float32", "shapes": [()] * world, "seed": 90, "grad": False})  # 0-d
    # Contiguous, with a stride of its own on a dim of size 1 (torch's zeros_like keeps it), on the longest rank.
    cases.append({"dtype": "float32", "shapes": [(5 - r, 1, 4) for r in range(world)], "seed": 95, "grad": False,
                  "size1_strides": 0})
    for permuted in (0, world - 1):  # a transposed input: its own slots keep its strides under torch
        cases.append({"dtype": "float32", "shapes": [(9 - r, 4) for r in range(world)], "seed": 93 + permuted,
                      "grad": False, "permuted": permuted})
    cases.append({"dtype": "float32", "shapes": [(4, 3)] * world, "seed": 91, "grad": False})  # even
    cases.append({"dtype": "float32", "shapes": [((1 << 18) + 7 * r, 2) for r in range(world)], "seed": 92,
                  "grad": False})  # 2 MiB a rank: past the default threshold
    return cases


def _input(case: Dict[str, Any], rank: int) -> torch.Tensor:
    layout = "permuted" if case.get("permuted") == rank else "contiguous"
    t = make_input(getattr(torch, case["dtype"]), tuple(case["shapes"][rank]), case["seed"] * 10 + rank, layout)
    if case.get("size1_strides") == rank:
        t = t.as_strided(t.shape, (4, 77, 1))
    return t.requires_grad_() if case["grad"] else t


def _seen(value: Any, given: torch.Tensor) -> Any:
    """What a caller can read of a helper's answer."""
    if isinstance(value, torch.Tensor):
        return (as_bytes(value.detach().cpu()), value.dtype, tuple(value.shape), value.stride(), value.requires_grad,
                value is given, value.is_contiguous(), type(value) is torch.Tensor or type(value).__name__,
                value._version, value._base is not None, value.grad_fn is not None)
    if isinstance(value, list):
        return [_seen(v, given) for v in value]
    return repr(value)


def _written(gathered: Any, given: torch.Tensor) -> Any:
    """Each entry's version after an in-place write into the first entry that is not the input: a write
    into one of the library's separate slots bumps no other's."""
    if not isinstance(gathered, list):
        return None
    entries = [t for t in gathered if isinstance(t, torch.Tensor) and t is not given and not t.requires_grad]
    if not entries or entries[0].numel() == 0:
        return None
    with torch.no_grad():
        entries[0].copy_(entries[0].clone())
    return [t._version for t in gathered]


def _call(function: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the error is what is compared
        return f"{type(error).__name__}: {error}"


def _answers(given: torch.Tensor, case: Dict[str, Any]) -> List[Any]:
    """Every helper's answer to ``given``, as a caller sees it, and the cat of each returned list
    (MONAI's where the ranks differ in dim 0 alone, as it requires: else its own gather breaks)."""
    out = []
    for helper in (*TORCHMETRICS, lightning_distributed._gather_all_tensors):
        gathered = _call(helper, given)
        cat = _call(torch.cat, gathered) if isinstance(gathered, list) else None  # first: as their callers do
        out.append(_seen(gathered, given))
        out.append(_seen(cat, given))
        out.append(_written(gathered, given))
    if len({tuple(shape)[1:] for shape in case["shapes"]}) > 1:
        return out
    for concat in (True, False):
        gathered = _call(monai_dist.evenly_divisible_all_gather, given, concat=concat)
        out.append(_seen(gathered, given))
        out.append(_written(gathered, given))
    return out


def compared(ctx: Any, cases: List[Dict[str, Any]]) -> List[Tuple[bool, str, Dict[str, int]]]:
    _register()
    results = []
    for case in cases:
        given = _input(case, ctx.rank)
        theirs = _answers(given, case)
        memgather.patch(["tests.library_code"])
        try:
            taken = helpers.taken_over()
            memgather.reset_stats()
            ours = _answers(given, case)
            routes = dict(memgather.stats().by_route)
        finally:
            memgather.unpatch()
        results.append((ours == theirs, f"{case} taken over: {taken}", routes))
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_taken_over_helpers_answer_as_the_libraries_own_code(pools: Any, world: int) -> None:
    cases = _cases(world, 20261205)
    for rank, results in enumerate(unwrap(pools(world, **EAGER).run(compared, cases))):
        for case, (same, label, routes) in zip(cases, results):
            assert same, f"rank {rank}: {label}"
            for copy in ("torchmetrics_distributed.gather_all_tensors", "monai_dist.evenly_divisible_all_gather",
                         "lightning_distributed._gather_all_tensors", "torchmetrics_1_8.gather_all_tensors",
                         "torchmetrics_1_5.gather_all_tensors"):
                assert copy in label, label
    # The uneven cases of one trailing shape went unpadded: broadcasts into one tensor.
    assert any(routes.get("broadcast") for _, _, routes in results), results


def test_taken_over_helpers_under_distributed_debug_detail(pools: Any) -> None:
    """torch checks that every rank issues matching collectives: no rank takes another way."""
    cases = _cases(3, 777)[:8]
    environment = {**EAGER, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    for rank, results in enumerate(unwrap(pools(3, **environment).run(compared, cases))):
        assert all(same for same, _, _ in results), (rank, [label for same, label, _ in results if not same])


def test_small_uneven_gathers_take_the_librarys_padded_way(pools: Any) -> None:
    """Under the threshold (2 MiB a rank on gloo) torch's one gather is quicker: nothing is broadcast."""
    cases = [c for c in _cases(2, 5) if c["dtype"] == "float32"][:3]
    for rank, results in enumerate(unwrap(pools(2).run(compared, cases))):
        for same, label, routes in results:
            assert same, (rank, label)
            assert not routes.get("broadcast"), (rank, label, routes)


def _cat_of_torchmetrics(given: torch.Tensor) -> torch.Tensor:
    return torch.cat(torchmetrics_distributed.gather_all_tensors(given))  # a caller proven to concatenate


def _cat_of_lightning(given: torch.Tensor) -> torch.Tensor:
    return torch.cat(lightning_distributed._gather_all_tensors(given))


def elided(ctx: Any) -> Dict[str, Any]:
    """torchmetrics' list, uneven: where its caller's code concatenates it at once, the cat is the gathered
    tensor, as a copy-on-write snapshot; where the caller keeps the list, its entries are plain tensors."""
    _register()
    given = torch.arange(3 + 2 * ctx.rank, dtype=torch.float32) + 100 * ctx.rank
    memgather.patch(["tests.library_code"])
    try:
        cat = _cat_of_torchmetrics(given)
        fabric_cat = _cat_of_lightning(given)
        kept = torchmetrics_distributed.gather_all_tensors(given)
        kinds = [type(t).__name__ for t in kept]
        kept_cat = torch.cat(kept)
        memgather.patch(["tests.library_code"], elide=False)
        unarmed = torch._C._is_cow_tensor(_cat_of_torchmetrics(given))
    finally:
        memgather.unpatch()
    return {"cow": torch._C._is_cow_tensor(cat), "values": cat.tolist(), "kinds": kinds, "unarmed": unarmed,
            "fabric": (torch._C._is_cow_tensor(fabric_cat), fabric_cat.tolist()),
            "kept cat": (torch._C._is_cow_tensor(kept_cat), kept_cat.tolist())}


def test_the_cat_of_torchmetrics_list_is_elided_where_its_caller_is_proven_to_concatenate(pools: Any) -> None:
    want = [float(v) for r in range(2) for v in (torch.arange(3 + 2 * r) + 100 * r).tolist()]
    for got in unwrap(pools(2, **EAGER).run(elided)):
        assert got["values"] == want and got["cow"], got
        assert got["fabric"] == (True, want), got
        # A list the caller keeps: plain tensors (no subclass of memgather's in the caller's hands), cat copied.
        assert got["kinds"] == ["Tensor", "Tensor"] and got["kept cat"] == (False, want), got
        assert got["unarmed"] is False, got


def test_recognised_by_code_and_given_back() -> None:
    """The helper's own code, as its source reads, comes back on unpatch(); a changed copy is left alone."""
    _register()
    function = torchmetrics_distributed.gather_all_tensors
    code, signature, source = function.__code__, inspect.signature(function), inspect.getsource(function)
    changed: Dict[str, Any] = {}
    exec(source.replace("result.contiguous()", "result.clone()"), vars(torchmetrics_distributed).copy(), changed)
    helper = next(h for h in library_helpers.HELPERS if h.key == "torchmetrics.gather_all_tensors")
    assert helpers.recognise(helper, function) is None
    assert helpers.recognise(helper, changed["gather_all_tensors"]) is not None
    memgather.patch(["tests.library_code"])
    try:
        assert function.__code__ is not code
        assert inspect.signature(function) == signature and inspect.getsource(function) == source
        assert sorted(helpers.taken_over()) == sorted(
            f"{module}.{h.name}" for h in library_helpers.HELPERS for module in COPIES.get(h.key, ())
        )
        with memgather.disabled():  # the library's own code runs (here without a group: its own error)
            with pytest.raises((ValueError, RuntimeError)):
                function(torch.ones(2))
    finally:
        memgather.unpatch()
    assert function.__code__ is code and helpers.taken_over() == []
    memgather.patch(["somewhere.else"])  # a selection without the library: its helper is its own
    try:
        assert function.__code__ is code
    finally:
        memgather.unpatch()


def verified(ctx: Any) -> Dict[str, int]:
    _register()
    given = torch.arange((4 + 3 * ctx.rank) * 2, dtype=torch.float32).reshape(-1, 2)
    memgather.patch(["tests.library_code"], verify=True)
    try:
        memgather.reset_stats()
        torchmetrics_distributed.gather_all_tensors(given)
        monai_dist.evenly_divisible_all_gather(given, concat=True)
        stats = memgather.stats()
    finally:
        memgather.unpatch()
    return {"verified": stats.verified, "rewired": stats.rewired, "unpadded": stats.by_strategy.get("unpadded", 0)}


def test_verify_mode_checks_the_unpadded_rows_against_torchs_padded_gather(pools: Any) -> None:
    for got in unwrap(pools(2, **EAGER).run(verified)):
        assert got == {"verified": 2, "rewired": 2, "unpadded": 2}, got


# The helpers' copies on two ranks of the script's backend (gloo here; NCCL in tests/test_cuda.py, which
# benchmarks/gpu_check.py runs on a GPU): each copy unpatched, then taken over, every threshold off.
HELPERS_TWO_RANKS = """
import memgather
from tests import test_padded as T
DEVICE = "cpu" if dist.get_backend() == "gloo" else "cuda"
T._register()
results = []
for shapes in ([(3 << 16, 4), (1 << 16, 4)], [(0, 3), (5, 3)], [(7,), (0,)]):
    given = T._input({"dtype": "float32", "shapes": shapes, "seed": 3, "grad": False}, RANK).to(DEVICE)
    theirs = T._answers(given, {"shapes": shapes})
    memgather.patch(["tests.library_code"])
    memgather.reset_stats()
    ours = T._answers(given, {"shapes": shapes})
    unpadded = memgather.stats().by_strategy.get("unpadded", 0)
    memgather.unpatch()
    results.append([shapes, ours == theirs, unpadded])
print(json.dumps(results))
"""


def test_the_two_rank_helpers_script_the_gpu_runs_passes_on_gloo() -> None:
    from tests import nccl_ranks

    for results in nccl_ranks.run(HELPERS_TWO_RANKS, backend="gloo", env=EAGER, timeout_s=180):
        for shapes, same, unpadded in results:
            assert same and unpadded == 6, (shapes, unpadded)  # torchmetrics' three, Lightning's, MONAI's twice


def test_doctor_reads_each_helpers_code_from_its_file_without_importing_it() -> None:
    _register()
    states = {**dict(helpers.survey()), **dict(helpers.survey(library_helpers.HELPERS))}
    # Each copy as the shape of its release line, which the doctor names.
    for copy, line in ((torchmetrics_distributed, "torchmetrics 1.9"), (torchmetrics_1_8, "torchmetrics 1.6.0 to 1.8.2"),
                       (torchmetrics_1_5, "torchmetrics 1.0.0 to 1.5.2")):
        assert states[f"{copy.__name__}.gather_all_tensors"].startswith(f"recognised ({line})"), states
    assert states[f"{monai_dist.__name__}.evenly_divisible_all_gather"].startswith("recognised"), states
    assert states["ignite.distributed.utils.all_gather_tensors_with_shapes"].startswith(
        "recognised (PyTorch-Ignite 0.5.2 to 0.5.5)"), states  # the test extra installs Ignite
    assert states["torchmetrics.utilities.distributed.gather_all_tensors"] == "not installed", states
    changed = helpers.Helper("changed", torchmetrics_distributed.__name__, "gather_all_tensors",
                             (helpers.Shape("0" * 32, "none"),), (), "memgather.patching.padded:gather_all_tensors")
    missing = dataclasses.replace(changed, key="missing", name="no_such_function")
    assert "not a shape" in helpers._state_on_disk(changed) and "not defined" in helpers._state_on_disk(missing)


def mixed_ranks(ctx: Any) -> List[Any]:
    """Inputs whose ranks differ where a library lets them: MONAI with a 0-d input on one rank and one
    row on the other, torchmetrics with rows on one rank and none on the other (every threshold off)."""
    _register()
    out = []
    monai = [lambda t: monai_dist.evenly_divisible_all_gather(t, concat=True),
             lambda t: monai_dist.evenly_divisible_all_gather(t, concat=False)]
    for given, calls in (
        (torch.tensor(5.0) if ctx.rank == 0 else torch.tensor([7.0]), monai),  # torchmetrics' own breaks there
        (torch.arange(6.0).reshape(3, 2) if ctx.rank == 0 else torch.zeros(0, 2),
         [*monai, torchmetrics_distributed.gather_all_tensors]),
    ):
        theirs = [_seen(_call(call, given), given) for call in calls]
        memgather.patch(["tests.library_code"])
        try:
            ours = [_seen(_call(call, given), given) for call in calls]
        finally:
            memgather.unpatch()
        out.append(ours == theirs)
    return out


def test_ranks_that_differ_where_the_library_allows_take_one_way(pools: Any) -> None:
    """A rank's own verdict (MONAI's 0-d input) travels in the exchange: no rank is left in another collective."""
    for got in unwrap(pools(2, **EAGER).run(mixed_ranks)):
        assert got == [True, True], got


def kept_lists(ctx: Any) -> List[Any]:
    """torchmetrics' list kept, never concatenated (a list state with dist_reduce_fx=None): its entries are
    plain tensors from the first call, and hold the other ranks' rows alone, as the library's slices do."""
    _register()
    memgather.patch(["tests.library_code"])
    try:
        seen = []
        kept = []
        for _ in range(3):
            given = torch.ones(1000 + 500 * ctx.rank, 8)
            gathered = torchmetrics_distributed.gather_all_tensors(given)
            other = gathered[1 - ctx.rank]
            seen.append((type(other).__name__, other.untyped_storage().nbytes(), gathered[ctx.rank] is given))
            kept.append(gathered)
    finally:
        memgather.unpatch()
    return seen


def test_a_kept_list_holds_no_second_copy_of_the_ranks_own_rows(pools: Any) -> None:
    for rank, seen in enumerate(unwrap(pools(2, **EAGER).run(kept_lists))):
        other_rows = 1000 + 500 * (1 - rank)
        assert seen == [("Tensor", other_rows * 8 * 4, True)] * 3, seen  # the other rank's rows alone


def observed(ctx: Any) -> Dict[str, Any]:
    """What the user's own wrapper of torch.distributed.all_gather sees of a taken-over helper's calls,
    and whether a call under the threshold made any exchange of memgather's."""
    from memgather.engine import core

    _register()
    made = []
    original = core._original_all_gather
    counted = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted.append(1)
        return original(*args, **kwargs)

    memgather.patch(["tests.library_code"])
    patched = torch.distributed.all_gather
    try:
        def wrapper(tensor_list: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
            made.append(tuple(tensor.shape))
            return patched(tensor_list, tensor, *args, **kwargs)

        torch.distributed.all_gather = wrapper
        core._original_all_gather = counting
        torchmetrics_distributed.gather_all_tensors(torch.ones(3 + ctx.rank, 2))  # small: no exchange of memgather's
    finally:
        torch.distributed.all_gather = patched
        core._original_all_gather = original
        memgather.unpatch()
    return {"wrapper saw": made, "memgather's exchanges": len(counted)}


def test_the_libraries_own_calls_reach_the_users_wrapper_and_small_calls_exchange_nothing_more(pools: Any) -> None:
    for got in unwrap(pools(2).run(observed)):
        # The size exchange (a 2-vector), then the padded gather of (4, 2) slots: both the library's.
        assert got == {"wrapper saw": [(2,), (4, 2)], "memgather's exchanges": 0}, got


def refused(ctx: Any) -> List[str]:
    """torchmetrics' gather of a dtype gloo refuses: the library raises, and so must the taken-over helper."""
    _register()
    given = torch.ones(3 + ctx.rank, 2, dtype=torch.uint16)
    theirs = _call(torchmetrics_distributed.gather_all_tensors, given)
    memgather.patch(["tests.library_code"])
    try:
        ours = _call(torchmetrics_distributed.gather_all_tensors, given)
    finally:
        memgather.unpatch()
    return [theirs, ours]


def test_a_dtype_gloo_refuses_raises_as_the_library_does(pools: Any) -> None:
    # A pool of its own: after gloo refuses a dtype, some libraries' ranks fall out of step (MONAI's
    # padded gather, unpatched), which no later program should inherit.
    for theirs, ours in unwrap(pools(2, **EAGER, MEMGATHER_TEST_POOL="refused dtypes").run(refused)):
        assert isinstance(theirs, str) and "Invalid scalar type" in theirs and ours == theirs, (theirs, ours)
