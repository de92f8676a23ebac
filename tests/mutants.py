"""mutmut's mutants of one module, each run against a test selection in a copy of the tree.

    python -m tests.mutants memgather/engine/elision.py [--lines 132,135 | --lines 305-] -- tests/test_elision.py

mutmut's own runner (2.5.1) keeps its results in a cache whose rows for some lines of
``engine/elision.py`` go missing (it stops with "Attribute Mutant.line is required"), so this
lists the mutants with mutmut's own engine (``mutmut.list_mutations`` / ``mutate``: the same
operators, the same mutants), writes each in turn into a copy of the tree (the working tree
is never touched), runs ``pytest -x`` on the tests given, and prints one line per mutant:
``killed`` or ``SURVIVED``, the line, the code before and after. docs/elision.md says which
survivors cannot change what memgather does, and why. About 10 s a mutant on 2 cores with
tests/test_elision.py and tests/test_cow.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional

ROOT = Path(__file__).resolve().parent.parent


def _lines(spec: Optional[str]) -> Callable[[int], bool]:
    if not spec:
        return lambda line: True
    if spec.endswith("-"):
        first = int(spec[:-1])
        return lambda line: line >= first
    chosen = {int(part) for part in spec.split(",")}
    return lambda line: line in chosen


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tests = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", help="the file to mutate, relative to the repository")
    parser.add_argument("--lines", help="only these lines (132,135) or from one on (305-)")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not tests:
        parser.error("name the tests to run after --")
    from mutmut import Context, list_mutations, mutate

    source = (ROOT / args.module).read_text()
    wanted = _lines(args.lines)
    mutants = [m for m in list_mutations(Context(source=source, filename=args.module)) if wanted(m.line_number + 1)]
    copy = Path(tempfile.mkdtemp(prefix="memgather-mutants-"))
    survived = 0
    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        for name in filter(None, tracked.decode().split("\0")):
            target = copy / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / name).is_file():
                shutil.copy2(ROOT / name, target)
        path = copy / args.module
        print(f"{args.module}: {len(mutants)} mutants", flush=True)
        for mutant in mutants:
            mutated, count = mutate(Context(source=source, mutation_id=mutant, filename=args.module))
            if count != 1:
                continue
            path.write_text(mutated)
            started = time.time()
            try:
                done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                      cwd=copy, env=dict(os.environ, PYTHONPATH=str(copy)), capture_output=True,
                                      timeout=900)
                status = "killed" if done.returncode else "SURVIVED"
            except subprocess.TimeoutExpired:
                status = "killed (timeout)"
            finally:
                path.write_text(source)
            survived += status == "SURVIVED"
            before = source.splitlines()[mutant.line_number].strip()
            after_lines = mutated.splitlines()
            after = after_lines[mutant.line_number].strip() if mutant.line_number < len(after_lines) else "(removed)"
            print(f"{status}\tline {mutant.line_number + 1}\t{time.time() - started:.0f} s\t{before}\t=>\t{after}",
                  flush=True)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    print(f"{survived} of {len(mutants)} survived", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
