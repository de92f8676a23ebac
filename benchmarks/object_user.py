"""A user's code that gathers Python objects with torch's object collectives (benchmarks.object_peaks's target)."""

from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist


def all_gather_object(obj: Any) -> List[Any]:
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_object(obj: Any) -> Optional[List[Any]]:
    gathered: Optional[List[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def broadcast_object_list(obj: Any) -> List[Any]:
    objects = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(objects, src=0)
    return objects


_GLOO_GROUP: Any = None


def detectron2_all_gather(obj: Any) -> List[Any]:
    """detectron2's ``comm.all_gather``: a gloo group of every rank of its own (made once), then
    torch's all_gather_object on it."""
    global _GLOO_GROUP
    if _GLOO_GROUP is None:
        _GLOO_GROUP = dist.new_group(backend="gloo")
    world_size = dist.get_world_size(_GLOO_GROUP)
    output: List[Any] = [None for _ in range(world_size)]
    dist.all_gather_object(output, obj, group=_GLOO_GROUP)
    return output
