"""A target's object collectives (tests/test_objects.py): each makes torch's call as user code writes it."""

from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist


def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
    dist.all_gather_object(object_list, obj, group)


def gather_object(obj: Any, object_gather_list: Optional[List[Any]], **kwargs: Any) -> None:
    dist.gather_object(obj, object_gather_list, **kwargs)


def broadcast_object_list(object_list: List[Any], **kwargs: Any) -> None:
    dist.broadcast_object_list(object_list, **kwargs)
