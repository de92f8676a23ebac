"""The caller patterns ``memgather bench`` measures: gather code as libraries write it.

The code is compiled into a module of its own (``memgather_bench_patterns``),
outside the memgather package, because memgather recognises its callers by
module and skips its own frames: this is user code, and is patched as a target
named after that module. Each pattern takes the rank's input and returns what
the caller ends up holding (a tensor or a list of tensors).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

MODULE = "memgather_bench_patterns"

_SOURCE = '''
import torch
import torch.distributed as dist


def empty_like_cat(t):
    # accelerate < 0.24 (_gpu_gather_one), and accelerate on gloo/CPU today
    slots = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t)
    return torch.cat(slots, dim=0)


def clone_cat(t):
    # transformers trainer_pt_utils.distributed_concat
    slots = [t.clone() for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t)
    return torch.cat(slots, dim=0)


def ones_like_cat(t):
    # MoCo's concat_all_gather
    slots = [torch.ones_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t, async_op=False)
    return torch.cat(slots, dim=0)


def zeros_like_list(t):
    # torchmetrics gather_all_tensors (slots kept as a list)
    slots = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t)
    return slots


def views_in_place(t):
    # DeepSpeed <= 0.12.3 ZeRO: adjacent views of one flat buffer, the input in its own slot
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.empty((world * t.numel(),), dtype=t.dtype, device=t.device)
    slots = list(flat.view(world, *t.shape).unbind(0))
    slots[rank].copy_(t)
    dist.all_gather(slots, slots[rank])
    return flat


def single_tensor(t):
    # the hand-fixed code: one preallocated output and the single-tensor all-gather
    out = torch.empty((dist.get_world_size() * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    single(out, t)
    return out
'''


@dataclass(frozen=True)
class Pattern:
    """One row of the benchmark."""

    name: str
    label: str
    stands_for: str
    elide: bool  # as memgather's defaults have it for the library this stands for


PATTERNS: Tuple[Pattern, ...] = (
    Pattern("empty_like_cat", "empty_like + cat", "accelerate < 0.24, and accelerate on gloo/CPU today", True),
    Pattern("clone_cat", "clone + cat", "transformers distributed_concat", True),
    Pattern("ones_like_cat", "ones_like + cat", "MoCo concat_all_gather (elision opted in)", True),
    Pattern("zeros_like_list", "zeros_like list", "torchmetrics gather_all_tensors", False),
    Pattern("views_in_place", "views, input in slot", "DeepSpeed <= 0.12.3 ZeRO", False),
    Pattern("single_tensor", "single-tensor call", "hand-fixed code; memgather.gather under memgather", False),
)

BY_NAME: Dict[str, Pattern] = {p.name: p for p in PATTERNS}


def load() -> types.ModuleType:
    """The pattern module, compiled once per process and registered in sys.modules."""
    module = sys.modules.get(MODULE)
    if module is None:
        module = types.ModuleType(MODULE)
        exec(compile(_SOURCE, f"<{MODULE}>", "exec"), module.__dict__)
        sys.modules[MODULE] = module
    return module


def function(name: str, memgather_mode: bool) -> Callable:
    """The code to run for a pattern; the hand-fixed row uses memgather.gather under memgather."""
    if name == "single_tensor" and memgather_mode:
        import memgather

        return memgather.gather
    return getattr(load(), name)
