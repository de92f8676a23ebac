"""Process groups that end and begin again: torchrun restarting killed workers, and
``destroy_process_group()`` followed by a new ``init_process_group()`` in one process.

memgather is switched on only through memgather.pth (MEMGATHER=1), as in a user's
job; the jobs are tests/restart_job.py. What must hold: every new process is patched
again, nothing memgather cached about a group outlives it or is taken for a new one,
memgather keeps no destroyed group alive, and every gather is correct and rewired.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest

from integration.harness import Report, reports
from tests.pool import free_port
from tests.restart_job import ATTEMPT_PATTERNS, PHASE_B_RANK, PHASE_PATTERNS

JOB = Path(__file__).resolve().parent / "restart_job.py"
ON = {"MEMGATHER": "1", "MEMGATHER_TARGETS": "memgather_bench_patterns", "MEMGATHER_REPORT": "all"}
LIMIT_S = 90  # per job; each worker also ends itself (SIGALRM) after this
# torchrun shares its rendezvous store with the workers' init_process_group by default, and
# restarted workers then may read the killed attempt's gloo addresses from it: in torch 2.13
# alone, MEMGATHER unset, most restarts failed ("Gloo connectFullMesh failed ... Connection
# refused") or hung (pytorch/pytorch#135712). torch's opt-out gives every attempt a store of its own.
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _environment(env: Dict[str, str]) -> Dict[str, str]:
    """This process's environment without MEMGATHER settings (TORCH_DISTRIBUTED_DEBUG passes), plus ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATHER")}
    clean.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RESTART_JOB_LIMIT_S": str(LIMIT_S), **env})
    return clean


def _run_all(commands: List[List[str]], env: Dict[str, str]) -> List[Tuple[int, str]]:
    """Run ``commands`` side by side to their end; each one's exit code and output.

    Each starts in a session of its own, and whatever is still alive when the bounded
    wait ends is stopped: SIGTERM first (torchrun then stops its workers), then SIGKILL.
    """
    procs = [subprocess.Popen(command, env=_environment(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for command in commands]
    deadline = time.monotonic() + LIMIT_S
    done: List[Tuple[int, str]] = []
    try:
        for proc in procs:
            output = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            done.append((proc.returncode, output))
    finally:
        for proc in procs:
            _stop(proc)
    return done


def _stop(proc: "subprocess.Popen[str]") -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _report_lines(output: str) -> List[Tuple[int, Report]]:
    """Every MEMGATHER_REPORT line of ``output``, in order (a rank may report once per attempt)."""
    return [item for line in output.splitlines() for item in reports(line).items()]


def _load(path: Path) -> Dict[str, Any]:
    assert path.exists(), f"{path.name} was not written"
    return json.loads(path.read_text())


def _assert_correct(results: List[Dict[str, Any]], names: Tuple[str, ...], where: str) -> None:
    assert [r["pattern"] for r in results] == list(names), where
    assert all(r["correct"] for r in results), f"{where}: wrong gathered values: {results}"


def _assert_patched_by_pth(state: Dict[str, Any], where: str) -> None:
    assert state["patched"] and state["through_pth"] and state["wrapper"] == "MemgatherWrapper", (where, state)


# --- torchrun --max-restarts 1, one worker SIGKILLed mid-job ---------------------------------


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The torchrun job, run once for this module's tests: its exit code, output and files."""
    out = tmp_path_factory.mktemp("restart")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.1", str(JOB), "torchrun", str(out)]
    [(code, output)] = _run_all([command], {**ON, **FRESH_STORE})
    return {"code": code, "output": output, "files": {p.stem: p for p in out.glob("*.json")}}


def test_torchrun_restart_finishes_with_correct_results(restarted: Dict[str, Any]) -> None:
    assert restarted["code"] == 0, restarted["output"][-6000:]
    assert sorted(restarted["files"]) == ["attempt0_rank0", "attempt0_rank1", "attempt1_rank0", "attempt1_rank1"]
    for rank in (0, 1):
        record = _load(restarted["files"][f"attempt1_rank{rank}"])
        assert (record["attempt"], record["rank"], record["world"]) == (1, rank, 2)
        _assert_correct(record["results"], ATTEMPT_PATTERNS[1], f"attempt 1 rank {rank}")


def test_both_attempts_patched_through_the_pth_and_rewired(restarted: Dict[str, Any]) -> None:
    for attempt in (0, 1):
        calls = len(ATTEMPT_PATTERNS[attempt])
        for rank in (0, 1):
            record = _load(restarted["files"][f"attempt{attempt}_rank{rank}"])
            where = f"attempt {attempt} rank {rank}"
            _assert_patched_by_pth(record["before"], where)
            _assert_correct(record["results"], ATTEMPT_PATTERNS[attempt], where)
            assert record["after"]["calls"] == calls and record["after"]["rewired"] == calls, (where, record["after"])


def test_restarted_workers_start_with_nothing_cached(restarted: Dict[str, Any]) -> None:
    first = {_load(restarted["files"][f"attempt0_rank{r}"])["pid"] for r in (0, 1)}
    for rank in (0, 1):
        record = _load(restarted["files"][f"attempt1_rank{rank}"])
        assert record["pid"] not in first  # new processes: nothing in-process could carry over
        before, after = record["before"], record["after"]
        assert before["calls"] == 0 and before["cache_entries"] == 0 and before["known_world"] is None, before
        # What memgather knows afterwards is the restarted group, as this worker sees it.
        assert after["cache_live"] == [[2, rank, "gloo", None]] and after["cache_live_other"] == 0, after
        assert after["known_world"] == [2, rank, "gloo", None], after


def test_report_lines_of_the_restart(restarted: Dict[str, Any]) -> None:
    lines = _report_lines(restarted["output"])
    restart = sorted((rank, r) for rank, r in lines if r.calls == len(ATTEMPT_PATTERNS[1]))
    assert [rank for rank, _ in restart] == [0, 1], restarted["output"][-4000:]
    assert all(r.rewired == r.calls for _, r in restart), [r.line for _, r in restart]
    # Rank 1 of attempt 0 died by SIGKILL, so no exit report: its only line is the restart's.
    assert [r.calls for rank, r in lines if rank == 1] == [len(ATTEMPT_PATTERNS[1])], [r.line for _, r in lines]


# --- destroy_process_group(), then init_process_group() in the same process -----------------


Reinit = Tuple[List[Dict[str, Any]], List[str]]  # each process's record, and its output


def _reinit(tmp: Path, env: Dict[str, str]) -> Reinit:
    """The 3-process reinit job (see tests/restart_job.py); every process must exit 0."""
    port_a, port_b = free_port(), free_port()
    commands = [[sys.executable, str(JOB), "reinit", str(tmp), str(i), str(port_a), str(port_b)] for i in range(3)]
    done = _run_all(commands, env)
    for index, (code, output) in enumerate(done):
        assert code == 0, f"process {index} exited {code}:\n{output[-4000:]}"
    return [_load(tmp / f"reinit{i}.json") for i in range(3)], [output for _, output in done]


@pytest.fixture(scope="module")
def reinit_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Reinit]:
    """The reinit job under torch alone ("torch") or with MEMGATHER=1 ("memgather"), each run once."""
    runs: Dict[str, Reinit] = {}

    def run(mode: str) -> Reinit:
        if mode not in runs:
            runs[mode] = _reinit(tmp_path_factory.mktemp(f"reinit-{mode}"), ON if mode == "memgather" else {})
        return runs[mode]

    return run


@pytest.fixture
def reinit_on(reinit_runs: Callable[[str], Reinit]) -> Reinit:
    return reinit_runs("memgather")


@pytest.mark.parametrize("mode", ["torch", "memgather"])
def test_destroy_then_init_gathers_correctly_and_frees_the_old_group(reinit_runs: Callable[[str], Reinit],
                                                                      mode: str) -> None:
    records, _ = reinit_runs(mode)
    for record in records:
        where = f"{mode}, process {record['index']}"
        _assert_correct(record["a"]["results"], PHASE_PATTERNS["a"], where)
        # Under torch alone the destroyed group is freed; memgather must not keep it alive.
        assert record["old_group_dead"], where
        if record["index"] in PHASE_B_RANK:
            assert record["b"]["rank"] == PHASE_B_RANK[record["index"]]
            _assert_correct(record["b"]["results"], PHASE_PATTERNS["b"], where)
        else:
            assert "b" not in record


def test_reinit_rewires_on_both_groups(reinit_on: Reinit) -> None:
    records, _ = reinit_on
    first = len(PHASE_PATTERNS["a"])
    for record in records:
        where = f"process {record['index']}"
        _assert_patched_by_pth(record["a"]["state"], where)
        assert record["a"]["state"]["rewired"] == first == record["a"]["state"]["calls"], where
        if "b" in record:
            state = record["b"]["state"]
            total = first + len(PHASE_PATTERNS["b"])
            assert state["calls"] == total and state["rewired"] == total, (where, state)


def test_no_group_information_outlives_its_group(reinit_on: Reinit) -> None:
    records, _ = reinit_on
    for record in records:
        where = f"process {record['index']}"
        assert record["a"]["state"]["known_world"] == [3, record["index"], "gloo", None], where
        # Destroyed: nothing of the old group is left in the cache, not even a dead entry.
        assert record["after_destroy"]["cache_entries"] == 0, (where, record["after_destroy"])
        assert record["after_destroy"]["known_world"] is None, where
        if "b" in record:
            rank = record["b"]["rank"]
            # The new group, before its first gather, is unknown: no entry can be taken for it.
            assert record["b"]["before"]["cache_entries"] == 0 and record["b"]["before"]["known_world"] is None, where
            state = record["b"]["state"]
            assert state["known_world"] == [2, rank, "gloo", None], (where, state)
            assert state["cache_live"] == [[2, rank, "gloo", None]] and state["cache_entries"] == 1, (where, state)


def test_exit_report_names_the_rank_of_the_latest_group(reinit_on: Reinit) -> None:
    records, outputs = reinit_on
    for record, output in zip(records, outputs):
        rank = record["b"]["rank"] if "b" in record else record["index"]
        calls = record["b"]["state"]["calls"] if "b" in record else record["a"]["state"]["calls"]
        lines = _report_lines(output)
        assert [(r, report.calls, report.rewired) for r, report in lines] == [(rank, calls, calls)], output[-3000:]
