"""The hooks that see what memgather must know of CUDA before it may rebind a CUDA slot.

Two facts no query of torch gives: whether a CUDA graph captured in this process may
still replay (a graph bakes in the addresses it reads and writes), and whether a tensor
lent itself through ``__cuda_array_interface__`` (how CuPy and Numba borrow one, holding
only a Python reference). ``watch`` wraps ``capture_begin`` and ``reset`` of every graph
class torch has, and the ``__cuda_array_interface__`` property; each wrapper notes the
fact and then does exactly what torch's own does.

What happened before the hooks were installed is not seen. So ``import memgather``
imports this module (at once where torch is imported, else as torch's import ends), and
this module imports nothing but torch and ``config``: no import of memgather's can wait
on it in a circle. Where CUDA was in use by the time the hooks were in, a graph may
have been captured unseen: ``graphs_alive`` then answers yes for the rest of the process,
and a warning says so. Under the kill switch (``MEMGATHER=0``) nothing of torch's is
wrapped, and ``graphs_alive`` answers yes: no CUDA slot is rebound then, even by a direct
``memgather.all_gather``. ``engine.cuda_memory`` reads these facts for each CUDA slot.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Dict, Optional

import torch

from memgather import config

# What the hooks ``watch`` installs have seen: the CUDA graphs captured and still alive (id -> a weak
# reference that forgets it; None: one that takes no weak reference, kept for good), and the tensors
# lent through __cuda_array_interface__.
_graphs: Dict[int, Optional["weakref.ref[Any]"]] = {}
_lent: Dict[int, "weakref.ref[torch.Tensor]"] = {}
_HOOKED = "_memgather_hook"


def graphs_alive() -> bool:
    """Whether a CUDA graph captured in this process may still replay (or may have been captured unseen)."""
    return _unseen or bool(_graphs)


def lent(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lent itself through ``__cuda_array_interface__`` and is still alive."""
    return id(tensor) in _lent


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


# Under the kill switch torch is left as it is: nothing is wrapped, so nothing can be ruled out.
_off = config.switched_off()
if not _off:
    watch()
# Read once the hooks are in: a capture before them needed CUDA in use, which this sees.
_unseen: bool = _off or torch.cuda.is_initialized()
if _unseen and not _off:
    logging.getLogger("memgather").warning(
        "CUDA was in use before memgather could watch for CUDA graphs: one captured then cannot be ruled "
        "out, so no CUDA slot is rebound in this process (reason cuda_graphs). Import memgather before "
        "CUDA is first used, or start with MEMGATHER=1."
    )
