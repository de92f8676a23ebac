"""A target that took the name before memgather patched: `from torch.distributed import all_gather`."""

import torch
import torch.distributed as dist
from torch.distributed import all_gather


def gather(t: torch.Tensor) -> list:
    slots = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    all_gather(slots, t)
    return slots


def gather_objects(obj: object) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
