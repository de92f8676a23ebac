"""The same code in a module that is not a target."""

import torch
import torch.distributed as dist


def gather(t: torch.Tensor) -> list:
    slots = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t)
    return slots


def gather_into(slots: list, t: torch.Tensor, async_op: bool = False) -> None:
    """Into the caller's slots (the stateful differential test's non-target gather)."""
    work = dist.all_gather(slots, t, async_op=async_op)
    if work is not None:
        work.wait()
