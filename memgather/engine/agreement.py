"""One small collective in which the ranks agree before a call, and the plan it settles (step 4 of docs/calls.md).

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

import contextlib
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from memgather import compat, config
from memgather.engine import hosts, routes
from memgather.engine.call import Call
from memgather.engine.plan import Plan
from memgather.engine.reasons import Reason, Strategy
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


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype``'s number in the exchanged rows, the same on every rank running the same torch."""
    return _DTYPE_CODES.get(dtype, _UNKNOWN)


def dtype_of(code: int) -> Any:
    """The dtype of a ``dtype_code``, or a text where this torch has none of that number."""
    return _DTYPES[code] if 0 <= code < len(_DTYPES) else "unknown dtype"


class Verdict(NamedTuple):
    """What every rank read alike from the table."""

    reason: Optional[Reason]  # None: every rank may take the rewired path
    spans_hosts: bool  # the group's ranks run on more than one host
    dtype: Optional[torch.dtype] = None  # this rank's input's (every rank's, where the reason is None)


def poll(gather_rows: Callable[..., Any], call: Call, plan: Plan, gloo_route: str) -> Verdict:
    """The agreement round for ``plan``: this rank's row, every rank's verdict.

    The exchange is memgather's own: no subclass hook sees it, and where the
    plan was made under a user's mode (``plan.watched``), no mode does either.
    """
    tensor = call.tensor
    assert plan.info is not None  # a plan that agrees described the group
    with compat.subclass_hooks_off(), compat.outside_modes() if plan.watched else contextlib.nullcontext():
        even = all(slot.shape == tensor.shape and slot.dtype == tensor.dtype for slot in call.tensor_list)
        verdict = agree(
            gather_rows,
            call.group,
            tensor,
            plan.rewires,
            even,
            plan.info.world,
            call.check,
            _route_code(plan.route, gloo_route),
        )
        return verdict._replace(dtype=tensor.dtype)


def settle(plan: Plan, verdict: Verdict, gloo_route: str) -> Plan:
    """The plan every rank follows, from this rank's ``plan`` and the ``verdict`` all of them read.

    The one step that may turn a plan into another: the in-place route becomes
    the ring or the broadcasts (``routes.settle``, from the host keys every rank
    read), and a plan that rewires falls back when any rank cannot take it.
    """
    route = plan.route
    if route is not None:
        assert verdict.dtype is not None  # poll reads it
        route = routes.settle(route, gloo_route, verdict.spans_hosts, verdict.dtype)
    if verdict.reason is None or not plan.rewires:
        return plan._replace(route=route)
    return plan._replace(strategy=Strategy.FALLBACK, reason=verdict.reason, route=route)


def _route_code(route: Optional[routes.Route], gloo_route: str) -> int:
    """What this rank would act on, as the agreement row carries it (> 0).

    Ranks that would meet on two wire protocols all take none: an in-place route
    set differently (MEMGATHER_GLOO_ROUTE), or an in-place route on one rank and
    the single call on another (a call made with async_op=True on one rank only,
    with check on: both ranks then agree first).
    """
    if route is None or not route.in_place:
        return len(config.GLOO_ROUTES) + 1
    return config.GLOO_ROUTES.index(gloo_route) + 1


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


# torch's function as memgather found it at import: a wrapper a program puts on torch.empty_like
# later is the program's, for its own calls, and does not see memgather's metadata rows made.
_empty_like = torch.empty_like


def exchange(gather_rows: Callable[..., Any], group: Any, row: torch.Tensor, world: int) -> List[List[int]]:
    """Every rank's int64 ``row``, in group rank order, through the original list all_gather."""
    table = [_empty_like(row) for _ in range(world)]
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
    values = [route, int(even), hosts.key(), dtype_code(tensor.dtype), len(shape)] + dims
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
    return dims, dtype_of(row[3])
