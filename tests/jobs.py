"""Running tests/venv_job/job.py: a 2-process gloo job memgather joins only through memgather.pth."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

JOB = Path(__file__).resolve().parent / "venv_job"


def run_job(python: Path, **env: str) -> Any:
    """The job's per-rank results, run by ``python`` with ``env`` (and no other MEMGATHER setting)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATHER")}
    clean.update(env)
    done = subprocess.run([str(python), str(JOB / "job.py")], capture_output=True, text=True, env=clean, cwd=JOB, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
