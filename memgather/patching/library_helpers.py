"""The library helpers memgather takes over, as data: where each is, and the code it must be.

Each entry names the function, the digests (``helpers.digest``) of the code its replacement
in ``memgather.patching.padded`` was written from (the code the library environments install:
tox.ini), the module-level names that code reads with a test each must pass, and the
replacement, imported only when a helper is taken over: ``memgather doctor`` reads this
without loading memgather's engine.
"""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable

import torch

from memgather.patching import helpers


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value is expected


def _module_named(name: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, types.ModuleType) and value.__name__ == name


# A release whose helper differs in anything but comments and docstrings keeps its own code.
HELPERS = (
    helpers.Helper(
        "torchmetrics.gather_all_tensors",
        "torchmetrics.utilities.distributed",
        "gather_all_tensors",
        ("0d11db6037b798c27b131b761717df87",),  # torchmetrics 1.9.0
        (("torch", _is(torch)), ("F", _is(torch.nn.functional)), ("_simple_gather_all_tensors", callable)),
        "memgather.patching.padded:gather_all_tensors",
    ),
    helpers.Helper(
        "monai.evenly_divisible_all_gather",
        "monai.utils.dist",
        "evenly_divisible_all_gather",
        ("9db70f358143a3381905c26a8c1e7a0e",),  # MONAI 1.6.1
        (
            ("torch", _is(torch)),
            ("dist", _module_named("torch.distributed")),
            ("has_ignite", lambda value: isinstance(value, bool)),
            ("get_dist_device", callable),
        ),
        "memgather.patching.padded:evenly_divisible_all_gather",
    ),
    helpers.Helper(
        "ignite.all_gather_tensors_with_shapes",
        "ignite.distributed.utils",
        "all_gather_tensors_with_shapes",
        ("248fdfdfebb4189ca0c60e9fd1f3a1cf",),  # PyTorch-Ignite 0.5.5
        (
            ("torch", _is(torch)),
            ("itertools", _is(itertools)),
            ("_need_to_sync", lambda value: isinstance(value, bool)),
            ("_SerialModel", lambda value: isinstance(value, type)),
            ("_model", lambda value: True),
            ("sync", callable),
            ("_rank_not_in_group", callable),
        ),
        "memgather.patching.padded:all_gather_tensors_with_shapes",
    ),
    *(
        helpers.Helper(
            f"{module}._gather_all_tensors",
            f"{module}.utilities.distributed",
            "_gather_all_tensors",
            ("9566de1e61f706499ee3863824cfa1aa",),  # Lightning 2.6.6 (both of its namespaces)
            (("torch", _is(torch)), ("F", _is(torch.nn.functional)), ("_simple_gather_all_tensors", callable)),
            "memgather.patching.padded:lightning_gather_all_tensors",
        )
        for module in ("lightning_fabric", "lightning.fabric")
    ),
)
