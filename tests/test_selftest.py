"""``memgather selftest`` run as a user runs it: alone (world 1) and under torchrun (2 gloo ranks,
torch checking that every rank issues the same collectives), and with a fault injected into
memgather's broadcast route, which it must report on every rank and exit 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest

from memgather.tools import patterns
from tests.jobs import environment

ROOT = Path(__file__).resolve().parent.parent
# Below gloo's 2 MiB threshold (torch's path) and above it (every strategy memgather has on gloo).
SIZES = "64K,3M"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _selftest(launcher: List[str], *args: str, **env: str) -> "subprocess.CompletedProcess[str]":
    """The command's outcome; on a timeout its whole process group (torchrun's workers too) is killed."""
    command = [*launcher, *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=environment(OMP_NUM_THREADS="1", **env), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _rows(stdout: str) -> List[List[str]]:
    """The table's rows, split on the two-space column gaps."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("pattern "))
    return [[cell.strip() for cell in line.split("  ") if cell.strip()] for line in lines[start + 1:]
            if line.split() and line.split()[0] in patterns.BY_NAME]


def test_alone_it_is_a_world_of_one_and_passes() -> None:
    done = _selftest([sys.executable, "-m", "memgather", "selftest"], "--sizes", SIZES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("memgather selftest: PASS (14 cases, 1 rank, gloo"), done.stdout
    rows = _rows(done.stdout)
    assert len(rows) == 14 and all(row[-1] == "identical" for row in rows), done.stdout


def test_under_torchrun_every_rank_agrees_and_every_strategy_is_verified() -> None:
    done = _selftest([*TORCHRUN, "-m", "memgather", "selftest"], "--sizes", SIZES, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verdict = [line for line in done.stdout.splitlines() if line.startswith("memgather selftest:")]
    assert verdict == [verdict[0]] and "PASS (14 cases, 2 ranks, gloo" in verdict[0], done.stdout  # printed by rank 0 only
    took = {(row[0], row[1]): row[2] for row in _rows(done.stdout)}
    assert took[("empty_like_cat", "64 KiB")] == "torch (below_threshold)"
    assert took[("empty_like_cat", "3 MiB")] == "rebind (broadcast), cat elided"
    assert took[("zeros_like_branches", "3 MiB")] == "rebind (broadcast), cat elided"  # ignite's, proven in a method
    # torchmetrics' shape returns its list: rebound and armed for the caller's cat where that cat's result
    # would be copy-on-write (no cat follows here: nothing elided).
    assert took[("zeros_like_list", "3 MiB")] == "in_slots (broadcast)"  # a returned list: no cat proven
    assert took[("views_in_place", "3 MiB")] == "direct (broadcast)"
    # memgather.gather's small call is torch's single-tensor call into its result: not a rewire.
    assert took[("single_tensor", "64 KiB")] == "into_result (single_staged)"
    assert "7 cases rewired, 7 of them checked in verify mode" in verdict[0], verdict[0]


def test_a_wrong_byte_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's broadcast route writes one wrong value into slot 0: the result differs from torch's
    and verify mode raises on every rank; the selftest names the cases and every rank exits 1."""
    script = tmp_path / "faulty_selftest.py"
    script.write_text(textwrap.dedent(
        """
        import sys
        import torch
        import torch.distributed as dist
        from memgather.engine import routes
        from memgather.tools import selftest

        real = routes.broadcast_into

        def broadcast_into(destinations, tensor, group):
            real(destinations, tensor, group)
            if dist.get_rank() == 1:
                with torch.no_grad():
                    destinations[0].reshape(-1)[:1].add_(1)

        routes.broadcast_into = broadcast_into
        sys.exit(selftest.main(sys.argv[1:]))
        """
    ))
    done = _selftest([*TORCHRUN, str(script)], "--sizes", "3M")
    assert done.returncode != 0
    assert "exitcode  : 1" in done.stderr, done.stderr[-3000:]  # torchrun's account of a failed worker
    verdict = done.stdout.splitlines()[-1]
    assert verdict.startswith("memgather selftest: FAIL (7 cases, 2 ranks"), done.stdout
    for name in ("empty_like_cat", "zeros_like_list", "views_in_place", "single_tensor"):
        assert f"{name} at 3 MiB" in verdict, verdict
    assert "memgather verify:" in done.stdout or "DIFFERS from torch" in done.stdout


@pytest.mark.parametrize("args,env,says", [
    (["--sizes", "3X"], {}, "--sizes '3X'"),
    (["--sizes", "0,3"], {}, "positive multiple of 4 bytes"),
    (["--sizes", ""], {}, "--sizes ''"),
    ([], {"MEMGATHER": "0"}, "MEMGATHER=0"),
    ([], {"MEMGATHER_GLOO_ROUTE": "sideways"}, "MEMGATHER_GLOO_ROUTE"),
    (["--backend", "nccl"], {"CUDA_VISIBLE_DEVICES": ""}, "needs a CUDA device"),
])
def test_what_cannot_run_exits_2_and_says_why(args: List[str], env: Dict[str, str], says: str) -> None:
    done = _selftest([sys.executable, "-m", "memgather", "selftest"], *args, **env)
    assert done.returncode == 2 and "memgather selftest: cannot run:" in done.stderr and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
