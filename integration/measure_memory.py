"""Peak RSS growth of one gather through a library's code, unpatched vs MEMGATHER=1.

The README's figures. Run with an environment that has the library, e.g. a tox one:
``.tox/accelerate-0.23/bin/python -m integration.measure_memory accelerate 196``
"""

from __future__ import annotations

import sys
import tempfile
from importlib import metadata
from pathlib import Path

from integration.harness import memory_growth


def main() -> None:
    library = sys.argv[1]
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 196
    with tempfile.TemporaryDirectory() as tmp:
        pairs = memory_growth(library, Path(tmp), mib)
    distribution = "open_clip_torch" if library == "open_clip" else library
    print(f"{library} {metadata.version(distribution)}, torch {metadata.version('torch')}, gloo, 2 ranks, "
          f"gather of {mib} MiB float32 per rank")
    for rank, (a, b) in enumerate(pairs):
        print(f"rank {rank}: peak RSS growth unpatched {a['growth'] / 2**20:.0f} MiB "
              f"({a['growth'] / a['gathered']:.3f} x gathered), MEMGATHER=1 {b['growth'] / 2**20:.0f} MiB "
              f"({b['growth'] / b['gathered']:.3f} x gathered); ratio {b['growth'] / a['growth']:.3f}")


if __name__ == "__main__":
    main()
