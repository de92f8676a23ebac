"""Running tests/venv_job/job.py: a 2-process gloo job memgather joins only through memgather.pth."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict

JOB = Path(__file__).resolve().parent / "venv_job"


def environment(**env: str) -> Dict[str, str]:
    """This process's environment without any MEMGATHER setting, plus ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATHER")}
    clean.update(env)
    return clean


def launch(python: Path, **env: str) -> "subprocess.CompletedProcess[str]":
    """The job, run to its end by ``python`` with ``env`` (and no other MEMGATHER setting)."""
    return subprocess.run([str(python), str(JOB / "job.py")], capture_output=True, text=True, env=environment(**env),
                          cwd=JOB, timeout=300)


def run_job(python: Path, **env: str) -> Any:
    """The job's per-rank results (see ``launch``); it must succeed."""
    done = launch(python, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
