"""Call sites for the elision proof (tests/test_proof.py): each function's name says the verdict it must get.

``accepted_*`` drop the gathered list after one cat (shapes copied from real
libraries and from user code); ``refused_*`` use it after the cat, or let it
escape before, in one way each. Every function takes the rank's tensor and
returns what a caller would observe. The file is imported normally (pytest
does not rewrite it), so the proof reads the code that runs.
"""

from __future__ import annotations

import builtins
import functools
import sys
from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import cat as concatenate_them
from torch.distributed import all_gather as gather_into

KEPT: List[Any] = []


class _State:
    backend = "gloo"
    num_processes = 2


@torch.no_grad()
def accepted_moco(tensor: torch.Tensor) -> torch.Tensor:
    """MoCo's concat_all_gather."""
    tensors_gather = [torch.ones_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(tensors_gather, tensor, async_op=False)
    output = torch.cat(tensors_gather, dim=0)
    return output


def accepted_accelerate(tensor: torch.Tensor) -> torch.Tensor:
    """accelerate's _gpu_gather_one: one name for a tensor in one branch and the list in the other."""
    state = _State()
    gather_op = getattr(torch.distributed, "all_gather_single", None)

    def _gpu_gather_one(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.ndim == 0:
            tensor = tensor.clone()[None]
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        if state.backend is not None and state.backend != "gloo":
            output_tensors = torch.empty(state.num_processes * tensor.numel(), dtype=tensor.dtype)
            gather_op(output_tensors, tensor)
            return output_tensors.view(-1, *tensor.size()[1:])
        else:
            output_tensors = [torch.empty_like(tensor) for _ in range(state.num_processes)]
            torch.distributed.all_gather(output_tensors, tensor)
            return torch.cat(output_tensors, dim=0)

    return _gpu_gather_one(tensor)


def accepted_transformers(tensor: Any, num_total_examples: Optional[int] = None) -> Any:
    """transformers' distributed_concat: recursion, try / except, a slice of the cat returned."""
    try:
        if isinstance(tensor, (tuple, list)):
            return type(tensor)(accepted_transformers(t, num_total_examples) for t in tensor)
        tensor = torch.atleast_1d(tensor).contiguous()
        output_tensors = [tensor.clone() for _ in range(dist.get_world_size())]
        dist.all_gather(output_tensors, tensor)
        concat = torch.cat(output_tensors, dim=0)
        if num_total_examples is not None:
            concat = concat[:num_total_examples]
        return concat
    except AssertionError:
        raise AssertionError("Not currently using distributed training") from None


class IgniteLike:
    """ignite's _do_all_gather: the gather in either branch of an if."""

    def accepted_method(self, tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
        if tensor.ndimension() == 0:
            tensor = tensor.unsqueeze(0)
        output = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        if group is not None:
            dist.all_gather(output, tensor, group=group)
        else:
            dist.all_gather(output, tensor)
        return torch.cat(output, dim=0)


def accepted_ignite(tensor: torch.Tensor) -> torch.Tensor:
    return IgniteLike().accepted_method(tensor)


def accepted_in_a_loop(tensor: torch.Tensor) -> torch.Tensor:
    results = []
    for step in range(3):
        slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(slots, tensor + step)
        results.append(torch.cat(slots))
    return torch.stack(results)


def accepted_while_loop(tensor: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(())
    step = 0
    while step < 2:
        slots = [tensor.new_zeros(tensor.shape) for _ in range(dist.get_world_size())]
        dist.all_gather(slots, tensor)
        total = total + torch.cat(slots, 0).sum()
        step += 1
    return total


def accepted_stack(tensor: torch.Tensor) -> torch.Tensor:
    slots = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensor_list=slots, tensor=tensor)
    return torch.stack(slots, dim=0)


def accepted_keywords(tensor: torch.Tensor) -> torch.Tensor:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    return torch.concat(tensors=slots, dim=0)


def accepted_imported_names(tensor: torch.Tensor) -> torch.Tensor:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    gather_into(slots, tensor)
    return concatenate_them(slots)


def accepted_list_display(tensor: torch.Tensor) -> torch.Tensor:
    slots = [torch.empty_like(tensor), torch.empty_like(tensor)]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    del slots
    return result


def accepted_rebound_to_the_cat(tensor: torch.Tensor) -> torch.Tensor:
    slots: List[torch.Tensor] = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    slots = torch.cat(slots)  # type: ignore[assignment]  # the name is the result's from here on
    return slots.sum(0) + slots[0]  # type: ignore[attr-defined]


def accepted_cat_then_other_work(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.mul_(2)
    try:
        other = result.sum()
    except RuntimeError:
        other = torch.zeros(())
    return result, other


def accepted_receiver(tensor: torch.Tensor) -> torch.Tensor:
    """Lightning's _all_gather_ddp_if_available: torch.distributed.nn's Function, then stack."""
    tensor = tensor.contiguous()
    with torch.no_grad():
        gathered_tensors = dist_nn.all_gather(tensor)
    return torch.stack(gathered_tensors)


def accepted_receiver_importing(tensor: torch.Tensor) -> torch.Tensor:
    """Lightning's exact shape: the Function's wrapper imported inside the function."""
    from torch.distributed.nn.functional import all_gather

    tensor = tensor.contiguous()
    with torch.no_grad():
        gathered_tensors = all_gather(tensor)
    return torch.stack(gathered_tensors)


def accepted_receiver_at_once(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(dist_nn.all_gather(tensor), dim=0)


class GatherLayer(torch.autograd.Function):
    """A self-supervised loss's GatherLayer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        output = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(output, x)
        return tuple(output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        return grads[dist.get_rank()]


class KeepingLayer(torch.autograd.Function):
    """A Function whose forward keeps its slots: its appliers get no elision."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        output = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(output, x)
        KEPT.append(output)
        return tuple(output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        return grads[dist.get_rank()]


def _hand_on(x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    return GatherLayer.apply(x)  # type: ignore[no-any-return]


def accepted_gather_layer(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat(GatherLayer.apply(tensor))


def accepted_through_a_helper(tensor: torch.Tensor) -> torch.Tensor:
    gathered = _hand_on(tensor)
    return torch.cat(gathered)


def refused_keeping_layer(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    result = torch.cat(KeepingLayer.apply(tensor))
    result.mul_(3)
    return result, KEPT.pop()[0]


def refused_scale_then_read_slot(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.mul_(2)
    return result, slots[0]


def refused_returned(tensor: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    return result, slots


def refused_stored_before(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    KEPT.append(slots)
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    return result, KEPT.pop()[1]


def refused_aliased(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    same = slots
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    return result, same[0]


def refused_closure(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]

    def first() -> torch.Tensor:
        return slots[0]

    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    return result, first()


def refused_locals(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    return result, locals()["slots"][0]


def refused_frame(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    return result, sys._getframe().f_locals["slots"][1]


def refused_eval(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    return result, eval("slots[0]")


def refused_parameter(tensor: torch.Tensor, slots: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
    if slots is None:
        slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    return torch.cat(slots)


def refused_in_the_loop_after(tensor: torch.Tensor) -> torch.Tensor:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    total = torch.zeros(())
    for _ in range(2):
        part = torch.cat(slots)
        part.add_(1)
        total = total + part.sum()
    return total


def refused_in_a_handler(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    try:
        result = torch.cat(slots)
        result.add_(1)
        raise ValueError("after the cat")
    except ValueError:
        return result, slots[0]


def _keeping_cat(tensors: List[torch.Tensor]) -> torch.Tensor:
    KEPT.append(tensors[0])
    return torch.cat(tensors)


def refused_a_local_named_like_a_cat(tensor: torch.Tensor) -> Tuple[torch.Tensor, List[Any]]:
    """``concatenate_them`` is torch.cat in the module's globals, but a local of another value here."""
    del KEPT[:]
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    concatenate_them = _keeping_cat
    result = concatenate_them(slots)
    result.add_(1)
    return result, list(KEPT)


def refused_used_between(tensor: torch.Tensor) -> torch.Tensor:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    slots[0].add_(5)
    return torch.cat(slots)


def refused_other_dim(tensor: torch.Tensor) -> torch.Tensor:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    return torch.cat(slots, dim=-1)


def refused_a_part(tensor: torch.Tensor) -> torch.Tensor:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    return torch.cat(slots[:1])


def refused_comprehension_after(tensor: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    return result, [s.sum() for s in slots]


def refused_monai_slices(tensor: torch.Tensor, concat: bool = True) -> Any:
    """MONAI's evenly_divisible_all_gather: a nested function returns slices of the slots, which
    its caller may concatenate: not a cat of the gathered list (the call is still rewired, its slots
    filled where they lie)."""
    length = tensor.shape[0]

    def _torch_all_gather(data: torch.Tensor) -> List[torch.Tensor]:
        output = [torch.zeros_like(data) for _ in range(dist.get_world_size())]
        dist.all_gather(output, data)
        return [o[:length, ...] for o in output]

    output = _torch_all_gather(tensor)
    return torch.cat(output, dim=0) if concat else output


CAT_KEPT: List[Any] = []


def cat(tensors: List[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Not torch's cat: one that keeps its inputs (a memo, a debug log), as a module's own may."""
    CAT_KEPT.append(tensors)
    return torch.cat(tensors, dim)


def refused_import_in_a_nested_function(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The nested function's import binds its own ``cat``: this function's is the module's."""

    def on_host(x: torch.Tensor) -> torch.Tensor:
        from torch import cat

        return cat([x])

    on_host(tensor)
    slots = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = cat(slots)
    result.mul_(0)
    return result, CAT_KEPT.pop()[0]


def refused_import_with_a_fallback(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two imports of one name, of two objects: which one ran, the code cannot say."""
    try:
        from tests.sites.proof_cases import cat
    except ImportError:
        from torch import cat
    slots = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = cat(slots)
    result.mul_(0)
    return result, CAT_KEPT.pop()[0]


def refused_not_fresh(tensor: torch.Tensor) -> torch.Tensor:
    kept = torch.zeros_like(tensor)
    slots = [kept, torch.empty_like(tensor)]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    return result + kept.sum()


def refused_global(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    global GLOBAL_SLOTS
    GLOBAL_SLOTS = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(GLOBAL_SLOTS, tensor)
    result = torch.cat(GLOBAL_SLOTS)
    result.add_(1)
    return result, GLOBAL_SLOTS[0]


def refused_receiver_keeps(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        gathered = dist_nn.all_gather(tensor)
    result = torch.stack(gathered)
    result.add_(1)
    return result, gathered[0]


def refused_exec(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    exec("KEPT.append(slots[0])")
    return result, KEPT.pop()


def refused_nonlocal(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]

    def keep() -> None:
        nonlocal slots
        KEPT.append(slots)

    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    keep()
    return result, KEPT.pop()[0]


def _yields(tensor: torch.Tensor) -> Iterator[Any]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.add_(1)
    yield result
    yield slots


def refused_yielded(tensor: torch.Tensor) -> List[Any]:
    return list(_yields(tensor))


def refused_augmented_after(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    slots += []  # the same list, read
    result.mul_(0)
    return result, slots[0]


def refused_annotation_after(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    slots: List[torch.Tensor]  # binds nothing
    result.mul_(0)
    return result, slots[0]


def _raises() -> int:
    raise RuntimeError("no world size here")


def refused_binding_that_raised(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.zeros_like(tensor), torch.zeros_like(tensor)]
    KEPT.append(slots)
    try:
        slots = [torch.empty_like(tensor) for _ in range(_raises())]
    except RuntimeError:
        pass
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.mul_(0)
    return result, KEPT.pop()[0]


def refused_cat_in_a_comprehension(tensor: torch.Tensor) -> List[torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    return [torch.cat(slots).add_(1) for _ in range(2)]


def refused_builtins_locals(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.mul_(0)
    return result, builtins.locals()["slots"][0]


def refused_locals_by_another_name(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.mul_(0)
    return result, _snapshot()["slots"][0]


class _Pool:
    """Hands out new tensors and keeps them: slots that look fresh in the code, and are not."""

    def new_empty(self, shape: Any) -> torch.Tensor:
        out = torch.empty(shape)
        KEPT.append(out)
        return out


def refused_pooled_slots(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Accepted by reading the code; refused at the gather: a slot held by something besides the list."""
    slots = [_Pool().new_empty(tensor.shape) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    result.mul_(0)
    kept = KEPT[-2]
    del KEPT[:]
    return result, kept


@functools.lru_cache(maxsize=None)
def _cached(x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    return GatherLayer.apply(x)  # type: ignore[no-any-return]


def refused_through_a_cache(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The cache (in C, no frame of its own) keeps the Function's tuple: refused, the call goes through it."""
    result = torch.cat(_cached(tensor))
    result.mul_(0)
    kept = _cached(tensor)[0]
    _cached.cache_clear()
    return result, kept


# Read by the static proof as written, decided at the gather by what runs.
def _simple_gather(result: torch.Tensor, world_size: int) -> List[torch.Tensor]:
    """torchmetrics' _simple_gather_all_tensors: the list returned with this rank's entry replaced by
    the input itself (copy-on-write results only)."""
    with torch.no_grad():
        gathered_result = [torch.zeros_like(result) for _ in range(world_size)]
        torch.distributed.all_gather(gathered_result, result)
    gathered_result[torch.distributed.get_rank()] = result
    return gathered_result


def accepted_returned_with_own_input(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """torchmetrics' returned list, handed straight to one cat by its caller (module-level code, which
    the proof follows; a nested function's call is not resolved)."""
    result = torch.cat(_simple_gather(tensor, dist.get_world_size()), dim=0)
    result.add_(1)  # a write into the result: the slots and the input must not see it
    return result, tensor


def refused_returned_then_flattened(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """As torchmetrics' metric sync does it: the returned list flattened into another list before the cat.
    The caller's code does not hand the list straight to a cat, so it is never armed."""

    def _simple_gather(result: torch.Tensor, world_size: int) -> List[torch.Tensor]:
        with torch.no_grad():
            gathered_result = [torch.zeros_like(result) for _ in range(world_size)]
            torch.distributed.all_gather(gathered_result, result)
        gathered_result[torch.distributed.get_rank()] = result
        return gathered_result

    def flatten(lists: List[List[torch.Tensor]]) -> List[torch.Tensor]:
        return [item for sublist in lists for item in sublist]

    result = torch.cat(flatten([_simple_gather(tensor, dist.get_world_size())]), dim=0)
    result.add_(1)
    return result, tensor


def refused_returned_then_input_written(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """As torchmetrics', but the input is written between the gather and the cat (through .data,
    which its version counter does not see): the cat must concatenate what the input holds now,
    so the buffer (which holds what it held at the gather) is not handed out."""

    def _simple_gather(result: torch.Tensor) -> List[torch.Tensor]:
        gathered_result = [torch.zeros_like(result) for _ in range(dist.get_world_size())]
        torch.distributed.all_gather(gathered_result, result)
        gathered_result[dist.get_rank()] = result
        return gathered_result

    gathered = _simple_gather(tensor)
    tensor.data.mul_(-1)
    return torch.cat(gathered), tensor


def refused_returned_after_a_slot_is_read(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    doubled = slots[0] * 2
    return torch.cat(_handed(slots)), doubled


def _handed(slots: List[torch.Tensor]) -> List[torch.Tensor]:
    return slots


def refused_returned_after_an_item_is_written(tensor: torch.Tensor) -> torch.Tensor:
    def gather() -> List[torch.Tensor]:
        slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(slots, tensor)
        slots[0] += 1
        return slots

    return torch.cat(gather())


RUNTIME_ONLY = {"refused_pooled_slots", "refused_locals_by_another_name"}
# Proven only where the cat's result is a copy-on-write snapshot (the CPU): the list's first use
# after the gather is the cat, but it is used again after it, or returned to code not read.
COPY_ON_WRITE_ONLY = {
    "refused_scale_then_read_slot",
    "refused_returned",
    "refused_in_the_loop_after",
    "refused_in_a_handler",
    "refused_receiver_keeps",
    "_yields",
    "refused_yielded",  # (the case; its generator's call site above)
    "refused_augmented_after",
    "refused_annotation_after",
    "accepted_returned_with_own_input",  # (the case; its helper's call site below)
    "_simple_gather",
    "refused_returned_then_flattened.<locals>._simple_gather",  # (its gatherer returns the list, as above)
    "refused_returned_then_input_written.<locals>._simple_gather",  # (the input's bytes differ at the cat)
}
_snapshot = locals
GLOBAL_SLOTS: List[torch.Tensor] = []
CASES = {
    name: function
    for name, function in sorted(globals().items())
    if name.startswith(("accepted_", "refused_")) and callable(function)
}
