"""The library helpers memgather takes over, as data: where each is, and the code it must be.

Each entry names the function, the shapes of its code (``helpers.digest``: every release line
of the last three years, each with a verbatim copy in ``tests/library_code``) that its takeover
in ``memgather.patching.padded`` was written for, the module-level names that code reads with a
test each must pass, where the code exchanges its sizes, and the takeover, imported only when a
helper is taken over: ``memgather doctor`` reads this without loading memgather's engine.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from memgather.patching import helpers


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value is expected


def _module_named(name: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, types.ModuleType) and value.__name__ == name


# What the takeover must know of each shape: whether its own rank's entry is its input (torchmetrics from
# 1.6) or gathered too, and whether it slices its slots with a list of slices (``[slice_param]``, which
# torch warns of) rather than a tuple.
_OWN_ENTRY = (("own_entry_is_input", True), ("list_index", False))
_OWN_ENTRY_LIST_INDEX = (("own_entry_is_input", True), ("list_index", True))
_ALL_GATHERED_LIST_INDEX = (("own_entry_is_input", False), ("list_index", True))
_LIST_INDEX = (("list_index", True),)  # Ignite's: a list of slices too

# A release whose helper differs in anything but comments, docstrings and annotations keeps its own code.
HELPERS = (
    helpers.Helper(
        "torchmetrics.gather_all_tensors",
        "torchmetrics.utilities.distributed",
        "gather_all_tensors",
        (
            helpers.Shape("f7bbbc8c68776c318d808ef82f336333", "torchmetrics 1.9", _OWN_ENTRY),
            helpers.Shape("3d565f6673114ffada2a8275df6ee566", "torchmetrics 1.6.0 to 1.8.2", _OWN_ENTRY_LIST_INDEX),
            helpers.Shape("e8ab98faf94547ed9c1ec78f28384e55", "torchmetrics 1.0.0 to 1.5.2", _ALL_GATHERED_LIST_INDEX),
        ),
        (("torch", _is(torch)), ("F", _is(torch.nn.functional)), ("_simple_gather_all_tensors", callable)),
        "memgather.patching.padded:gather_all_tensors",
        (helpers.Exchange("local_sizes"),),
    ),
    helpers.Helper(
        "monai.evenly_divisible_all_gather",
        "monai.utils.dist",
        "evenly_divisible_all_gather",
        (helpers.Shape("3cd7846ab367f4d68e5ab36bcd041b10", "MONAI 1.1.0 to 1.6"),),
        (
            ("torch", _is(torch)),
            ("dist", _module_named("torch.distributed")),
            ("has_ignite", lambda value: isinstance(value, bool)),
            ("get_dist_device", callable),
        ),
        "memgather.patching.padded:evenly_divisible_all_gather",
        (helpers.Exchange("all_lens", "_torch_all_gather"), helpers.Exchange("length", "_ignite_all_gather")),
    ),
    helpers.Helper(
        "ignite.all_gather_tensors_with_shapes",
        "ignite.distributed.utils",
        "all_gather_tensors_with_shapes",
        (helpers.Shape("45ec3f3fc1c04e13a1704ca6c4f3ca69", "PyTorch-Ignite 0.5.2 to 0.5.5", _LIST_INDEX),),
        (("_model", lambda value: True), ("_rank_not_in_group", callable)),  # what the takeover reads
        "memgather.patching.padded:all_gather_tensors_with_shapes",
    ),
    *(
        helpers.Helper(
            f"{module}._gather_all_tensors",
            f"{module}.utilities.distributed",
            "_gather_all_tensors",
            (helpers.Shape("cc67a5f31c159d59a69870c3a13a1f9c", "Lightning 2.0 to 2.6", _ALL_GATHERED_LIST_INDEX),),
            (("torch", _is(torch)), ("F", _is(torch.nn.functional)), ("_simple_gather_all_tensors", callable)),
            "memgather.patching.padded:gather_all_tensors",
            (helpers.Exchange("local_sizes"),),
        )
        for module in ("lightning_fabric", "lightning.fabric")
    ),
)
