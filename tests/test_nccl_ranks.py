"""The two-rank launcher the GPU tests use (tests/nccl_ranks.py), run on gloo: its results, a
rank's failure reported at once while the other waits in a collective, and much output."""

from __future__ import annotations

import time

import pytest

from tests import nccl_ranks


def test_each_rank_reports_its_result() -> None:
    got = nccl_ranks.run("""
        t = torch.arange(4.0) + RANK
        slots = [torch.empty(4) for _ in range(WORLD)]
        dist.all_gather(slots, t)
        print(json.dumps([RANK, [slot.tolist() for slot in slots]]))
    """, backend="gloo")
    gathered = [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]]
    assert got == [[0, gathered], [1, gathered]]


def test_a_failing_rank_is_reported_at_once_with_its_error() -> None:
    """Rank 1 raises; rank 0 goes on waiting (as in a collective NCCL does not abort): killed after
    the grace, not at the deadline, and rank 1's traceback is in the report."""
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        nccl_ranks.run("""
            import time
            if RANK == 1:
                raise RuntimeError("the real error")
            time.sleep(600)
        """, backend="gloo", timeout_s=120)
    assert time.monotonic() - started < 60
    assert "rank 1: 1" in str(failure.value) and "the real error" in str(failure.value)
    assert "rank 0: killed" in str(failure.value)


def test_much_output_does_not_block_a_rank() -> None:
    got = nccl_ranks.run("""
        sys.stderr.write("x" * 300_000)
        print("y" * 300_000)
        print(json.dumps(RANK))
    """, backend="gloo", timeout_s=60)
    assert got == [0, 1]
