"""Exceptions memgather raises on purpose."""

from __future__ import annotations

from typing import Sequence, Tuple

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
