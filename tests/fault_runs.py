"""Faults applied one at a time to a copy of the working tree, each run against a test selection.

``tests/takeover_faults.py`` and ``tests/proof_faults.py`` each name their faults (the module under
``memgather/patching/``, a label, the rule's text, what the fault puts in its place) and the tests
that should hold them; a fault those tests let pass is a rule no test holds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
Fault = Tuple[str, str, str, str]


def run(faults: Sequence[Fault], tests: Sequence[str], labels: Sequence[str]) -> List[Tuple[str, bool]]:
    """Each fault (those named in ``labels``, or all) applied alone; whether a test failed on it."""
    outcomes = []
    for module, label, rule, fault in faults:
        if labels and label not in labels:
            continue
        with tempfile.TemporaryDirectory() as folder:
            tree = Path(folder) / "tree"
            shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".tox", ".venv", ".git", "__pycache__", ".hypothesis"))
            path = tree / "memgather" / "patching" / f"{module}.py"
            text = path.read_text()
            if text.count(rule) != 1:
                print(f"{label}: its rule is not in {module}.py as written here (found {text.count(rule)} times)")
                outcomes.append((label, False))
                continue
            path.write_text(text.replace(rule, fault))
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True,
                                  timeout=900)
            held = done.returncode != 0
            print(f"{label}: {'held (a test fails)' if held else 'NOT HELD'} in {time.monotonic() - started:.0f} s",
                  flush=True)
            outcomes.append((label, held))
    return outcomes


def main(faults: Sequence[Fault], tests: Sequence[str]) -> None:
    results = run(faults, tests, sys.argv[1:])
    print(f"{sum(held for _, held in results)} of {len(results)} faults held by a test")
