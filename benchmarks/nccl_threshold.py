"""The default NCCL threshold by world size, and which named sizes it rewires.

    python benchmarks/nccl_threshold.py [--worlds 2,4,8,16,64]

Prints one markdown table (the one docs/cuda.md shows), computed by
``memgather.engine.routes`` itself: per world size, the default threshold per rank
(``routes.nccl_threshold``), memgather's own CPU time per rewired call and the device
copy a call at the threshold removes (what the rule weighs against each other), and, for
each named size, whether a call of that size per rank is rewired with no setting, asked
of ``routes.gathered_limit`` on both NCCL flavours (legacy and ProcessGroupNCCL2). Needs
no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence, Tuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from memgather.engine import routes  # noqa: E402 - after the repository root is on sys.path

FLOAT32 = 4
# (column, bytes per rank): the calls the default is judged by.
NAMED_SIZES: Tuple[Tuple[str, int], ...] = (
    ("784 MiB (reference)", 64 * 224 * 224 * 64 * FLOAT32),  # the benchmark's reference shape
    ("93.75 MiB (logits)", 4 * 192 * 32000 * FLOAT32),  # an evaluation step's logits
    ("1 MiB (embeddings)", 256 * 1024 * FLOAT32),  # a contrastive loss's embeddings
    ("4 KiB (metric)", 4 << 10),  # a metric's few values
)
FLAVOURS = ("legacy", "nccl2")
DEFAULT_WORLDS = (2, 4, 8, 16, 64)


def overhead_us(world: int) -> float:
    """memgather's own CPU time per rewired call at ``world`` ranks, as the rule takes it."""
    ns = routes.NCCL_OVERHEAD_NS + routes.NCCL_OVERHEAD_PER_RANK_NS * max(world - 2, 0)
    return ns / 1000


def copy_removed_us(world: int, per_rank: int) -> float:
    """The device copy of the gathered bytes a rewired call removes, at the rule's memory bandwidth."""
    return routes.NCCL_COPY_PASSES * max(world, 1) * per_rank / routes.NCCL_HBM_BYTES_PER_NS / 1000


def rewired(world: int, per_rank: int) -> str:
    """'yes' or 'no' for a call of ``per_rank`` bytes per rank with no setting, on both flavours
    (each flavour named where they differ)."""
    verdicts = {
        flavour: per_rank * world >= routes.gathered_limit("nccl", "cuda", flavour, world) for flavour in FLAVOURS
    }
    if len(set(verdicts.values())) == 1:
        return "yes" if verdicts["legacy"] else "no"
    return ", ".join(f"{flavour}: {'yes' if taken else 'no'}" for flavour, taken in verdicts.items())


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g} MiB"


def table(worlds: Sequence[int]) -> List[str]:
    """The markdown table's lines."""
    header = ["ranks", "threshold per rank", "memgather's time", "copy removed at the threshold"]
    header += [name for name, _ in NAMED_SIZES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for world in worlds:
        threshold = routes.nccl_threshold(None, world)
        row = [
            str(world),
            _mib(threshold),
            f"{overhead_us(world):.0f} us",
            f"{copy_removed_us(world, threshold):.0f} us",
        ]
        row += [rewired(world, per_rank) for _, per_rank in NAMED_SIZES]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--worlds",
        default=",".join(map(str, DEFAULT_WORLDS)),
        help="comma-separated world sizes (default %(default)s)",
    )
    args = parser.parse_args(argv)
    worlds = [int(world) for world in args.worlds.split(",") if world.strip()]
    if not worlds or min(worlds) < 1:
        parser.error("--worlds takes world sizes of 1 or more")
    print("\n".join(table(worlds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
