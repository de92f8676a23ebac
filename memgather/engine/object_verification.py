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
        differs = next((i for i, (a, b) in enumerate(zip(mine, received)) if not alike(a, b)), -1)
        if differs < 0 and len(mine) != len(received):
            differs = min(len(mine), len(received))
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


def alike(a: Any, b: Any) -> bool:
    """Whether two unpickled objects are the same to a caller: type, structure, every tensor's bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        same_kind = (a.dtype, a.shape, a.stride(), a.requires_grad, a.device) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.requires_grad,
            b.device,
        )
        return same_kind and _same_bytes(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(alike(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b) or repr(a) == repr(b)  # (a NaN is not equal to itself)
    except Exception:  # noqa: BLE001 - an object whose == raises: its repr decides
        return repr(a) == repr(b)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaNs and signed zeros too), where the layout has bytes to compare."""
    try:
        left, right = (t.detach().reshape(-1).contiguous().cpu() for t in (a, b))
        if left.numel() == 0:
            return right.numel() == 0
        return torch.equal(left.view(torch.uint8), right.view(torch.uint8))
    except (RuntimeError, TypeError):  # sparse, quantized, nested: torch's own equality
        return bool(torch.equal(a, b))
