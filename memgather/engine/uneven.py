"""Uneven gathers: every rank's rows, however many, into one buffer of their summed number.

torch has no all-gather of tensors that differ in dim 0 into one tensor: libraries pad
every rank's tensor to the largest rank's rows, gather ``world`` x the largest, slice
each slot back and concatenate, which costs the padded gather, its slices' cat and the
padding on every rank. Here each rank's rows are written once, where they belong::

    gather(tensor, group, gather_rows)
      -> layouts()            every rank's rows, trailing dims, dtype, device type and host,
                              one int64 row each through torch's list all_gather (gather_rows)
      -> UnevenLayoutError    where ranks differ in more than dim 0: raised on every rank,
                              which all read the same table
      -> out                  (summed rows, *trailing dims), rank i's part at its offset
      -> routes.fill          own part copied in, then each other rank's part broadcast into
                              its place as bytes (one broadcast per rank; the ring where a gloo
                              group spans hosts); a part of no rows moves nothing, on every rank

The parts travel as bytes (``uint8`` views of contiguous parts), so that every dtype
takes the same transfers on every backend, those gloo's collectives refuse included.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Sequence, Tuple

import torch

from memgather import config
from memgather.engine import agreement, counters, groups, hosts, routes, slots
from memgather.engine.reasons import Strategy
from memgather.errors import UnevenLayoutError

_DEVICE_TYPES = ("cpu", "cuda")
# What a rank's input is, beyond its sizes: only dense strided tensors are gathered as bytes.
_KINDS = ("strided", "sparse or another layout", "quantized", "meta", "a tensor subclass", "not contiguous")


class Layout(NamedTuple):
    """One rank's input, as every rank reads it from the exchanged table."""

    rows: int
    trailing: Tuple[Any, ...]  # the dims after the first (past eight of them, a text standing for the rest)
    dtype: Any  # a torch.dtype, or a text where this torch has no dtype of that code
    device_type: str
    host: int
    kind: str  # one of _KINDS
    gloo_route: str  # the rank's MEMGATHER_GLOO_ROUTE
    context: int = 0  # what the caller read that ranks must agree on (a hash; 0: nothing)
    ok: bool = True  # the caller's own verdict on this rank's input


def gather(tensor: torch.Tensor, group: Any, gather_rows: Callable[..., Any], gloo_route: str) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order, the ranks' dim 0 free to differ.

    ``gather_rows``: torch's list all_gather, which exchanges the layouts. ``gloo_route``:
    ``MEMGATHER_GLOO_ROUTE``. A 0-d input counts as one row. Whatever a rank finds wrong with
    the table, every rank finds: they raise alike, before any byte moves.
    """
    source = rows_of(tensor)
    info = groups.describe(group)
    table = layouts(gather_rows, group, source, info.world, gloo_route)
    if not alike(table):
        raise UnevenLayoutError([(t.rows, t.trailing, t.dtype, f"{t.device_type} ({t.kind})") for t in table])
    if table[0].kind != "strided":
        kind = table[0].kind
        raise ValueError(f"memgather.gather_uneven gathers dense strided tensors; every rank's input is {kind}")
    return fill(source, table, group, info)


def rows_of(tensor: torch.Tensor) -> torch.Tensor:
    """The input as rows: a 0-d dense tensor is one row."""
    return tensor.reshape(1) if tensor.dim() == 0 and _kind(tensor) == "strided" else tensor


def alike(table: Sequence[Layout]) -> bool:
    """Whether the ranks' inputs differ in dim 0 alone (read from the table: the same answer on every rank)."""
    first = table[0]
    return all(
        (t.trailing, t.dtype, t.device_type, t.kind) == (first.trailing, first.dtype, first.device_type, first.kind)
        for t in table
    )


def fill(
    source: torch.Tensor,
    table: Sequence[Layout],
    group: Any,
    info: groups.GroupInfo,
    strategy: Strategy = Strategy.INTO_RESULT,
    own_rows: bool = True,
) -> torch.Tensor:
    """One new tensor of the table's summed rows, each rank's ``source`` rows written once at its offset.

    The table must be ``alike`` and of dense strided inputs: every rank then posts the same transfers.
    ``own_rows=False``: the tensor leaves this rank's rows out (its part has none), for a caller that
    hands out its input in their place; they are sent from ``source``, which must be contiguous.
    """
    rows = [t.rows for t in table]
    kept = list(rows)
    if not own_rows:
        kept[info.rank] = 0
    out = torch.empty((sum(kept), *source.shape[1:]), dtype=source.dtype, device=source.device)
    parts = list(out.split(kept))
    # Ranks set differently take the broadcasts, which every setting allows: alike on every rank.
    first = table[0]
    setting = first.gloo_route if all(t.gloo_route == first.gloo_route for t in table) else "broadcast"
    route = _route(
        routes.backend_on(info.backend, source.device.type), source.device, setting, len({t.host for t in table}) > 1
    )
    with torch.no_grad():  # as torch.cat's result of torch's own gather: no history
        if own_rows:
            parts[info.rank].copy_(source)
        sent = [_as_bytes(part) for part in parts]
        if not own_rows:
            sent[info.rank] = _as_bytes(source)  # a view of the input's own bytes: sent, never written
        routes.fill(route, sent, sent[info.rank], group)
    counters.record(strategy.value, route=route.name)
    return out


def layouts(
    gather_rows: Callable[..., Any],
    group: Any,
    tensor: torch.Tensor,
    world: int,
    gloo_route: str = "auto",
    plain_contiguous: bool = False,
    context: int = 0,
    ok: bool = True,
) -> List[Layout]:
    """Every rank's ``Layout``, in group rank order, through one exchange of int64 rows.

    ``plain_contiguous``: a tensor subclass, or a strided tensor without its shape's own strides, is a
    kind of its own (for a caller whose result must keep the input's class and strides). ``context`` and
    ``ok`` travel as given: what a caller needs every rank to know before it decides.
    """
    kind = _kind(tensor)
    if plain_contiguous and kind == "strided":
        if type(tensor) is not torch.Tensor:
            kind = "a tensor subclass"
        elif tensor.stride() != slots.contiguous_strides(tuple(tensor.shape)):
            kind = "not contiguous"  # or contiguous with strides of its own on dims of size 1, which torch keeps
    shape = tuple(tensor.shape) if tensor.dim() else (1,)
    trailing = shape[1:]
    device = _DEVICE_TYPES.index(tensor.device.type) if tensor.device.type in _DEVICE_TYPES else len(_DEVICE_TYPES)
    # The trailing dims travel as their number and a hash (ints hash alike on every rank), then
    # as many of them as fit: enough to name them in an error, and to compare them exactly.
    row = [shape[0], hosts.key(), agreement.dtype_code(tensor.dtype), device, len(trailing)]
    row += [hash(trailing) & 0x7FFFFFFFFFFFFFFF, _KINDS.index(kind), config.GLOO_ROUTES.index(gloo_route)]
    row += [context & 0x7FFFFFFFFFFFFFFF, int(ok)]
    row += list(trailing[:_SHOWN])
    row += [0] * (_ROW - len(row))
    encoded = torch.tensor(row, dtype=torch.int64, device="cpu" if kind == "meta" else tensor.device)
    return [_decode(r) for r in agreement.exchange(gather_rows, group, encoded, world)]


_SHOWN = 8  # trailing dims written out in each row
_HEADER = 10
_ROW = _HEADER + _SHOWN


def _kind(tensor: torch.Tensor) -> str:
    if tensor.is_meta:
        return "meta"
    if tensor.is_quantized:
        return "quantized"
    return "strided" if tensor.layout == torch.strided else "sparse or another layout"


def _decode(row: Sequence[int]) -> Layout:
    ndim = row[4]
    trailing: Tuple[Any, ...] = tuple(row[_HEADER : _HEADER + min(ndim, _SHOWN)])
    if ndim > _SHOWN:  # more trailing dims than a row shows: the hash stands for the rest, compared alike
        trailing += (f"... ({ndim} dims, hash {row[5]})",)
    device = _DEVICE_TYPES[row[3]] if 0 <= row[3] < len(_DEVICE_TYPES) else "other"
    kind = _KINDS[row[6]] if 0 <= row[6] < len(_KINDS) else "unknown"
    setting = config.GLOO_ROUTES[row[7]] if 0 <= row[7] < len(config.GLOO_ROUTES) else "broadcast"
    return Layout(row[0], trailing, agreement.dtype_of(row[2]), device, row[1], kind, setting, row[8], bool(row[9]))


def _route(backend: str, device: torch.device, gloo_route: str, spans_hosts: bool) -> routes.Route:
    """The ring where a gloo group spans hosts (as the even gather's route), else a broadcast per rank."""
    if backend == "gloo" and device.type == "cpu":
        return routes.settle(routes.BROADCAST, gloo_route, spans_hosts, torch.uint8)
    return routes.BROADCAST


def _as_bytes(part: torch.Tensor) -> torch.Tensor:
    return part.reshape(-1).view(torch.uint8)
