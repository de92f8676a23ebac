"""The caller patterns' code: gather code as libraries write it (``patterns`` names and describes them).

Loaded by ``patterns.load`` from this file under another module name,
``memgather_bench_patterns``, never imported as ``memgather.tools.pattern_code``:
memgather recognises a caller by the module name in its frame's globals and
skips the frames of its own modules (``memgather.*``), so under this file's own
name the code would never count as a caller. Under its loaded name it is user
code, patched as a target named after that module. Each pattern takes the
rank's input and returns what the caller ends up holding (a tensor or a list of
tensors).
"""

from typing import List, Optional

import torch
import torch.distributed as dist


def empty_like_cat(t: torch.Tensor) -> torch.Tensor:
    # accelerate < 0.24 (_gpu_gather_one), and accelerate on gloo/CPU today
    slots = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t)
    return torch.cat(slots, dim=0)


def clone_cat(t: torch.Tensor) -> torch.Tensor:
    # transformers trainer_pt_utils.distributed_concat
    slots = [t.clone() for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t)
    return torch.cat(slots, dim=0)


def ones_like_cat(t: torch.Tensor) -> torch.Tensor:
    # MoCo's concat_all_gather
    slots = [torch.ones_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t, async_op=False)
    return torch.cat(slots, dim=0)


class _NativeModel:
    """ignite's native backend: the gather in either branch of an if, then torch.cat."""

    def _do_all_gather(self, tensor: torch.Tensor, group: Optional[object] = None) -> torch.Tensor:
        if tensor.ndimension() == 0:
            tensor = tensor.unsqueeze(0)
        output = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        if group is not None:
            dist.all_gather(output, tensor, group=group)
        else:
            dist.all_gather(output, tensor)
        return torch.cat(output, dim=0)


def zeros_like_branches(t: torch.Tensor) -> torch.Tensor:
    # ignite's _NativeDistModel._do_all_gather (idist.all_gather, EpochMetric.compute)
    return _NativeModel()._do_all_gather(t)


def zeros_like_list(t: torch.Tensor) -> List[torch.Tensor]:
    # torchmetrics gather_all_tensors (slots kept as a list)
    slots = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t)
    return slots


def views_in_place(t: torch.Tensor) -> torch.Tensor:
    # DeepSpeed <= 0.12.3 ZeRO: adjacent views of one flat buffer, the input in its own slot
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.empty((world * t.numel(),), dtype=t.dtype, device=t.device)
    slots = list(flat.view(world, *t.shape).unbind(0))
    slots[rank].copy_(t)
    dist.all_gather(slots, slots[rank])
    return flat


def single_tensor(t: torch.Tensor) -> torch.Tensor:
    # the hand-fixed code: one preallocated output and the single-tensor all-gather
    out = torch.empty((dist.get_world_size() * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    single(out, t)
    return out
