"""The installed torch's row of the compatibility table (docs/torch-releases.md).

    python -m tests.compatibility [MIB]

runs tests/venv_job/job.py under MEMGATHER=1: 2 gloo ranks, each gathering MIB
(default 98) MiB of fresh empty_like slots once through a target module and
once through another module, which torch serves. It prints what memgather
chose and each call's peak RSS growth as a multiple of the gathered size.
tox's torch-release environments run it after their tests.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

from tests.jobs import run_job

GROWTH_MIB = 98


def measure(mib: int = GROWTH_MIB) -> List[Dict[str, Any]]:
    """Per-rank figures of one gather of ``mib`` MiB per rank (see tests/venv_job/job.py)."""
    return run_job(sys.executable, MEMGATHER="1", MEMGATHER_TARGETS="mgtarget", GROWTH_MIB=str(mib))  # type: ignore[no-any-return]


def row(ranks: List[Dict[str, Any]]) -> str:
    """A markdown row: torch, backend, primitive, strategy and route, growth (worst rank)."""
    first = ranks[0]
    stats = first["memgather_stats"]
    strategy = ", ".join(stats["strategy"]) or "none"
    route = ", ".join(stats["route"]) or "none"
    torch_growth = max(r["torch"] for r in ranks)
    ours = max(r["memgather"] for r in ranks)
    identical = "identical" if all(r["identical"] for r in ranks) else "DIFFERENT"
    return (f"| {first['torch_version']} | gloo | {first['primitive']} | {strategy} ({route}) | "
            f"{torch_growth:.3f} x | {ours:.3f} x | {identical} |")


if __name__ == "__main__":
    print(row(measure(int(sys.argv[1]) if len(sys.argv) > 1 else GROWTH_MIB)))
