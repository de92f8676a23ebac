"""A stand-in for accelerate.utils.operations, loaded under that name (tests/sites/audited_calls.py).

Its functions have the qualified names of accelerate 1.15.0's, so the audit
data matches them as it matches the real module: ``_gpu_gather``'s nested
``_gpu_gather_one`` is audited; the same inner name under another function
(as ``accelerate.utils.megatron_lm`` has it) and ``_neuron_gather_object``
are not. Each gather notes in ``ARMED`` whether memgather armed its slots
for cat elision, then concatenates them and drops the list, as accelerate does.
"""

from typing import List

import torch
import torch.distributed as dist

from memgather.engine.elision import ElidableSlot

ARMED: List[bool] = []


def _note(slots: List[torch.Tensor]) -> None:
    ARMED.append(all(isinstance(slot, ElidableSlot) for slot in slots))  # isinstance: no torch op, nothing disarmed


def _gpu_gather(tensor: torch.Tensor) -> torch.Tensor:
    def _gpu_gather_one(tensor: torch.Tensor) -> torch.Tensor:
        output_tensors = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(output_tensors, tensor)
        _note(output_tensors)
        return torch.cat(output_tensors, dim=0)

    return _gpu_gather_one(tensor)


def gather_across_data_parallel_groups(tensor: torch.Tensor) -> torch.Tensor:
    def _gpu_gather_one(tensor: torch.Tensor) -> torch.Tensor:
        output_tensors = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(output_tensors, tensor)
        _note(output_tensors)
        return torch.cat(output_tensors, dim=0)

    return _gpu_gather_one(tensor)


def _neuron_gather_object(tensor: torch.Tensor) -> torch.Tensor:
    output_tensors = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(output_tensors, tensor)
    _note(output_tensors)
    return torch.cat(output_tensors, dim=0)
