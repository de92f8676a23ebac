"""All-gathering autograd Functions, as self-supervised losses define them; not a target.

``GatherLayer`` is the common pattern (SimCLR, VICReg, lightly, solo-learn):
forward gathers into fresh slots, backward all-reduces the gradients and keeps
this rank's part. ``SetupContextGather`` is the same with ``setup_context``,
``local_gather_layer()`` a class defined inside a function. Which code applies
them decides whether memgather rewires their gathers (tests/test_functions.py).
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.distributed as dist


def _own_gradient(grads: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    """GatherLayer's backward: every rank's gradients summed, this rank's part kept."""
    all_gradients = torch.stack(grads)
    dist.all_reduce(all_gradients)
    return all_gradients[dist.get_rank()]


# Each forward calls dist.all_gather itself: a helper doing it would be the caller.
class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        output = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(output, x)
        return tuple(output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        return _own_gradient(grads)


class SetupContextGather(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        output = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(output, x)
        return tuple(output)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        return _own_gradient(grads)


def local_gather_layer() -> Any:
    class LocalGather(GatherLayer):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:  # its own code, defined in here
            output = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.all_gather(output, x)
            return tuple(output)

    return LocalGather


def local_setup_context() -> Any:
    """A setup_context-style Function defined inside a function: its forward takes no ctx."""

    class LocalSetupContext(SetupContextGather):
        @staticmethod
        def forward(x: torch.Tensor) -> Tuple[torch.Tensor, ...]:  # its own code, defined in here
            output = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.all_gather(output, x)
            return tuple(output)

    return LocalSetupContext


class Nested(torch.autograd.Function):
    """A Function whose forward applies another (GatherLayer) and concatenates."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(GatherLayer.apply(x))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.chunk(dist.get_world_size())[dist.get_rank()] * dist.get_world_size()
