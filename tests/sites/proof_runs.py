"""Run on every rank of a pool (tests/test_proof.py): a call site under torch, then under memgather's default.

Each case runs twice on the same input: with memgather switched off for it
(torch's own all_gather), then with the case's module a target and cat elision
left to its default, so that the proof decides. What the caller observes is
compared: values, dtypes, shapes, ``requires_grad``, which results share memory
with which, and the error raised, if any.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any, Dict, List, Tuple

import torch

import memgather

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def observe(value: Any) -> Dict[str, Any]:
    """What a caller can see of a case's result."""
    tensors: List[torch.Tensor] = []

    def walk(thing: Any) -> Any:
        if isinstance(thing, torch.Tensor):
            tensors.append(thing)
            return ("tensor", str(thing.dtype), tuple(thing.shape), thing.requires_grad, thing.detach().tolist())
        if isinstance(thing, (list, tuple)):
            return (type(thing).__name__, [walk(item) for item in thing])
        # An object's default repr names its address, which differs between two runs: not observable.
        return _ADDRESS.sub("0x?", repr(thing))

    shape = walk(value)
    # Which results share memory with which: whose bytes overlap, so that a write into one reaches the
    # other. (Rebound slots share one storage, in ranges of their own: docs/calls.md, after a rebind.)
    spans = [_span(t) for t in tensors]
    sharing = [[a[0] < b[1] and b[0] < a[1] for b in spans] for a in spans]
    return {"value": shape, "sharing": sharing}


def _span(t: torch.Tensor) -> Tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride > 0)
    start = t.data_ptr()  # (a copy-on-write tensor whose other side lives gets its own copy here)
    return start, start + (last + 1) * t.element_size()


def run(function: Any, tensor: torch.Tensor) -> Dict[str, Any]:
    try:
        return observe(function(tensor.clone()))
    except Exception as error:  # noqa: BLE001 - the error is what both runs must share
        return {"error": f"{type(error).__name__}: {error}"}


def compare(ctx: Any, module_name: str, names: List[str], path: str = "") -> Dict[str, Any]:
    """Each named function of the module under torch and under memgather's default."""
    if path and path not in sys.path:
        sys.path.insert(0, path)
    module = importlib.import_module(module_name)
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * ctx.rank
    results: Dict[str, Any] = {}
    for name in names:
        function = _named(module, name)
        torch_run = run(function, tensor)
        memgather.patch([module_name])
        try:
            memgather.reset_stats()
            memgather_run = run(function, tensor)
            stats = memgather.stats()
        finally:
            memgather.unpatch()
        results[name] = {"torch": torch_run, "memgather": memgather_run, "elided": stats.elided,
                         "rewired": stats.rewired}
    return results


def _named(module: Any, name: str) -> Any:
    thing = module
    for part in name.split("."):
        thing = getattr(thing, part)
    return thing
