"""Whether a CUDA slot's memory may be released and rebound, and how it is released.

A rebind frees each slot's block and allocates one flat buffer in its place.
On the CPU the proofs that nothing else holds the memory suffice (``compat``).
On CUDA the caching allocator adds three questions, answered from facts that
``read`` takes from torch (the only function here that asks CUDA anything) and
decided by ``refusal`` from those facts alone:

- **Who made the memory.** Only blocks of torch's own allocator go back to a
  pool when freed. DLPack imports, CUDA IPC handles and symmetric-memory peer
  buffers carry another deleter (``torch._C._has_Standard_Deleter`` is false);
  a ``CUDAPluggableAllocator`` frees at once, with no stream semantics, so
  nothing of a process whose allocator backend is ``pluggable`` is rebound.
- **Whether it was written before.** Factory-made slots (``empty_like``,
  ``zeros_like``, ``ones_like``, ``clone``, ``torch.empty``) are at ``_version``
  0; a tensor written by any in-place op or collective is higher (a slot list
  kept across steps, a buffer some kernel filled). An inference tensor has no
  version counter, so nothing shows it fresh: both are left to torch.
- **CUDA graphs.** A graph bakes in the addresses it reads and writes, and its
  static tensors may well be at version 0 (an output of an out-of-place op, an
  input only read). While a graph captured in this process is alive (the hooks of
  ``memgather.cuda_watch`` on the graph classes' ``capture_begin``, which
  ``torch.cuda.graph``, ``make_graphed_callables`` and ``torch.compile``'s CUDA
  graphs all go through; a graph is forgotten when it is freed or ``reset``), or
  may have been captured before those hooks were in, no CUDA slot is rebound: any
  of them may be memory a graph replays. Nothing is freed or allocated while the
  current stream captures either.
- **Memory lent out.** ``__cuda_array_interface__`` (how CuPy and Numba borrow a
  tensor) keeps only a Python reference to the tensor, which no count shows:
  ``cuda_watch`` notes each tensor that lends itself so, and such a slot stays where
  it is, as a CPU tensor lent to numpy does.

Freeing is stream-ordered: a released block returns to the pool of the stream
it was allocated on, and only a later allocation on that stream reuses it,
after the work already queued there. ``release_on_current_stream`` records
every slot on the current stream first, so a slot made on another stream is
not reused before the current stream's work is done (for a slot of the current
stream the record is a no-op). What stays the user's contract, because no
cheap check sees it: memory allocated inside a ``MemPool`` (``use_mem_pool``)
or a graph's private pool and gathered outside it (the flat buffer comes from
the pool routing in force at the gather), and a slot in use on a third stream
without ``record_stream``, as for every tensor a program drops.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, NamedTuple, Optional

import torch

from memgather import compat, cuda_watch
from memgather.engine.reasons import Reason


class SlotFacts(NamedTuple):
    """What CUDA tells of one slot's memory."""

    standard_deleter: bool  # torch's own allocator made it
    allocator: str  # torch.cuda.memory.get_allocator_backend(): "native", "cudaMallocAsync", "pluggable"
    capturing: bool  # the current stream is capturing a CUDA graph
    version: Optional[int]  # its version counter; None for an inference tensor, which has none
    graphs_captured: bool = False  # a CUDA graph captured in this process is alive (it may replay)
    lent: bool = False  # the slot lent itself through __cuda_array_interface__


# The allocator backends whose free is stream-ordered and honours record_stream.
STREAM_ORDERED = frozenset(("native", "cudaMallocAsync"))


def refusal(facts: SlotFacts) -> Optional[Reason]:
    """Why a CUDA slot with these facts must not be rebound; None where it may be."""
    if facts.capturing:
        return Reason.GRAPH_CAPTURE
    if facts.graphs_captured:
        return Reason.CUDA_GRAPHS
    if not facts.standard_deleter or facts.allocator not in STREAM_ORDERED or facts.lent:
        return Reason.SLOT_MEMORY
    if facts.version != 0:
        return Reason.SLOT_WRITTEN
    return None


def read(slot: torch.Tensor) -> SlotFacts:
    """The facts of ``slot``, a CUDA tensor (memgather looking: no subclass hook runs)."""
    has_standard_deleter = getattr(torch._C, "_has_Standard_Deleter", None)
    with compat.subclass_hooks_off():
        storage = slot.untyped_storage()
        standard = has_standard_deleter is not None and bool(has_standard_deleter(storage._cdata))
        del storage  # no reference of memgather's may keep the block alive through the rebind
        version = None if slot.is_inference() else slot._version
    return SlotFacts(
        standard,
        allocator_backend(),
        torch.cuda.is_current_stream_capturing(),
        version,
        cuda_watch.graphs_alive(),
        cuda_watch.lent(slot),
    )


@lru_cache(maxsize=None)
def allocator_backend() -> str:
    """The process's CUDA allocator backend. Fixed once CUDA memory exists (torch refuses to change
    it then), and a CUDA slot exists whenever this is asked: read once."""
    backend = getattr(torch.cuda.memory, "get_allocator_backend", None)
    return "native" if backend is None else str(backend())


def release_on_current_stream(slots: List[torch.Tensor]) -> None:
    """Record each CUDA slot's block on the current stream, before its storage is dropped."""
    first = slots[0]
    if not first.is_cuda:
        return
    stream = torch.cuda.current_stream(first.device)
    with compat.subclass_hooks_off():
        for slot in slots:
            slot.record_stream(stream)
