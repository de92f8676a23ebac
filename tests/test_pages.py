"""Huge-page advice: the kernel really backs an advised buffer with huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memgather import pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_of(buffer: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds the middle of ``buffer`` (from /proc/self/smaps;
    the advice splits the buffer's first, partial page into a mapping of its own)."""
    start = buffer.data_ptr() + buffer.numel() * buffer.element_size() // 2
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages on this kernel")
@pytest.mark.skipif(pages._load_madvise() is None, reason="huge-page advice turned off (MEMGATHER_HUGE_PAGES=0) or not Linux")
def test_advised_buffer_gets_huge_pages() -> None:
    advised = torch.empty(16 << 20)  # 64 MiB
    pages.advise(advised)
    advised.fill_(1.0)
    assert _huge_kib_of(advised) > 0
    assert advised.sum().item() == 16 << 20  # advice changes no value


def test_small_or_non_cpu_tensors_are_left_alone() -> None:
    pages.advise(torch.empty(10))  # below the size worth advising: no call, no error
    pages.advise(torch.empty(1 << 22, device="meta"))
