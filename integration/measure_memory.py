"""Peak RSS growth of one gather through each of a library's call paths, unpatched vs MEMGATHER=1.

The figures of docs/libraries.md. Run with an environment that has the library, e.g. a tox one:
``.tox/accelerate-0.23/bin/python -m integration.measure_memory accelerate 196 [--record accelerate-0.23]``

LIBRARY is job.py's name for it (``pytorch_metric_learning``, ``open_clip``, ...). Every
path of ``memory_paths`` is measured (job.py, or ``job_<library>.py``), each on its own
pair of torchrun jobs. ``--record ENV`` writes the figures to ``integration/figures.json``
under ENV, the tox environment that ran them (the one whose python runs this): per path, on the
rank where memgather saves least, the peak growth as a multiple of the gathered size,
unpatched ("torch") and with MEMGATHER=1 ("memgather"), and the ratio of the two ("ratio").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Tuple

from integration.harness import memory_growth

FIGURES = Path(__file__).resolve().parent / "figures.json"
# job.py's library name -> its distribution, where they differ.
DISTRIBUTIONS = {"open_clip": "open_clip_torch", "pytorch_metric_learning": "pytorch-metric-learning",
                 "ignite": "pytorch-ignite"}
# What the MEMGATHER=1 run needs besides MEMGATHER=1: a library that is not a built-in target.
MEMGATHER_ENV = {"pytorch_metric_learning": {"MEMGATHER_TARGETS": "pytorch_metric_learning"}}

Pairs = List[Tuple[Dict[str, Any], Dict[str, Any]]]


def measure(library: str, mib: int) -> Dict[str, Pairs]:
    """Per path, in memory_paths' order, memory_growth's (unpatched, MEMGATHER=1) per rank."""
    env = MEMGATHER_ENV.get(library)
    with tempfile.TemporaryDirectory() as tmp:
        first = memory_growth(library, Path(tmp), mib, env=env)  # the default path, which names them all
        paths: List[str] = first[0][0]["paths"]
        out = {paths[0]: first}
        for path in paths[1:]:
            out[path] = memory_growth(library, Path(tmp), mib, path=path, env=env)
    return out


def figures(pairs: Pairs) -> Dict[str, float]:
    """The rank where memgather saves least (the highest ratio; ranks differ where their lengths
    do): its peak growth / gathered size unpatched and with memgather, and the ratio."""
    a, b = max(pairs, key=lambda pair: pair[1]["growth"] / pair[0]["growth"])
    return {
        "torch": round(a["growth"] / a["gathered"], 3),
        "memgather": round(b["growth"] / b["gathered"], 3),
        "ratio": round(b["growth"] / a["growth"], 3),
    }


def record(env: str, entry: Dict[str, Any]) -> None:
    data = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    data[env] = entry
    FIGURES.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m integration.measure_memory", description=__doc__.split("\n")[0])
    parser.add_argument("library", help="job.py's library name, e.g. accelerate, pytorch_metric_learning")
    parser.add_argument("mib", nargs="?", type=int, default=196, help="MiB of float32 per rank (default 196)")
    parser.add_argument("--record", metavar="ENV", help="write the figures to integration/figures.json under ENV")
    args = parser.parse_args()
    if args.record and Path(sys.prefix).name != args.record:
        parser.error(f"--record {args.record}: this python is {sys.prefix}'s, not the tox environment's")
    distribution = metadata.metadata(DISTRIBUTIONS.get(args.library, args.library))["Name"]
    version, torch_version = metadata.version(distribution), metadata.version("torch")
    started = time.monotonic()
    measured = measure(args.library, args.mib)
    print(f"{args.library} ({distribution} {version}), torch {torch_version}, gloo, 2 ranks, "
          f"gather of {args.mib} MiB float32 per rank; {time.monotonic() - started:.0f} s")
    for path, pairs in measured.items():
        for rank, (a, b) in enumerate(pairs):
            print(f"{path}: rank {rank}: peak RSS growth unpatched {a['growth'] / 2**20:.0f} MiB "
                  f"({a['growth'] / a['gathered']:.3f} x gathered), MEMGATHER=1 {b['growth'] / 2**20:.0f} MiB "
                  f"({b['growth'] / b['gathered']:.3f} x gathered); ratio {b['growth'] / a['growth']:.3f}")
            print(f"    {b['report']}")
    if args.record:
        record(args.record, {"library": args.library, "distribution": distribution, "version": version,
                             "torch": torch_version, "mib": args.mib,
                             "paths": [{"path": path, **figures(pairs)} for path, pairs in measured.items()]})
        print(f"recorded under {args.record} in {FIGURES}")


if __name__ == "__main__":
    main()
