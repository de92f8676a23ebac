"""Huge-page advice: the kernel really backs an advised buffer with huge pages, and
buffers below the threshold are left unadvised."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Optional

import pytest
import torch

from memgather.engine import pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                               reason="no transparent huge pages on this kernel")
needs_advice = pytest.mark.skipif(pages._load_madvise() is None,
                                  reason="huge-page advice turned off (MEMGATHER_HUGE_PAGES=0) or not Linux")


def _mapping_field(address: int, field: str) -> Optional[str]:
    """``field`` of the /proc/self/smaps entry of the mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith(field + ":"):
            return line[len(field) + 1:].strip()
    return None


def _middle(buffer: torch.Tensor) -> int:
    """An address inside ``buffer`` (the advice splits its first, partial page into a mapping of its own)."""
    return buffer.data_ptr() + buffer.numel() * buffer.element_size() // 2


def _huge_kib_of(buffer: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds the middle of ``buffer``."""
    return int((_mapping_field(_middle(buffer), "AnonHugePages") or "0 kB").split()[0])


def _marked_for_huge_pages(buffer: torch.Tensor) -> bool:
    """Whether ``buffer``'s mapping carries MADV_HUGEPAGE advice ("hg" among smaps' VmFlags)."""
    return "hg" in (_mapping_field(_middle(buffer), "VmFlags") or "").split()


@needs_thp
@needs_advice
def test_advised_buffer_gets_huge_pages() -> None:
    advised = torch.empty(16 << 20)  # 64 MiB
    pages.advise(advised)
    advised.fill_(1.0)
    assert _huge_kib_of(advised) > 0
    assert advised.sum().item() == 16 << 20  # advice changes no value


@needs_thp
@needs_advice
def test_only_buffers_from_the_threshold_up_are_advised() -> None:
    """A buffer one page below pages.MIN_BYTES is left unadvised, one of MIN_BYTES is advised.

    Each lies in a fresh anonymous mapping of its own, not in the allocator's heap (where
    earlier advice could linger), so the mark can only come from this advise() call.
    A non-CPU tensor has no memory in this process to look at: that branch is not tested.
    """
    for size, advised in ((pages.MIN_BYTES - mmap.PAGESIZE, False), (pages.MIN_BYTES, True)):
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        buffer = torch.frombuffer(memory, dtype=torch.uint8)
        assert not _marked_for_huge_pages(buffer), f"{size} bytes: advised before advise()"
        pages.advise(buffer)
        assert _marked_for_huge_pages(buffer) == advised, f"{size} bytes: expected advised={advised}"
