"""The version gates against the torch release installed.

`tox -m torch-releases` runs this file, with the core, differential and patcher
tests, on each torch release named in releases.MEASURED: a gate that picked a primitive
or a route the release does not have fails here, not on a user's cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Dict

import pytest
import torch

import memgather
from memgather import compat, cow
from tests import compatibility
from tests.conftest import unwrap
from tests.faults import pair_outcomes
from tests.ranks import filled
from tests.releases import CURRENT, MEASURED


def test_gates_are_the_facts_measured_on_this_release() -> None:
    if CURRENT is None:
        pytest.skip(f"torch {torch.__version__} is not among the releases measured: {sorted(MEASURED)}")
    assert compat.single_tensor_primitive().name == CURRENT.primitive
    assert compat.gloo_has_single_tensor() == CURRENT.gloo_single
    assert compat.can_prove_exclusive() == CURRENT.use_count


def test_the_copy_on_write_probe_reads_this_release() -> None:
    """memgather.cow's probe on this torch: what was measured, and, where it passes, the facts an
    elided cat's snapshot rests on, checked here directly on 1 MiB (not the probe's few bytes)."""
    if CURRENT is not None:
        assert cow.works() is CURRENT.cow, cow.why_not()
    if not cow.works():
        assert cow.why_not(), "a torch without copy-on-write must say why"
        return
    buffer = torch.rand(1 << 18)
    slots = list(buffer.view(4, -1).unbind(0))
    snapshot = cow.snapshot(buffer)
    kept = buffer.clone()
    slots[2].zero_()
    assert torch.equal(snapshot, kept) and not torch.equal(buffer, kept)
    snapshot.mul_(2)
    assert torch.equal(slots[0], kept[: 1 << 16])


def test_gloo_gate_agrees_with_what_gloo_does(pools: Any) -> None:
    """The single-tensor call on a real gloo group (a pool of its own: a refusal must not
    leave the shared pools' group behind) works exactly where the gate says so."""
    for result in unwrap(pools(2, POOL="gloo-probe").run(gloo_single_tensor_call)):
        if compat.gloo_has_single_tensor():
            assert result == {"works": True, "correct": True}
        else:
            assert not result["works"] and "_allgather_base" in result["message"]


def test_gloo_takes_exactly_the_dtypes_memgather_routes(pools: Any) -> None:
    """Every dtype this torch has, through torch's all_gather on 2 gloo ranks: a dtype memgather
    routes that gloo refused would see memgather write or rebind slots before torch's error;
    one gloo took that memgather leaves to torch is a saving missed (the list is then old)."""
    from memgather.engine import routes

    taken = {str(dtype) for dtype in routes.dtypes_taken("gloo", "cpu") or ()}
    for result in unwrap(pools(2, POOL="gloo-dtypes").run(gloo_dtypes)):
        assert taken <= set(result), f"gloo refused {sorted(taken - set(result))}, which memgather routes"
        assert set(result) - taken <= LEFT_TO_TORCH, f"gloo took {sorted(set(result) - taken)}: route them?"


# Gathered by gloo where torch has them (torch 2.15's complex bfloat16, sent as real bfloat16 views),
# but left to torch: no differential test covers memgather's routes with them.
LEFT_TO_TORCH = {"torch.bcomplex32"}


def test_doctor_shows_each_backends_verdict_on_this_release() -> None:
    done = subprocess.run([sys.executable, "-m", "memgather", "doctor"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    primitive = compat.single_tensor_primitive().name
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("  ") and " available" in line}
    assert f"single-tensor all-gather: {primitive}" in done.stdout
    assert "gloo  available: sync calls from 2 MiB per rank" in lines["gloo"]
    gloo_async = f"async ones through {primitive}" if compat.gloo_has_single_tensor() else "async ones stay with torch"
    assert gloo_async in lines["gloo"], lines["gloo"]
    default = compat.default_nccl_flavour(torch.__version__, os.environ.get("TORCH_DIST_USE_NCCL2"))
    assert f'"nccl" is the {default} group here' in lines["nccl"], lines["nccl"]
    fresh = ("are released and rebound to one buffer" if compat.can_prove_exclusive()
             else "fresh slots stay with torch (this torch has no storage use count")
    assert fresh in lines["nccl"] and "filled where they lie" in lines["nccl"], lines["nccl"]
    assert "calls whose cat is elided take" in lines["nccl"], lines["nccl"]
    assert "every call stays with torch" in lines["mpi"]


def test_empty_tensors_end_as_torch_ends() -> None:
    """Fresh processes each: where torch's gloo dies on empty tensors, memgather's call dies the same way.

    On torch 1.13 and 2.0 gloo kills a rank with SIGFPE, and its peer either reaches the
    same fault or exits 1 when the connection drops, whichever comes first, under torch
    alone as well: a rank that died is compared as died, not by its exit code.
    """
    assert _died(pair_outcomes("memgather", "empty")) == _died(pair_outcomes("torch", "empty"))


def _died(outcomes: Any) -> Any:
    return {rank: "died" if str(o).startswith("exited ") and o != "exited 0" else o for rank, o in outcomes.items()}


def test_version_counter_bump_without_autograds_helper_writes_nothing() -> None:
    """torch 1.13 to 2.1 have no increment_version: the fallback bumps by one, bytes untouched."""
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1.5])
    for tensor in (special.clone(), special.clone()[1:].view(3, 1).t(), torch.tensor(7, dtype=torch.int8)):
        before, version = tensor.clone(), tensor._version
        compat._increment_through_empty_view(tensor)
        assert tensor._version == version + 1
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), before.reshape(-1).view(torch.uint8))


def test_target_module_under_memgather_1_grows_by_the_gathered_size() -> None:
    """The bar of each release: 2 gloo ranks, 98 MiB of fresh slots per rank, a target module
    under MEMGATHER=1 through memgather.pth: at most 1.05 x the gathered size, torch's bytes."""
    for rank in compatibility.measure():
        assert rank["patched"], rank
        assert rank["identical"], rank
        assert rank["memgather"] <= 1.05, rank
        assert rank["torch"] >= 1.5, rank  # what torch's temporary adds: the measurement sees it
        # The target returns its fresh list to code not proven to concatenate it at once: filled in place.
        assert rank["memgather_stats"]["strategy"] == {"in_slots": 1}, rank


# Run on every rank of a pool (tests/pool.py): each takes the rank's context first and
# returns plain data for the test above to assert on.


def gloo_single_tensor_call(ctx: Any) -> Dict[str, Any]:
    """Whether gloo carries out torch's single-tensor all-gather here, and correctly when it does."""
    primitive = memgather.primitive().function
    out = torch.zeros(ctx.world * 3)
    try:
        primitive(out, filled(ctx.rank))
    except RuntimeError as error:
        return {"works": False, "message": str(error)}
    return {"works": True, "correct": torch.equal(out, torch.cat([filled(r) for r in range(ctx.world)]))}


def gloo_dtypes(ctx: Any) -> Any:
    """The dtypes torch's all_gather gathers here (each tried on every rank, in the same order)."""
    dtypes = sorted({value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str)
    taken = []
    for dtype in dtypes:
        try:
            given = torch.zeros(3, dtype=dtype)
        except (RuntimeError, TypeError):
            continue  # no tensor of it on this build's CPU
        try:
            torch.distributed.all_gather([torch.zeros_like(given) for _ in range(ctx.world)], given)
        except RuntimeError:
            continue
        taken.append(str(dtype))
    return taken
