"""A stand-in for transformers.trainer_pt_utils, loaded under that name (tests/sites/audited_calls.py).

``distributed_concat`` is audited; ``distributed_broadcast_scalars``, of the
same shape, is not. Each gather notes in ``ARMED`` whether memgather armed its
slots for cat elision.
"""

from typing import List

import torch
import torch.distributed as dist

from memgather.engine.elision import ElidableSlot

ARMED: List[bool] = []


def _note(slots: List[torch.Tensor]) -> None:
    ARMED.append(all(isinstance(slot, ElidableSlot) for slot in slots))


def distributed_concat(tensor: torch.Tensor) -> torch.Tensor:
    output_tensors = [tensor.clone() for _ in range(dist.get_world_size())]
    dist.all_gather(output_tensors, tensor)
    _note(output_tensors)
    return torch.cat(output_tensors, dim=0)


def distributed_broadcast_scalars(tensor: torch.Tensor) -> torch.Tensor:
    output_tensors = [tensor.clone() for _ in range(dist.get_world_size())]
    dist.all_gather(output_tensors, tensor)
    _note(output_tensors)
    return torch.cat(output_tensors, dim=0)
