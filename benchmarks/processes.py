"""Ranks run side by side as processes, bounded in time, with every rank's output kept.

A rank that fails leaves the others waiting in a collective it never joins, and a rank
that writes much to a pipe nobody reads blocks. So each rank writes to files, all are
waited for together, and once one has failed the rest get ``grace_s`` to finish before
they are killed: the failure is reported at once, with what every rank printed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence


class Finished(NamedTuple):
    """One rank's end: its exit status (None: killed at the deadline or after another's failure)."""

    returncode: Optional[int]
    stdout: str
    stderr: str


def run(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Dict[str, str]],
    timeout_s: float,
    grace_s: float = 15.0,
    cwd: Optional[str] = None,
) -> List[Finished]:
    """Run ``commands[i]`` with ``envs[i]`` side by side; each one's end, in order."""
    folder = tempfile.mkdtemp(prefix="memgather-ranks-")
    try:
        ends = _wait(commands, envs, timeout_s, grace_s, cwd, folder)
        finished = []
        for index, end in enumerate(ends):
            with (
                open(os.path.join(folder, f"{index}.out"), errors="replace") as out,
                open(os.path.join(folder, f"{index}.err"), errors="replace") as err,
            ):
                finished.append(Finished(end, out.read(), err.read()))
        return finished
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Dict[str, str]],
    timeout_s: float,
    grace_s: float,
    cwd: Optional[str],
    folder: str,
) -> List[Optional[int]]:
    """Start every rank, its output to ``folder``; each one's exit status when the last ended, the
    deadline passed or ``grace_s`` passed after the first failure (None: still running then). No
    process of theirs outlives the call."""
    procs: List[subprocess.Popen] = []
    try:
        for index, (command, env) in enumerate(zip(commands, envs)):
            with (
                open(os.path.join(folder, f"{index}.out"), "w") as out,
                open(os.path.join(folder, f"{index}.err"), "w") as err,
            ):
                # A session of its own: what a rank started is killed with it (killpg).
                procs.append(
                    subprocess.Popen(list(command), stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True)
                )
        deadline = time.monotonic() + timeout_s
        failed_at: Optional[float] = None
        while [proc.poll() for proc in procs].count(None):  # every one polled: any() would stop at the first
            now = time.monotonic()
            if failed_at is None and any(proc.returncode not in (None, 0) for proc in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > grace_s):
                break
            time.sleep(0.05)
        return [proc.poll() for proc in procs]
    finally:
        for proc in procs:
            _kill_session(proc)
            proc.wait()


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill what is left of ``proc``'s session: the rank, and any process it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def spawned(rank_main: Callable[..., Any], world: int, *args: Any) -> List[Any]:
    """``rank_main(rank, world, store, *args)`` on ``world`` ranks spawned by torch.multiprocessing,
    ``store`` a file for their process group's ``init_method="file://..."``; what each returned (a
    Python literal: numbers, strings, lists, dicts), in rank order."""
    import ast

    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp(prefix="memgather-spawned-")
    try:
        outs = [os.path.join(folder, f"rank{rank}") for rank in range(world)]
        store = os.path.join(folder, "store")
        mp.start_processes(
            _spawned_rank, args=(rank_main, world, store, outs, args), nprocs=world, start_method="spawn"
        )
        answers = []
        for path in outs:
            with open(path) as file:
                answers.append(ast.literal_eval(file.read()))
        return answers
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _spawned_rank(
    rank: int, rank_main: Callable[..., Any], world: int, store: str, outs: List[str], args: Sequence[Any]
) -> None:
    answer = rank_main(rank, world, store, *args)
    with open(outs[rank], "w") as file:
        file.write(repr(answer))
