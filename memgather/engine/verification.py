"""Verify mode: every rewired call checked against the original, bit for bit.

For adopting memgather on a codebase of one's own, in test runs. After a
rewired call, the original ``torch.distributed.all_gather`` gathers the same
input again into scratch slots, and each rank compares what memgather wrote
with what torch gives. One more small all-gather shares the verdicts, so a
difference found on any rank raises ``VerifyError`` on every rank of the
group (a rank raising alone would leave the others waiting in their next
collective). Costs per rewired call: a second gather of the same size with
torch's own temporary, scratch slots of the gathered size, a comparison pass
and one small collective. Async calls complete before they return.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from memgather import compat, frames
from memgather.engine import agreement
from memgather.errors import VerifyError

_NONE = -1


def verify(
    original: Callable[..., Any], gathered: Sequence[torch.Tensor], tensor: torch.Tensor, group: Any, strategy: str
) -> None:
    """Raise ``VerifyError`` on every rank if ``gathered[i]`` differs from rank i's input anywhere."""
    scratch = [torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device) for _ in gathered]
    original(scratch, tensor, group=group)
    compare(original, gathered, scratch, tensor, group, strategy)
    compat.await_release(scratch)  # as agreement.exchange does: no hold of gloo's outlives the call


def compare(
    original: Callable[..., Any],
    gathered: Sequence[torch.Tensor],
    want: Sequence[torch.Tensor],
    tensor: torch.Tensor,
    group: Any,
    strategy: str,
) -> None:
    """Raise ``VerifyError`` on every rank if ``gathered[i]`` differs from ``want[i]`` on any rank."""
    mine = first_difference(gathered, want)
    row = torch.tensor([_NONE, _NONE] if mine is None else list(mine), dtype=torch.int64, device=tensor.device)
    rows = agreement.exchange(original, group, row, len(gathered))
    for seen_by, (rank, index) in enumerate(rows):
        if rank != _NONE:
            raise VerifyError(
                _site(),
                tuple(tensor.shape),
                tensor.dtype,
                strategy,
                seen_by,
                rank,
                _unravel(index, tuple(tensor.shape)),
            )


def first_difference(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> Optional[Tuple[int, int]]:
    """(rank, flat element index) of the first element whose bytes differ, or None.

    Compared as raw bytes: NaN equals the same NaN, and -0.0 differs from 0.0.
    """
    for rank, (a, b) in enumerate(zip(got, want)):
        if a.numel() == 0:
            continue
        left, right = _elements(a), _elements(b)
        differs = (left != right).any(dim=1)
        if bool(differs.any()):
            return rank, int(differs.nonzero()[0, 0])
    return None


def _elements(tensor: torch.Tensor) -> torch.Tensor:
    """One row of bytes per element, in logical order."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), -1)


def _unravel(index: int, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    coords: List[int] = []
    for size in reversed(shape):
        coords.append(index % size)
        index //= size
    return tuple(reversed(coords))


def _site() -> str:
    """Where the verified call came from: 'module.function (file:line)'."""
    frame, _ = frames.calling_frame(sys._getframe(1))
    if frame is None:
        return "unknown caller"
    code = frame.f_code
    return f"{frame.f_globals.get('__name__', '?')}.{code.co_name} ({code.co_filename}:{frame.f_lineno})"
