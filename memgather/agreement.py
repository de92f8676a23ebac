"""One small collective in which the ranks agree before a call (step 3).

Each rank contributes a row of int64 metadata: whether its own plan rewires
and by which route (the broadcasts and the ring are different wire protocols:
every rank must take the same one), whether its slots are even (all shaped
like its input), its input's dtype and shape. Every rank then reads the same
table and reaches the same verdict, so either all ranks take the rewired path
or none does, and an uneven gather is reported on every rank instead of
hanging or returning garbage.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from memgather.errors import UnevenShapesError
from memgather.strategies import Reason

_MAX_DIMS = 8
_HEADER = 4  # rewires, even, dtype code, ndim
_ROW = _HEADER + _MAX_DIMS
_UNKNOWN = -1

# Same order on every rank running the same torch: sorted by name.
_DTYPES: Tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


def agree(
    gather_rows: Callable[..., Any],
    group: Any,
    tensor: torch.Tensor,
    rewires: bool,
    even: bool,
    world: int,
    check: bool,
    route: int = 1,
) -> Optional[Reason]:
    """None when every rank may take the rewired path, else why not.

    ``gather_rows`` is the original list all_gather, run on ``group``. Raises
    ``UnevenShapesError`` when ``check`` is set, some rank's slots are even
    and the ranks' inputs differ. ``route`` is a code (> 0) for the route this rank
    would take; ranks that would take different routes all fall back.
    """
    rows = exchange(gather_rows, group, _encode(tensor, route if rewires else 0, even), world)
    uniform = all(_identity(r) == _identity(rows[0]) for r in rows)
    if not uniform:
        if check and any(r[1] for r in rows):
            raise UnevenShapesError([_decode(r) for r in rows])
        return Reason.UNEVEN_RANKS
    routes = {r[0] for r in rows}
    return None if len(routes) == 1 and 0 not in routes else Reason.PEER_FALLBACK


def exchange(gather_rows: Callable[..., Any], group: Any, row: torch.Tensor, world: int) -> List[List[int]]:
    """Every rank's int64 ``row``, in group rank order, through the original list all_gather."""
    table = [torch.empty_like(row) for _ in range(world)]
    gather_rows(table, row, group=group)
    return [r.tolist() for r in table]


def _encode(tensor: torch.Tensor, route: int, even: bool) -> torch.Tensor:
    shape = tuple(tensor.shape)
    if len(shape) <= _MAX_DIMS:
        dims = list(shape) + [0] * (_MAX_DIMS - len(shape))
    else:  # keep the leading dims readable, fold the rest into a hash (ints hash alike everywhere)
        dims = list(shape[: _MAX_DIMS - 1]) + [hash(shape) & 0x7FFFFFFFFFFFFFFF]
    values = [route, int(even), _DTYPE_CODES.get(tensor.dtype, _UNKNOWN), len(shape)] + dims
    return torch.tensor(values, dtype=torch.int64, device=tensor.device)


def _identity(row: Sequence[int]) -> Tuple[int, ...]:
    """Everything that must match across ranks: dtype, ndim, dims."""
    return tuple(row[2:])


def _decode(row: Sequence[int]) -> Tuple[Tuple[Any, ...], Any]:
    ndim = row[3]
    if ndim <= _MAX_DIMS:
        dims: Tuple[Any, ...] = tuple(row[_HEADER : _HEADER + ndim])
    else:
        dims = tuple(row[_HEADER : _ROW - 1]) + (f"... ({ndim} dims)",)
    dtype = _DTYPES[row[2]] if 0 <= row[2] < len(_DTYPES) else "unknown dtype"
    return dims, dtype
