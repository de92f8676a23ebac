"""memgather across simulated hosts: torchrun's multi-node launch over network namespaces.

2 hosts x 2 ranks (world 4) joined by a bridge, c10d rendezvous, gloo bound to each
host's own link; every caller pattern of ``memgather bench`` under torch alone and
with MEMGATHER=1 through memgather's .pth (cat elision on, as ``memgather bench`` has it). The longer matrix (link rates, more
ranks, time) is ``python -m tests.multihost`` (docs/multi-node.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.harness import reports
from tests.hosts import simulated_hosts, unavailable
from tests.multihost import compare

WHY_NOT = unavailable()
REWIRABLE = ("empty_like_cat", "clone_cat", "ones_like_cat", "zeros_like_branches", "zeros_like_list", "views_in_place")


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_two_hosts_identical_results_rewired_at_the_floor(tmp_path: Path) -> None:
    with simulated_hosts(2) as hosts:
        runs = compare(hosts, 2, tmp_path, mib=16)
    theirs, mine = runs["torch"]["results"], runs["memgather"]["results"]
    assert [r["world"] for r in mine] == [4] * 4
    for rank, (a, b) in enumerate(zip(theirs, mine)):
        for name in REWIRABLE:
            assert a[name]["sha256"] == b[name]["sha256"], (rank, name)
        # Slots kept as they lie: filled in place; cats elided: the slots' buffer is the result.
        for name in REWIRABLE:
            assert b[name]["growth"] <= 1.1 and a[name]["growth"] >= 1.8, (rank, name, a[name], b[name])
        # A group of one host's ranks: the broadcasts, which beat the ring on one host.
        assert b["per_host_group"] == {"correct": True, "routes": {"broadcast": 1}}, (rank, b["per_host_group"])
    lines = reports(runs["memgather"]["output"])
    assert sorted(lines) == [0, 1, 2, 3], runs["memgather"]["output"][-3000:]
    for report in lines.values():
        # Each pattern's 16 MiB gather rewired; its 4 KiB warm-up gather left to torch.
        assert report.rewired == len(REWIRABLE) + 1 and report.calls == 2 * len(REWIRABLE) + 1, report.line
        assert report.elided == 4, report.line  # the four cat patterns
        # Across hosts, told by the host keys in the agreement row: the ring.
        assert f"routes: broadcast=1, ring={len(REWIRABLE)};" in report.line, report.line
    assert not reports(runs["torch"]["output"])
