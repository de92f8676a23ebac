"""Whether a CUDA slot may be rebound: the decision, for every combination of the facts CUDA gives.

``cuda_memory.read`` is the only place that asks CUDA; ``refusal`` decides from
what it read, so the whole decision runs here without a GPU. The tests that need
one (the facts read from real CUDA memory, the rebind itself) are in
tests/test_cuda.py.
"""

from __future__ import annotations

import itertools
from typing import Optional

import pytest

from memgather.engine import cuda_memory
from memgather.engine.cuda_memory import SlotFacts
from memgather.engine.strategies import Reason

ALLOCATORS = ("native", "cudaMallocAsync", "pluggable", "an allocator not known yet")
VERSIONS = (None, 0, 1, 7)


@pytest.mark.parametrize("standard,allocator,capturing,version",
                         list(itertools.product((True, False), ALLOCATORS, (True, False), VERSIONS)))
def test_every_combination(standard: bool, allocator: str, capturing: bool, version: Optional[int]) -> None:
    """Rebound only when all four hold: torch's own allocator made it, frees are stream-ordered, nothing
    is capturing, and nothing wrote the slot since it was made. Capture is told first (nothing may be
    freed then), then the memory, then its history."""
    facts = SlotFacts(standard, allocator, capturing, version)
    if capturing:
        expected: Optional[Reason] = Reason.GRAPH_CAPTURE
    elif not standard or allocator not in ("native", "cudaMallocAsync"):
        expected = Reason.SLOT_MEMORY
    elif version != 0:
        expected = Reason.SLOT_WRITTEN
    else:
        expected = None
    assert cuda_memory.refusal(facts) is expected


@pytest.mark.parametrize("facts,expected", [
    (SlotFacts(True, "native", False, 0), None),  # torch.empty_like on the default allocator
    (SlotFacts(True, "cudaMallocAsync", False, 0), None),  # cudaFreeAsync honours record_stream too
    (SlotFacts(True, "pluggable", False, 0), Reason.SLOT_MEMORY),  # frees at once, no stream semantics
    (SlotFacts(False, "native", False, 0), Reason.SLOT_MEMORY),  # DLPack import, IPC handle, symmetric memory
    (SlotFacts(True, "native", False, 1), Reason.SLOT_WRITTEN),  # zeros_like's fill is a factory's: 0; copy_ is not
    (SlotFacts(True, "native", False, None), Reason.SLOT_WRITTEN),  # an inference tensor: no version to show
    (SlotFacts(True, "native", True, 0), Reason.GRAPH_CAPTURE),
])
def test_named_cases(facts: SlotFacts, expected: Optional[Reason]) -> None:
    assert cuda_memory.refusal(facts) is expected


def test_release_leaves_cpu_slots_alone() -> None:
    """Recording a stream is for CUDA blocks only: a CPU slot list goes through untouched."""
    import torch

    slots = [torch.ones(3), torch.ones(3)]
    versions = [slot._version for slot in slots]
    cuda_memory.release_on_current_stream(slots)
    assert [slot._version for slot in slots] == versions
    assert all(torch.equal(slot, torch.ones(3)) for slot in slots)
