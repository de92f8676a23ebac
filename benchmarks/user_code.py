"""The calls ``benchmarks/overhead.py`` times: user code, as a library writes it.

A module of its own, so that every variant reaches ``all_gather`` through the same
caller, and the caller memgather recognises (by the module name in the frame's
globals: ``benchmarks.user_code``) is the same whatever name ``overhead.py`` runs
under (``__main__`` as a script). ``dist.all_gather`` is looked up at call time, so
that a patch made after this module is imported reaches these calls.
"""

from __future__ import annotations

import warnings
from typing import Any, List

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn


def call(tensor: torch.Tensor) -> None:
    """Fresh slots, one per rank of the fake world of 2."""
    dist.all_gather([torch.empty_like(tensor), torch.empty_like(tensor)], tensor)


def rebind_by_hand(slots: List[torch.Tensor], tensor: torch.Tensor, single: Any, park: torch.Tensor) -> None:
    """What a rebind asks of torch for fresh CPU ``slots``, and nothing else: each slot's storage
    released (parked on ``park``, an empty tensor of their dtype, as memgather releases plain CPU
    slots: ``memgather.engine.slots.rebind``), one flat buffer, each slot pointed into it, the
    single-tensor call ``single``. Written as lean as a hand-made rebind of CPU slots can be, so that
    the time memgather's rebind takes beyond it is memgather's own."""
    for slot in slots:
        slot.data = park  # releases the storage, the version counter left alone
    flat = torch.empty((len(slots) * tensor.shape[0],), dtype=tensor.dtype)
    storage = flat.untyped_storage()
    for index, slot in enumerate(slots):
        slot.set_(storage, index * tensor.shape[0], tensor.shape, tensor.stride())
    single(flat, tensor)


def like_input(tensor: torch.Tensor, world: int) -> None:
    """Fresh slots made like the input in the call, one per rank (the kept plan's proof reads them so:
    ``memgather.patching.proof.slots_like_input``)."""
    dist.all_gather([torch.empty_like(tensor) for _ in range(world)], tensor)


def into(slots: List[torch.Tensor], tensor: torch.Tensor) -> None:
    """The caller's own slots (the direct slots rows: views of one buffer)."""
    dist.all_gather(slots, tensor)


def function(tensor: torch.Tensor) -> Any:
    """The gather inside an autograd Function's forward, as Lightning's ``all_gather`` makes it."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation notice, torch's cost alike in every variant
        return dist_nn.all_gather(tensor)
