"""What memgather leaves for a process's teardown.

A gloo job that ends without ``destroy_process_group()`` sometimes aborts at
exit under torch alone: a gloo worker thread that still holds a finished
collective's tensors needs the GIL to let go of them once the interpreter is
finalizing (``python -m tests.exits`` measures how often, per mode). These
tests check the parts of memgather that run at or for teardown: after memgather
rewired calls through a group, destroying the group leaves no memgather
reference that keeps it alive, and memgather's exit report makes no collective,
neither when the group is already destroyed nor when its peer is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

from tests import exits
from tests.conftest import unwrap
from tests.pool import free_port

JOB = Path(__file__).resolve().parent / "exits_job.py"
ROOT = JOB.parent.parent


def _start(rank: int, env: Dict[str, str]) -> "subprocess.Popen[str]":
    return subprocess.Popen([sys.executable, str(JOB), "teardown"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**env, "RANK": str(rank)}, cwd=str(ROOT), start_new_session=True)


def _finish(proc: "subprocess.Popen[str]", timeout_s: float) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"rank did not exit within {timeout_s} s:\n{output[-3000:]}")
    return output


def test_teardown_holds_no_group_and_exit_report_makes_no_collective(tmp_path: Path) -> None:
    gone = tmp_path / "peer-gone"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATHER")}
    env.update({"MEMGATHER": "1", "MEMGATHER_REPORT": "all", "MEMGATHER_VERIFY": "1", "MEMGATHER_GLOO_MIN_BYTES": "0",
                "MEMGATHER_TARGETS": "memgather_bench_patterns", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()), "EXITS_PROBE_PEER_GONE": str(gone), "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"})
    procs: List["subprocess.Popen[str]"] = [_start(rank, env) for rank in range(2)]
    try:
        outputs = {1: _finish(procs[1], 120)}
        gone.touch()  # rank 1 has exited: rank 0 now ends with its group alive and its peer gone
        outputs[0] = _finish(procs[0], 60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    for rank, output in outputs.items():
        assert procs[rank].returncode == 0, f"rank {rank} exited {procs[rank].returncode}:\n{output[-3000:]}"
        assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
        lines = output.splitlines()
        probe = json.loads(next(line for line in lines if line.startswith("[exits-probe] "))[len("[exits-probe] "):])
        assert probe["patched"] and probe["rewired"] >= 6 and probe["gathered"], probe
        # memgather had described the new group, and keeps nothing that outlives its destruction
        assert probe["sub_described"] and probe["sub_dead"], probe
        report_prefix, last_prefix = f"[memgather rank {rank}] memgather: ", f"[exits-probe rank {rank}] collectives"
        report = [i for i, line in enumerate(lines) if line.startswith(report_prefix)]
        last = [i for i, line in enumerate(lines) if line.startswith(last_prefix)]
        assert len(report) == 1 and len(last) == 1 and report[0] < last[0], output[-3000:]
        if rank == 1:  # its default group destroyed before exit: the report still names the rank
            assert probe["world_dead"], probe
        else:  # group alive, peer gone: no collective at exit (the group saw some before: the count is live)
            assert probe["seq"] > 0, probe
            assert lines[last[0]].endswith("collectives at exit: 0"), output[-3000:]


# torchrun's summary of a run whose rank 0 aborted at exit (torch 2.13), as tests.exits reads it
_FAILED = """[exits-job rank 1] done: 10 gathers of 2 MiB per rank checked
[exits-job rank 0] done: 10 gathers of 2 MiB per rank checked
terminate called without an active exception
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  time      : 2026-11-30_19:20:30
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 8311)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8311
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_19:20:30
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 8310)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 8310
"""


def test_study_reads_torchrun_failure_table() -> None:
    exit_codes, terminate, done, reports = exits.parse(_FAILED, 1, "plain")
    assert exit_codes == {0: -6, 1: -15} and terminate == 1 and done == 2 and reports == 0
    clean = "[exits-job rank 0] done\n[exits-job rank 1] done\n[memgather rank 0] memgather: 1 calls\n"
    assert exits.parse(clean, 0, "plain") == ({0: 0, 1: 0}, 0, 2, 1)
    tally = exits.Tally()
    tally.add(exits.Outcome(1, 1.0, exit_codes, terminate, done, reports, _FAILED))
    tally.add(exits.Outcome(0, 1.0, {0: 0, 1: 0}, 0, 2, 1, clean))
    assert (tally.runs, tally.torchrun_ok, tally.exits, tally.other) == (2, 1, 4, 0)
    assert tally.exit_codes == {0: 2, -6: 1, -15: 1}
    assert re.search(r"\| memgather +\| 2 +\| 1 ", exits.table({"memgather": tally}, "plain"))


def released_when_returned(ctx: Any) -> Dict[str, int]:
    """memgather's own collectives, called many times: how often gloo still held their tensors on return."""
    import torch

    from memgather import compat
    from memgather.engine import agreement, core, verification

    held = {"agreement": 0, "verify": 0}
    original = core.original_all_gather()
    for call in range(40):
        row = torch.tensor([call, ctx.rank])
        agreement.exchange(original, None, row, ctx.world)
        held["agreement"] += compat._tensor_use_count(row) > 1
        tensor = torch.full((1024,), float(ctx.rank))
        gathered = [torch.full((1024,), float(r)) for r in range(ctx.world)]
        verification.verify(original, gathered, tensor, None, "rebind")
        held["verify"] += compat._tensor_use_count(tensor) > 1
    return held


def test_memgathers_own_collectives_return_with_gloos_hold_released(pools: Any) -> None:
    # A tensor gloo's worker thread still holds when the process finalizes is what aborts an exit.
    for result in unwrap(pools(2).run(released_when_returned)):
        assert result == {"agreement": 0, "verify": 0}, result
