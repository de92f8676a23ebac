"""One small collective in which the ranks agree before a call (before the route, step 4 of docs/calls.md).

Each rank contributes a row of int64 metadata: whether its own plan rewires
and which in-place route it is set to take (the broadcasts and the ring are
different wire protocols: every rank must take the same one), whether its
slots are even (all shaped like its input), the key of the host it runs on
(``memgather.engine.hosts``), its input's dtype and shape. Every rank then reads the
same table and reaches the same verdict, so either all ranks take the
rewired path or none does, all of them by the same route, and an uneven
gather is reported on every rank instead of hanging or returning garbage.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from memgather import compat
from memgather.engine import hosts
from memgather.engine.strategies import Reason
from memgather.errors import UnevenShapesError

_MAX_DIMS = 8
_HEADER = 5  # route setting (0: falls back), even, host key, dtype code, ndim
_ROW = _HEADER + _MAX_DIMS
_UNKNOWN = -1

# Same order on every rank running the same torch: sorted by name.
_DTYPES: Tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


class Verdict(NamedTuple):
    """What every rank read alike from the table."""

    reason: Optional[Reason]  # None: every rank may take the rewired path
    spans_hosts: bool  # the group's ranks run on more than one host


def agree(
    gather_rows: Callable[..., Any],
    group: Any,
    tensor: torch.Tensor,
    rewires: bool,
    even: bool,
    world: int,
    check: bool,
    route: int = 1,
) -> Verdict:
    """Whether every rank may take the rewired path, and whether the group spans hosts.

    ``gather_rows`` is the original list all_gather, run on ``group``. Raises
    ``UnevenShapesError`` when ``check`` is set, some rank's slots are even
    and the ranks' inputs differ. ``route`` is a code (> 0) for the route setting
    this rank would act on; ranks set differently all fall back.
    """
    rows = exchange(gather_rows, group, _encode(tensor, route if rewires else 0, even), world)
    spans_hosts = len({r[2] for r in rows}) > 1
    uniform = all(_identity(r) == _identity(rows[0]) for r in rows)
    if not uniform:
        if check and any(r[1] for r in rows):
            raise UnevenShapesError([_decode(r) for r in rows])
        return Verdict(Reason.UNEVEN_RANKS, spans_hosts)
    routes = {r[0] for r in rows}
    return Verdict(None if len(routes) == 1 and 0 not in routes else Reason.PEER_FALLBACK, spans_hosts)


def exchange(gather_rows: Callable[..., Any], group: Any, row: torch.Tensor, world: int) -> List[List[int]]:
    """Every rank's int64 ``row``, in group rank order, through the original list all_gather."""
    table = [torch.empty_like(row) for _ in range(world)]
    gather_rows(table, row, group=group)
    # gloo's worker thread lets go of a finished call's tensors a moment after it returns; a process
    # that exits in that moment can abort in teardown ("terminate called without an active exception"):
    # memgather's own collectives end released, so that it adds no such exit to the program's.
    compat.await_release(table + [row])
    return [r.tolist() for r in table]


def _encode(tensor: torch.Tensor, route: int, even: bool) -> torch.Tensor:
    shape = tuple(tensor.shape)
    if len(shape) <= _MAX_DIMS:
        dims = list(shape) + [0] * (_MAX_DIMS - len(shape))
    else:  # keep the leading dims readable, fold the rest into a hash (ints hash alike everywhere)
        dims = list(shape[: _MAX_DIMS - 1]) + [hash(shape) & 0x7FFFFFFFFFFFFFFF]
    values = [route, int(even), hosts.key(), _DTYPE_CODES.get(tensor.dtype, _UNKNOWN), len(shape)] + dims
    return torch.tensor(values, dtype=torch.int64, device=tensor.device)


def _identity(row: Sequence[int]) -> Tuple[int, ...]:
    """Everything that must match across ranks: dtype, ndim, dims."""
    return tuple(row[3:])


def _decode(row: Sequence[int]) -> Tuple[Tuple[Any, ...], Any]:
    ndim = row[4]
    if ndim <= _MAX_DIMS:
        dims: Tuple[Any, ...] = tuple(row[_HEADER : _HEADER + ndim])
    else:
        dims = tuple(row[_HEADER : _ROW - 1]) + (f"... ({ndim} dims)",)
    dtype = _DTYPES[row[3]] if 0 <= row[3] < len(_DTYPES) else "unknown dtype"
    return dims, dtype
