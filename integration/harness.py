"""Run an integration job under torchrun, unpatched or with memgather on, and read it back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

JOB = Path(__file__).resolve().parent / "job.py"
# MEMGATHER_REPORT's line: "[memgather rank 1] memgather: 5 calls, 3 rewired (...) ...; verified 3"
_REPORT = re.compile(r"\[memgather rank (\d+)\] memgather: (\d+) calls, (\d+) rewired \(([^)]*)\)"
                     r".*?(?:; elided (\d+))?(?:; verified (\d+))?$")


@dataclass
class Report:
    """One rank's memgather statistics, as MEMGATHER_REPORT wrote them at exit."""

    calls: int
    rewired: int
    strategies: Dict[str, int]
    verified: int
    elided: int  # cats / stacks that returned the gathered buffer
    line: str


@dataclass
class Run:
    results: List[Any]  # per rank, what job.py wrote
    reports: Dict[int, Report]  # per rank; empty when memgather was off
    output: str


def launch(library: str, out_dir: Path, env: Optional[Dict[str, str]] = None, world: int = 2,
           timeout: int = 600) -> Run:
    """``torchrun --standalone --nproc_per_node world job.py library`` with ``env`` added."""
    out_dir.mkdir(parents=True, exist_ok=True)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATHER")}
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
         str(JOB), library, str(out_dir)],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise AssertionError(f"{library} job failed (exit {done.returncode}):\n{output[-6000:]}")
    results = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]
    return Run(results, reports(output), output)


def reports(output: str) -> Dict[int, Report]:
    reports = {}
    for line in output.splitlines():
        match = _REPORT.search(line.strip())
        if match:
            rank, calls, rewired, strategies, elided, verified = match.groups()
            counts = dict(part.split("=") for part in strategies.split(", ") if "=" in part)
            reports[int(rank)] = Report(int(calls), int(rewired), {k: int(v) for k, v in counts.items()},
                                        int(verified or 0), int(elided or 0), line.strip())
    return reports


ON = {"MEMGATHER": "1", "MEMGATHER_REPORT": "all"}
# Every call memgather could rewire, small ones included, each checked against torch.
VERIFY = {**ON, "MEMGATHER_VERIFY": "1", "MEMGATHER_GLOO_MIN_BYTES": "0"}
# Every call rewired, small ones included, and cat elision forced on for all of them
# (issue 12, item 5: code whose slots or input require grad, or that edits the list).
ELIDE_ALL = {**ON, "MEMGATHER_ELIDE": "1", "MEMGATHER_GLOO_MIN_BYTES": "0"}


def compare(library: str, tmp: Path, world: int = 2, modes: Optional[Dict[str, Dict[str, str]]] = None) -> Dict[str, Run]:
    """The job unpatched, then once per memgather mode (``modes``: name -> environment).

    ``modes`` defaults to ``{"memgather": ON, "verify": VERIFY}``: with MEMGATHER=1, and in
    verify mode with every call rewired. Asserts that every run gives results identical
    to the unpatched one on every rank, that memgather reported on every rank of each
    memgather run, and that each verify-mode run checked every call it rewired. Returns
    the runs, the unpatched one as "torch", for library-specific assertions.
    """
    modes = {"memgather": ON, "verify": VERIFY} if modes is None else modes
    runs = {"torch": launch(library, tmp / "torch", world=world)}
    for mode, env in modes.items():
        runs[mode] = launch(library, tmp / mode, env, world)
    assert not runs["torch"].reports, "memgather reported in the unpatched run"
    for mode, env in modes.items():
        assert runs[mode].results == runs["torch"].results, f"{mode} results differ from torch's"
        assert sorted(runs[mode].reports) == list(range(world)), runs[mode].output[-3000:]
        if env.get("MEMGATHER_VERIFY") == "1":
            for report in runs[mode].reports.values():
                assert report.verified == report.rewired > 0, report.line
    return runs


def memory_growth(library: str, tmp: Path, mib: int, path: Optional[str] = None,
                  env: Optional[Dict[str, str]] = None) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """Per rank, (unpatched, MEMGATHER=1) peak RSS growth of one gather of ``mib`` MiB per rank
    through LIBRARY's call path ``path`` (job.py ``memory_paths``; None: its first), ``env``
    added to the MEMGATHER=1 run. Every rank must have gathered correctly, and between them
    the ranks must have checked every rank's piece. The MEMGATHER=1 run's dicts also hold
    the rank's MEMGATHER_REPORT line ("report")."""
    base = {"MEMGATHER_JOB_MIB": str(mib), **({"MEMGATHER_JOB_PATH": path} if path else {})}
    out = tmp / re.sub(r"[^\w.]+", "_", path or "default")
    theirs = launch(f"{library}-memory", out / "torch", base).results
    run = launch(f"{library}-memory", out / "memgather", {**base, **ON, **(env or {})})
    ours = [{**result, "report": run.reports[rank].line if rank in run.reports else None}
            for rank, result in enumerate(run.results)]
    for results in (theirs, ours):
        assert all(rank["correct"] for rank in results), results
        assert sorted({piece for rank in results for piece in rank["checked"]}) == list(range(len(results))), results
    return list(zip(theirs, ours))


def proof_verdicts(top: str) -> Dict[str, Any]:
    """The elision proof's verdict on every all_gather call site of the installed package ``top``
    (read from its files, as ``memgather doctor`` lists them), keyed ``module:qualname``."""
    from memgather.patching import callsites

    found, note = callsites.of_package(top)
    assert not note, note
    for site in found:  # shown with -s, and in a failure's captured output
        print(f"{site.name} ({site.role}): {'proven' if site.verdict.proven else 'not proven'}: {site.verdict.reason}")
    return {f"{site.module}:{site.qualname}": site.verdict for site in found}
