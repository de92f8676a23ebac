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
  input only read). While a graph captured in this process is alive (``watch``'s
  hooks on the graph classes' ``capture_begin``, which ``torch.cuda.graph``,
  ``make_graphed_callables`` and ``torch.compile``'s CUDA graphs all go through;
  a graph is forgotten when it is freed or ``reset``), no CUDA slot is rebound:
  any of them may be memory a graph replays. Nothing is freed or allocated while
  the current stream captures either. A capture before the hooks are installed
  goes unseen, so ``import memgather`` installs them (at once where torch is
  imported, else when torch's import ends); where CUDA was in use before they
  were, a graph captured then cannot be ruled out, and one is counted alive for
  the rest of the process.
- **Memory lent out.** ``__cuda_array_interface__`` (how CuPy and Numba borrow a
  tensor) keeps only a Python reference to the tensor, which no count shows:
  ``watch`` notes each tensor that lends itself so, and such a slot stays where
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

import functools
import logging
import weakref
from functools import lru_cache
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch

from memgather import compat
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
        graphs_alive(),
        id(slot) in _lent,
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


# What the hooks ``watch`` installs have seen: the CUDA graphs captured and still alive (id -> a weak
# reference that forgets it; None: one that takes no weak reference, kept for good), and the tensors
# lent through __cuda_array_interface__.
_graphs: Dict[int, Optional["weakref.ref[Any]"]] = {}
_lent: Dict[int, "weakref.ref[torch.Tensor]"] = {}
_HOOKED = "_memgather_hook"


def graphs_alive() -> bool:
    """Whether a CUDA graph captured in this process may still replay."""
    return _unseen or bool(_graphs)


def watch() -> None:
    """Install the hooks (idempotent; at import, so that what happens before ``patch()`` counts).

    Each notes a fact and then does exactly what torch's own method does: ``capture_begin`` of every
    graph class torch has (``torch.cuda.CUDAGraph``, ``torch.accelerator.Graph`` and their C bases)
    notes the graph, its ``reset`` forgets it, ``Tensor.__cuda_array_interface__`` notes the tensor
    that lent itself. A capture made outside torch (CuPy's on torch's stream) is not seen.
    """
    accelerator = getattr(torch, "accelerator", None)
    for cls in (
        getattr(torch._C, "_CUDAGraph", None),
        getattr(torch._C, "_acceleratorGraph", None),
        getattr(torch.cuda, "CUDAGraph", None),
        getattr(accelerator, "Graph", None),
    ):
        if cls is None:
            continue
        _hook(cls, "capture_begin", _noting_capture)
        _hook(cls, "reset", _noting_reset)
    interface = torch.Tensor.__dict__.get("__cuda_array_interface__")
    if isinstance(interface, property) and interface.fget is not None and not hasattr(interface.fget, _HOOKED):
        noted = property(_noting_loan(interface.fget), doc=interface.__doc__)
        torch.Tensor.__cuda_array_interface__ = noted  # type: ignore[assignment]  # a property replaced by a property


def _hook(cls: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``cls.name`` replaced by ``make(cls.name)``, once, where ``cls`` defines it itself."""
    method = cls.__dict__.get(name)
    if method is None or not callable(method) or hasattr(method, _HOOKED):
        return
    try:
        setattr(cls, name, make(method))
    except (AttributeError, TypeError):  # a class that takes no new attribute: its captures go unseen
        pass


def _noting_capture(capture_begin: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(capture_begin)
    def noted(self: Any, *args: Any, **kwargs: Any) -> Any:
        _remember_graph(self)  # before the capture: one that fails may still have begun
        return capture_begin(self, *args, **kwargs)

    setattr(noted, _HOOKED, True)
    return noted


def _noting_reset(reset: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(reset)
    def noted(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = reset(self, *args, **kwargs)
        _graphs.pop(id(self), None)  # its memory is released: it replays nothing any more
        return result

    setattr(noted, _HOOKED, True)
    return noted


def _remember_graph(graph: Any) -> None:
    key = id(graph)
    try:
        _graphs[key] = weakref.ref(graph, lambda ref: _graphs.pop(key, None) if _graphs.get(key) is ref else None)
    except TypeError:  # no weak reference to it: counted as alive for good
        _graphs[key] = None


def _noting_loan(fget: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    @functools.wraps(fget)
    def cuda_array_interface(self: torch.Tensor) -> Any:
        interface = fget(self)  # raises for a CPU tensor, as torch's does: nothing is lent then
        key = id(self)
        _lent[key] = weakref.ref(self, lambda ref: _lent.pop(key, None) if _lent.get(key) is ref else None)
        return interface

    setattr(cuda_array_interface, _HOOKED, True)
    return cuda_array_interface


# CUDA in use before the hooks were installed: a graph captured (or a tensor lent) in that time went
# unseen, and none can be ruled out for the rest of the process. Read once, as this module is first
# imported, before ``watch``.
_unseen: bool = torch.cuda.is_initialized()
if _unseen:
    logging.getLogger("memgather").warning(
        "CUDA was in use before memgather was imported: a CUDA graph captured then cannot be ruled out, so "
        "no CUDA slot is rebound in this process (reason cuda_graphs). Import memgather before CUDA is "
        "first used, or start with MEMGATHER=1."
    )
watch()
