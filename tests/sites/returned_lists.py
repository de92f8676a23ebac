"""Gathers whose function returns its list, as torchmetrics' _simple_gather_all_tensors does, and
callers that use it (tests/test_elision.py). Imported normally: the proof reads this file."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist


def gather_all(result: torch.Tensor) -> List[torch.Tensor]:
    """Fresh slots, the gather, this rank's entry replaced by the input, the list returned."""
    gathered = [torch.zeros_like(result) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, result)
    gathered[dist.get_rank()] = result
    return gathered


def gather_cat(t: torch.Tensor) -> torch.Tensor:
    """accelerate's shape: fresh slots, one cat, the list dropped."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)
