"""memgather.gather_uneven on real gloo ranks: torch.cat of every rank's tensor, bit for bit.

Each rank's input is made from (its rank, its rows, the case's seed) alone, so every rank
can make every other rank's input and torch.cat them locally: the reference.
"""

from __future__ import annotations

import random
from typing import Any, Dict, List, Tuple

import pytest
import torch

import memgather
from tests.conftest import EAGER, unwrap
from tests.ranks import as_bytes, make_input

DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64"]
TRAILING: List[Tuple[int, ...]] = [(), (3,), (2, 5), (1, 1, 4)]


def _cases(world: int) -> List[Dict[str, Any]]:
    rng = random.Random(20261205 + world)
    cases = []
    for index, dtype in enumerate(DTYPES * 2):
        rows = [rng.choice([0, 1, 3, 17, 64]) for _ in range(world)]
        if index % 5 == 0:
            rows[rng.randrange(world)] = 0  # a rank with no rows
        cases.append({"dtype": dtype, "rows": rows, "trailing": rng.choice(TRAILING),
                      "layout": rng.choice(["contiguous", "strided"]), "seed": index})
    cases.append({"dtype": "float32", "rows": [0] * world, "trailing": (3,), "layout": "contiguous", "seed": 99})
    cases.append({"dtype": "float32", "rows": [(1 << 19) + r for r in range(world)], "trailing": (2,),
                  "layout": "contiguous", "seed": 98})  # 4 MiB a rank: past every threshold
    return cases


def _input(case: Dict[str, Any], rank: int) -> torch.Tensor:
    shape = (case["rows"][rank], *case["trailing"])
    return make_input(getattr(torch, case["dtype"]), shape, case["seed"] * 100 + rank, case["layout"])


def gathered(ctx: Any, cases: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    results = []
    for case in cases:
        t = _input(case, ctx.rank)
        want = torch.cat([_input(case, r).contiguous() for r in range(ctx.world)])
        version = t._version
        memgather.reset_stats()
        got = memgather.gather_uneven(t)
        results.append({
            "route": dict(memgather.stats().by_route),
            "bytes": as_bytes(got) == as_bytes(want),
            "meta": [(tuple(x.shape), x.dtype, x.stride(), x.is_contiguous(), type(x).__name__) for x in (got, want)],
            "input_untouched": t._version == version and as_bytes(t) == as_bytes(_input(case, ctx.rank)),
            "grad": got.requires_grad,
            "version": got._version,
        })
    return results


@pytest.mark.parametrize("route", ["broadcast", "ring"])
@pytest.mark.parametrize("world", [2, 3])
def test_gather_uneven_is_torch_cat_of_every_ranks_tensor(pools: Any, world: int, route: str) -> None:
    """Through each gloo route: a broadcast per rank, and the ring (which a group across hosts takes)."""
    cases = _cases(world)
    environment = {**EAGER, "MEMGATHER_GLOO_ROUTE": route}
    for rank, results in enumerate(unwrap(pools(world, **environment).run(gathered, cases))):
        for case, got in zip(cases, results):
            label = f"rank {rank}, {case}"
            assert got["bytes"], label
            assert got["meta"][0] == got["meta"][1], label
            assert got["input_untouched"] and not got["grad"] and got["version"] == 0, label
            assert got["route"] == {route: 1}, label


def mismatched(ctx: Any) -> List[str]:
    messages = []
    for t in (torch.zeros(2 + ctx.rank, 3 + ctx.rank), torch.zeros(2, dtype=torch.float32 if ctx.rank else torch.int32)):
        try:
            memgather.gather_uneven(t)
            messages.append("returned")
        except memgather.UnevenLayoutError as error:
            messages.append(str(error))
    return messages


def test_ranks_differing_past_dim_0_raise_on_every_rank(pools: Any) -> None:
    results = unwrap(pools(2, **EAGER).run(mismatched))
    assert results[0] == results[1]
    trailing, dtype = results[0]
    assert "rank 0: 2 rows of (3,) float32 on cpu (strided); rank 1: 3 rows of (4,) float32 on cpu (strided)" in trailing
    assert "rank 0: 2 rows of () int32 on cpu (strided); rank 1: 2 rows of () float32 on cpu (strided)" in dtype


def requires_grad_input(ctx: Any) -> Tuple[bool, Any, List[float]]:
    t = torch.ones(1 + ctx.rank, 2, requires_grad=True)
    out = memgather.gather_uneven(t * (ctx.rank + 1))
    return out.requires_grad, out.grad_fn, out.sum(dim=1).tolist()


def test_an_input_with_history_gives_a_result_without(pools: Any) -> None:
    for requires_grad, grad_fn, sums in unwrap(pools(2, **EAGER).run(requires_grad_input)):
        assert (requires_grad, grad_fn, sums) == (False, None, [2.0, 4.0, 4.0])


def test_not_a_tensor_is_refused() -> None:
    with pytest.raises(TypeError, match="expects a torch.Tensor, got list"):
        memgather.gather_uneven([1, 2])  # type: ignore[arg-type]


# Run by nccl_ranks on two ranks: on gloo here, on NCCL where a GPU is (tests/test_cuda.py,
# benchmarks/gpu_check.py --only tests). Rank r has ROWS[r] rows of 3 floats; each prints the
# values against torch.cat of both ranks' tensors, and the peak beyond the input.
UNEVEN_TWO_RANKS = """
import memgather
DEVICE = "cpu" if dist.get_backend() == "gloo" else "cuda"
results = []
for rows in ([3 << 18, 1 << 18], [0, 5], [7, 0], [1, 1]):
    def made(r):
        return torch.arange(rows[r] * 3, dtype=torch.float32, device=DEVICE).reshape(rows[r], 3) + 1000 * r
    t = made(RANK)
    want = torch.cat([made(r) for r in range(WORLD)])
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    got = memgather.gather_uneven(t)
    peak = None
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    results.append([rows, bool(torch.equal(got, want)), list(got.shape), peak, got.numel() * 4])
print(json.dumps(results))
"""


def test_the_two_rank_script_the_gpu_runs_passes_on_gloo() -> None:
    from tests import nccl_ranks

    for results in nccl_ranks.run(UNEVEN_TWO_RANKS, backend="gloo", timeout_s=120):
        for rows, equal, shape, _, _ in results:
            assert equal and shape == [sum(rows), 3], rows


def test_the_benchmark_runs_and_finds_the_same_result() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "benchmarks/uneven.py", "--mib", "2,1", "--repeat", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "yes" for row in rows), done.stdout


def test_the_benchmark_refuses_what_it_cannot_measure() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "benchmarks/uneven.py", "--mib", "2"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--mib needs two ranks or more" in done.stderr


def mixed_kinds(ctx: Any) -> List[str]:
    """Inputs torch.cat would take differently, or that are not bytes to move: every rank raises alike,
    before any byte moves (a rank that raised alone would leave the others waiting in a broadcast)."""
    dense = torch.ones(2 + ctx.rank, 3)
    inputs = [
        dense.to_sparse() if ctx.rank == 0 else dense,  # one rank sparse
        dense.to_sparse(),  # every rank sparse
        torch.quantize_per_tensor(dense, 0.5, 0, torch.qint8),
        torch.empty(2 + ctx.rank, 3, device="meta"),
    ]
    messages = []
    for tensor in inputs:
        try:
            memgather.gather_uneven(tensor)
            messages.append("returned")
        except (memgather.UnevenLayoutError, ValueError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_inputs_that_are_not_dense_strided_raise_on_every_rank(pools: Any) -> None:
    results = unwrap(pools(2, **EAGER).run(mixed_kinds))
    assert results[0] == results[1]
    one_sparse, sparse, quantized, meta = results[0]
    assert one_sparse.startswith("UnevenLayoutError") and "on cpu (sparse or another layout)" in one_sparse
    assert sparse == "ValueError: memgather.gather_uneven gathers dense strided tensors; every rank's input is sparse or another layout"
    assert quantized.endswith("every rank's input is quantized") and meta.endswith("every rank's input is meta")


def routes_set_differently(ctx: Any) -> Tuple[Dict[str, int], bool]:
    """MEMGATHER_GLOO_ROUTE=ring on rank 0 only: every rank takes the broadcasts (the setting travels
    in the exchanged row), where the ring on one rank and broadcasts on the other would wait forever."""
    from memgather.engine import core, uneven

    t = torch.arange(6.0 * (1 + ctx.rank)).reshape(-1, 3)
    memgather.reset_stats()
    table = uneven.layouts(core._original_all_gather, None, t, ctx.world, "ring" if ctx.rank == 0 else "broadcast")
    got = uneven.gather(t, None, core._original_all_gather, "ring" if ctx.rank == 0 else "broadcast")
    want = torch.cat([torch.arange(6.0 * (1 + r)).reshape(-1, 3) for r in range(ctx.world)])
    return dict(memgather.stats().by_route), bool(torch.equal(got, want)) and [x.gloo_route for x in table] == ["ring", "broadcast"]


def test_ranks_set_to_different_routes_take_the_broadcasts(pools: Any) -> None:
    for routes_taken, equal in unwrap(pools(2, **EAGER).run(routes_set_differently)):
        assert routes_taken == {"broadcast": 1} and equal
