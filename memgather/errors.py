"""Exceptions memgather raises on purpose."""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import torch

RankShape = Tuple[Tuple[int, ...], torch.dtype]


class UnevenShapesError(ValueError):
    """Ranks disagree on the shape or dtype of an all-gather whose slots are even.

    Raised on every rank of the group, only when the cross-rank check is on.
    ``shapes[i]`` is ``(shape, dtype)`` of rank i's input (group ranks).
    """

    def __init__(self, shapes: Sequence[RankShape]) -> None:
        self.shapes = list(shapes)
        described = "; ".join(
            f"rank {rank}: {tuple(shape)} {str(dtype).replace('torch.', '')}"
            for rank, (shape, dtype) in enumerate(self.shapes)
        )
        super().__init__(
            "all_gather inputs differ across ranks, but the output slots expect "
            f"every rank's shape to be the same ({described})"
        )


class UnevenLayoutError(ValueError):
    """Ranks' inputs to ``memgather.gather_uneven`` differ in more than dim 0.

    Raised on every rank of the group, which all read the same exchanged table.
    ``layouts[i]`` is ``(rows, trailing dims, dtype, device type)`` of group rank i's input.
    """

    def __init__(self, layouts: Sequence[Tuple[int, Tuple[Any, ...], Any, str]]) -> None:
        self.layouts = list(layouts)
        described = "; ".join(
            f"rank {rank}: {rows} rows of {tuple(trailing)} {str(dtype).replace('torch.', '')} on {device}"
            for rank, (rows, trailing, dtype, device) in enumerate(self.layouts)
        )
        super().__init__(
            "gather_uneven inputs may differ across ranks only in dim 0; the dims after it, the dtype "
            f"and the device type must be the same ({described})"
        )


class VerifyError(RuntimeError):
    """Verify mode found a rewired all-gather whose result differs from the original's.

    Raised on every rank of the group. ``site`` is the calling code, ``shape``
    and ``dtype`` the input's, ``seen_by`` the group rank that found it, and
    ``rank`` / ``index`` the first differing slot and the element in it.
    """

    def __init__(
        self,
        site: str,
        shape: Tuple[int, ...],
        dtype: torch.dtype,
        strategy: str,
        seen_by: int,
        rank: int,
        index: Tuple[int, ...],
    ) -> None:
        self.site, self.shape, self.dtype, self.strategy = site, shape, dtype, strategy
        self.seen_by, self.rank, self.index = seen_by, rank, index
        super().__init__(
            f"memgather verify: all_gather from {site}, input {shape} {str(dtype).replace('torch.', '')}, "
            f"strategy {strategy}: slot {rank} differs from the original all_gather at index {index} "
            f"(seen by group rank {seen_by}). Please report it; MEMGATHER=0 turns memgather off."
        )


class ObjectPickleError(RuntimeError):
    """An object collective whose object failed to pickle on another rank.

    Raised on every rank but those that failed, which raise their own pickling error: torch
    would leave these ranks waiting for the failed ones for ever. ``ranks``: the group ranks
    whose object failed to pickle.
    """

    def __init__(self, collective: str, ranks: Sequence[int]) -> None:
        self.collective, self.ranks = collective, list(ranks)
        super().__init__(
            f"memgather: {collective}: the object of group rank(s) {', '.join(map(str, ranks))} failed to pickle "
            "(their own error says why); every rank raises here, where torch would wait for them for ever"
        )


class ObjectVerifyError(VerifyError):
    """Verify mode found an object collective whose objects differ from torch's own call's.

    Raised on every rank of the group. ``rank``: the group rank that found it; ``index``: the
    first differing entry of its list.
    """

    def __init__(self, collective: str, rank: int, index: int) -> None:
        self.collective, self.seen_by, self.index_in_list = collective, rank, index
        RuntimeError.__init__(
            self,
            f"memgather verify: {collective}: entry {index} differs from torch's own call's (seen by group rank "
            f"{rank}). Please report it; MEMGATHER=0 turns memgather off.",
        )
