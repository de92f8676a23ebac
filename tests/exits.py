"""How often a 2-rank gloo torchrun job dies at exit, with torch alone and with memgather.

A torchrun job whose workers end without ``dist.destroy_process_group()``
sometimes aborts at exit (``terminate called without an active exception``,
SIGABRT) after its work and report lines are done, and torchrun reports the job
as failed. This command runs one job N times per mode, the modes alternating
run by run, each run bounded by a timeout (its whole process group is killed
past it), and prints one table of what the runs' exits were:

    python -m tests.exits [--runs N] [--job plain|accelerate] [--python PATH]

Modes:

- ``torch``: every ``MEMGATHER*`` variable removed (memgather.pth stays inert);
- ``memgather``: ``MEMGATHER=1 MEMGATHER_VERIFY=1 MEMGATHER_REPORT=all
  MEMGATHER_GLOO_MIN_BYTES=0`` and ``MEMGATHER_TARGETS`` covering the job's
  gathers, so that memgather rewires and verifies every call and writes its
  report line at exit;
- with ``--destroy`` (``plain`` only) the same two with ``EXITS_JOB_DESTROY=1``:
  the job calls ``dist.destroy_process_group()`` before it ends (the workaround).

Jobs:

- ``plain``: tests/exits_job.py, 10 gathers of 2 MiB per rank through
  memgather's benchmark patterns, then an exit without ``destroy_process_group``;
  each rank prints ``[exits-job rank R] done`` when its work is done;
- ``accelerate``: accelerate's shipped ``test_utils/scripts/test_script.py``,
  unedited, on CPU (``ACCELERATE_USE_CPU=1``: gloo), by the ``--python`` that
  has accelerate (default ``.tox/accelerate/bin/python``); its work is done when
  rank 0 printed the script's last heading.

Both run as ``PYTHON -m torch.distributed.run --standalone --nproc_per_node 2
JOB``. A worker's exit is read from torchrun: all 0 when torchrun exits 0,
otherwise each failed worker's ``exitcode`` from torchrun's failure table
(``-6``: SIGABRT; ``-15``: SIGTERM, which torchrun sends to the workers still
running once one failed, so that worker's own end is unknown).

Columns: ``runs``; ``torchrun 0``: runs torchrun ended with 0; ``exits``:
worker exits (2 per run); ``exit 0``; ``SIGABRT``: worker exits by signal 6;
``terminate``: "terminate called without an active exception" lines in the
output; ``SIGTERM``: workers torchrun stopped after a peer failed;
``other``: other non-zero worker exits, runs past the timeout, and failed runs
without a failure table; ``work done``: ranks that printed their done line
(plain) or runs whose rank 0 printed the last heading (accelerate);
``reports``: memgather report lines.

``--logs DIR`` keeps the output of every run that did not end 0.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
PLAIN_JOB = Path(__file__).resolve().parent / "exits_job.py"
ACCELERATE_PYTHON = ROOT / ".tox" / "accelerate" / "bin" / "python"
WORLD = 2

TERMINATE = "terminate called without an active exception"
ACCELERATE_LAST_HEADING = "**Test reinstantiated state**"
# torchrun's failure table (torch.distributed.elastic.multiprocessing.errors):
#   rank      : 1 (local_rank: 1)
#   exitcode  : -6 (pid: 8310)  (SIGABRT)
_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
_DONE = re.compile(r"\[exits-job rank (\d+)\] done")
_REPORT = re.compile(r"\[memgather rank (\d+)\] memgather: ")

MEMGATHER_ON = {"MEMGATHER": "1", "MEMGATHER_VERIFY": "1", "MEMGATHER_REPORT": "all", "MEMGATHER_GLOO_MIN_BYTES": "0"}
TARGETS = {"plain": "memgather_bench_patterns", "accelerate": "*"}


@dataclass
class Outcome:
    """One run, as read from torchrun's exit status and the job's output."""

    returncode: Optional[int]  # None: killed past the timeout
    seconds: float
    exits: Dict[int, int]  # rank -> exit code, for the ranks torchrun named (all 0 when it ended 0)
    terminate_lines: int
    work_done: int
    reports: int
    output: str


@dataclass
class Tally:
    runs: int = 0
    torchrun_ok: int = 0
    exits: int = 0
    exit_codes: Counter = field(default_factory=Counter)
    terminate_lines: int = 0
    other: int = 0
    work_done: int = 0
    reports: int = 0
    seconds: float = 0.0

    def add(self, outcome: Outcome) -> None:
        self.runs += 1
        self.exits += WORLD
        self.seconds += outcome.seconds
        self.terminate_lines += outcome.terminate_lines
        self.work_done += outcome.work_done
        self.reports += outcome.reports
        if outcome.returncode == 0:
            self.torchrun_ok += 1
        if outcome.returncode is None:  # past the timeout: no worker's end is known
            self.other += WORLD
            return
        if not outcome.exits:  # torchrun failed without naming a worker
            self.other += WORLD
        for code in outcome.exits.values():
            self.exit_codes[code] += 1
            self.other += code not in (0, -6, -15)


def parse(output: str, returncode: Optional[int], job: str) -> Tuple[Dict[int, int], int, int, int]:
    """(rank -> exit code, terminate lines, work done, report lines) of one run's output."""
    exits: Dict[int, int] = {}
    if returncode == 0:
        exits = {rank: 0 for rank in range(WORLD)}
    elif returncode is not None:
        for rank, code, _pid in _FAILURE.findall(output):
            exits[int(rank)] = int(code)
        if exits:  # the workers torchrun did not name ended 0 before it noticed the failure
            for rank in range(WORLD):
                exits.setdefault(rank, 0)
    if job == "plain":
        done = len(set(_DONE.findall(output)))
    else:
        done = int(ACCELERATE_LAST_HEADING in output)
    return exits, output.count(TERMINATE), done, len(set(_REPORT.findall(output)))


def job_command(job: str, python: str) -> List[str]:
    if job == "plain":
        script = str(PLAIN_JOB)
    else:
        found = subprocess.run(
            [python, "-c", "import accelerate.test_utils as t, os;"
                           "print(os.path.join(os.path.dirname(t.__file__), 'scripts', 'test_script.py'))"],
            capture_output=True, text=True, timeout=300, env=clean_environment({}),
        )
        if found.returncode != 0:
            raise SystemExit(f"{python} has no accelerate:\n{found.stderr[-2000:]}")
        script = found.stdout.strip()
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD), script]


def clean_environment(extra: Dict[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMGATHER", "EXITS_JOB"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def modes(job: str, destroy: bool, targets: Optional[str]) -> Dict[str, Dict[str, str]]:
    on = {**MEMGATHER_ON, "MEMGATHER_TARGETS": targets or TARGETS[job]}
    found = {"torch": {}, "memgather": on}
    if destroy:
        found.update({"torch+destroy": {"EXITS_JOB_DESTROY": "1"},
                      "memgather+destroy": {**on, "EXITS_JOB_DESTROY": "1"}})
    return found


def run_once(command: Sequence[str], env: Dict[str, str], job: str, timeout_s: float, nice: int) -> Outcome:
    """One torchrun job in a session of its own, killed as a whole past ``timeout_s``."""
    started = time.monotonic()
    with subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        env=env, cwd=str(ROOT), start_new_session=True, preexec_fn=(lambda: os.nice(nice)) if nice else None,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            returncode: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            output, _ = proc.communicate()
            returncode = None
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    exits, terminate, done, reports = parse(output, returncode, job)
    return Outcome(returncode, time.monotonic() - started, exits, terminate, done, reports, output)


def _kill_group(proc: "subprocess.Popen[str]") -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def table(tallies: Dict[str, Tally], job: str) -> str:
    done_unit = "ranks" if job == "plain" else "runs"
    head = ("mode", "runs", "torchrun 0", "exits", "exit 0", "SIGABRT", "terminate", "SIGTERM", "other",
            f"work done ({done_unit})", "reports", "s/run")
    rows = [head]
    for name, t in tallies.items():
        rows.append((name, str(t.runs), str(t.torchrun_ok), str(t.exits), str(t.exit_codes[0]), str(t.exit_codes[-6]),
                     str(t.terminate_lines), str(t.exit_codes[-15]), str(t.other), str(t.work_done), str(t.reports),
                     f"{t.seconds / max(t.runs, 1):.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.exits", description=__doc__.split("\n\n")[0],
        epilog="Modes alternate run by run; see the module docstring for the columns.",
    )
    parser.add_argument("--runs", type=int, default=10, help="runs per mode (default 10)")
    parser.add_argument("--job", choices=("plain", "accelerate"), default="plain")
    parser.add_argument("--python", help="the interpreter that runs torchrun and the job (default: this one for "
                                         f"plain, {ACCELERATE_PYTHON.relative_to(ROOT)} for accelerate)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before its process group "
                                                                     "is killed (default 300)")
    parser.add_argument("--targets", help="MEMGATHER_TARGETS of the memgather mode (default: "
                                          "memgather_bench_patterns for plain, * for accelerate)")
    parser.add_argument("--destroy", action="store_true", help="plain only: also both modes with "
                                                               "dist.destroy_process_group() before the end")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="set KEY in the memgather modes (an empty VALUE removes it), e.g. MEMGATHER_VERIFY=")
    parser.add_argument("--tree", action="store_true", help="put this checkout first on PYTHONPATH, so that the "
                                                            "workers run its memgather, not PYTHON's installed one")
    parser.add_argument("--nice", type=int, default=0, help="niceness added to each run (default 0)")
    parser.add_argument("--logs", type=Path, help="keep here the output of every run that did not end 0")
    args = parser.parse_args(argv)
    if args.destroy and args.job != "plain":
        parser.error("--destroy is for --job plain")
    python = args.python or (sys.executable if args.job == "plain" else str(ACCELERATE_PYTHON))
    command = job_command(args.job, python)
    extra: Dict[str, str] = {}
    if args.job == "accelerate":
        extra["ACCELERATE_USE_CPU"] = "1"
    if args.tree:
        extra["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # from the job's directory, which is where a worker's sys.path starts
    where = subprocess.run([python, "-c", "import memgather, torch; print(memgather.__file__, torch.__version__)"],
                           capture_output=True, text=True, timeout=300, env=clean_environment(extra),
                           cwd=os.path.dirname(command[-1]))
    print(f"job {args.job}: {' '.join(command)}")
    print(f"memgather, torch: {where.stdout.strip() or where.stderr.strip()[-300:]}")
    all_modes = modes(args.job, args.destroy, args.targets)
    for setting in args.set:
        key, sep, value = setting.partition("=")
        if not sep:
            parser.error(f"--set {setting}: KEY=VALUE expected")
        for name, env in all_modes.items():
            if not name.startswith("memgather"):
                continue
            if value:
                env[key] = value
            else:
                env.pop(key, None)
    for name, env in all_modes.items():
        print(f"mode {name}: {' '.join(f'{k}={v}' for k, v in env.items()) or '(no MEMGATHER variable)'}")
    sys.stdout.flush()
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    tallies = {name: Tally() for name in all_modes}
    for index in range(args.runs):
        for name, env in all_modes.items():
            outcome = run_once(command, clean_environment({**extra, **env}), args.job, args.timeout, args.nice)
            tallies[name].add(outcome)
            if outcome.returncode != 0:
                codes = dict(sorted(outcome.exits.items())) if outcome.returncode is not None else "timeout"
                print(f"run {index + 1} {name}: torchrun {outcome.returncode}, workers {codes}, "
                      f"{outcome.terminate_lines} terminate line(s), work done {outcome.work_done}", flush=True)
                if args.logs:
                    (args.logs / f"{args.job}-{name}-{index + 1}.txt").write_text(outcome.output)
        if (index + 1) % 10 == 0 or index + 1 == args.runs:
            print(f"-- {index + 1} of {args.runs} runs per mode", flush=True)
    print(table(tallies, args.job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
