"""What the benchmark's CPU peak rests on: freed temporaries leave the resident set."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from memgather.tools import rss

    def peak_growth_of_a_temporary():
        # Like a list gather and its cat: two 4 MiB blocks, then one of 8 MiB while one lives.
        rss.reset_peak()
        before = rss.current_bytes()
        first, second = torch.ones(1 << 20), torch.ones(1 << 20)
        del first
        torch.ones(2 << 20)
        return rss.peak_bytes() - before

    for _ in range(3):  # glibc raises its mmap threshold as such blocks are freed
        peak_growth_of_a_temporary()
    assert rss.track_allocations(True)
    print(*[peak_growth_of_a_temporary() for _ in range(5)])
    rss.track_allocations(False)
""")


def test_tracked_allocations_show_in_every_peak() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Untracked, whether the heap still holds such pages depends on the process's
    # history (the bench missed a whole 8 MiB temporary after its warm-up); tracked,
    # every call shows at least its 8 MiB block (the 4 MiB one
    # beside it too, unless glibc placed them so that it did not need new pages).
    tracked = [int(v) for v in done.stdout.split()]
    mib = 1 << 20
    assert len(tracked) == 5 and all(7.5 * mib <= growth <= 17 * mib for growth in tracked)
