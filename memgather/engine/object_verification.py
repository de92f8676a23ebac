"""Verify mode for the object collectives: memgather's objects checked against torch's own call.

After memgather's call, torch's own collective runs again on the same object into a list of
its own, on every rank (its error, if it raises, is kept: memgather's call raised the same or
returned first), and each rank compares what it received, object by object: the same types
and structure, and every tensor's dtype, shape, strides, ``requires_grad`` and bytes. One
all_reduce then shares the verdicts, so a difference found on any rank raises
``ObjectVerifyError`` on every rank. Costs per call: torch's own call, a comparison pass, one
small collective.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from memgather import compat
from memgather.engine import counters
from memgather.errors import ObjectVerifyError


def verify(
    collective: str,
    mine: Optional[Sequence[Any]],
    theirs: Callable[[], Optional[Sequence[Any]]],
    me: int,
    world: int,
    device: torch.device,
    group: Any,
    reduce: Callable[..., Any],
) -> None:
    """Run ``theirs()`` (torch's call, returning what it received, or None where this rank receives
    nothing) and raise ``ObjectVerifyError`` on every rank where some rank's ``mine`` differs."""
    try:
        received = theirs()
    except Exception:  # noqa: BLE001 - torch's own error: memgather's call raised the same, or returned it
        received = None
    differs = -1
    if mine is not None and received is not None:
        differs = _first_difference(mine, received)
    with compat.outside_modes():
        table = torch.zeros(world, dtype=torch.int64)
        table[me] = differs + 1
        table = table.to(device)
        reduce(table, group=group)
        found = table.tolist()
    for rank, entry in enumerate(found):
        if entry:
            raise ObjectVerifyError(collective, rank, entry - 1)
    counters.record_verified()


def _first_difference(mine: Sequence[Any], theirs: Sequence[Any]) -> int:
    """The first index where the two lists' entries differ (-1: none); a comparison that cannot be made
    counts as no difference (verify mode must not fail a call it cannot judge, nor leave a rank behind)."""
    for index, (a, b) in enumerate(zip(mine, theirs)):
        try:
            same = alike(a, b)
        except Exception:  # noqa: BLE001 - an object verify mode cannot compare: not a difference
            same = True
        if not same:
            return index
    return min(len(mine), len(theirs)) if len(mine) != len(theirs) else -1


def alike(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether two unpickled objects are the same to a caller: type, structure, every tensor's bytes.
    Objects without an ``__eq__`` of their own are compared by what they pickle (``__reduce_ex__``)."""
    if type(a) is not type(b):
        return False
    if depth > 64:
        return True  # (deeper than verify mode looks)
    if isinstance(a, torch.Tensor):
        return _same_tensor(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(alike(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(alike(x, y, depth + 1) for x, y in zip(a, b))
    if type(a).__eq__ is object.__eq__:
        reduced_a, reduced_b = a.__reduce_ex__(4), b.__reduce_ex__(4)
        if isinstance(reduced_a, str) or isinstance(reduced_b, str):
            return reduced_a == reduced_b
        return alike(tuple(reduced_a[1:]), tuple(reduced_b[1:]), depth + 1)
    return bool(a == b) or repr(a) == repr(b)  # (a NaN is not equal to itself)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """dtype, shape, layout, device and ``requires_grad``; and, for plain strided tensors, every byte
    (NaNs and signed zeros too). Sparse, quantized and meta tensors are compared by their kind alone."""
    kind = (a.dtype, a.shape, a.layout, a.device, a.requires_grad)
    if kind != (b.dtype, b.shape, b.layout, b.device, b.requires_grad):
        return False
    if a.layout != torch.strided or a.is_quantized or a.device.type == "meta" or a.is_nested:
        return True
    if a.stride() != b.stride():
        return False
    left, right = (t.detach().reshape(-1).contiguous().cpu() for t in (a, b))
    if left.numel() == 0:
        return True
    return torch.equal(left.view(torch.uint8), right.view(torch.uint8))
