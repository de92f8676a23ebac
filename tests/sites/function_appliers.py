"""Code that applies all-gathering autograd Functions and concatenates what they return.

Loaded twice by tests/test_functions.py: as ``tests.sites.function_appliers``
(selected as a target) and as ``tests.sites.other_appliers`` (not selected), so
the same Function's gather is made on behalf of a target and of a non-target.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch
import torch.distributed.nn.functional as dist_nn

from tests.sites import functions


def gather_layer(x: torch.Tensor) -> torch.Tensor:
    return torch.cat(functions.GatherLayer.apply(x))


def setup_context_gather(x: torch.Tensor) -> torch.Tensor:
    return torch.cat(functions.SetupContextGather.apply(x))


def local_gather(x: torch.Tensor) -> torch.Tensor:
    return torch.cat(functions.local_gather_layer().apply(x))


def nested(x: torch.Tensor) -> torch.Tensor:
    return functions.Nested.apply(x)


def torch_nn(x: torch.Tensor) -> torch.Tensor:
    """As Lightning's _all_gather_ddp_if_available: torch.distributed.nn's Function, then stack."""
    return torch.stack(dist_nn.all_gather(x))


def apply(function: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.cat(function.apply(x))


APPLIERS: Dict[str, Callable[[torch.Tensor], Any]] = {
    "gather_layer": gather_layer,
    "setup_context_gather": setup_context_gather,
    "local_gather": local_gather,
    "nested": nested,
    "torch_nn": torch_nn,
}
