"""The libraries' pad, gather, slice and cat, done without the padding: the replacements.

Each function here stands for one library helper that ``memgather.patching.helpers``
recognised by its code. It makes the helper's own calls in the helper's order (the same
collectives, the same checks, the same errors) until every rank knows every rank's sizes.
Then, where the ranks' tensors differ in dim 0 alone and the gather is worth it, every rank
gathers the rows unpadded into one new tensor, each rank's written once (``_unpadded``), and
the slices the helper would return are views of it, adjacent in rank order: a following
``torch.cat`` of them returns that tensor (cat elision, on the CPU) instead of copying it.
Everywhere else the helper's own padded steps run, as its code has them.

What differs from the helper's own result: its slices were views of ``world`` separate padded
slots; here they are views of one tensor (their ``storage_offset()``, ``_base`` and storage),
as after any rebind (docs/calls.md).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from memgather import cow
from memgather.engine import core, counters, elision, group_facts, groups, uneven, verification
from memgather.engine.reasons import Strategy
from memgather.patching import helpers

# The widest element (complex128): a gather this small at that width is small at every dtype.
_WIDEST = 16


def _unpadded(tensor: torch.Tensor, group: Any, shapes: Sequence[Sequence[int]]) -> Optional[torch.Tensor]:
    """Every rank's ``tensor`` (its shape in ``shapes``, rank order) as one tensor of the summed rows,
    or None where the helper's padded way must run: on every rank alike, since each decides from
    what all of them read (``shapes``, then the exchanged layouts)."""
    first = tuple(shapes[0])
    if not first or any(tuple(s)[1:] != first[1:] or len(s) != len(first) for s in shapes):
        return None  # ranks differ past dim 0: slices of padded slots have the padded strides
    info = groups.describe(group)
    facts = group_facts.lookup(group, tensor, info)
    limit = facts.limit if facts is not None else 0
    padded = len(shapes) * max(s[0] for s in shapes) * math.prod(first[1:])
    if padded * _WIDEST < limit:
        return None  # small at any dtype: torch's one gather is quicker than a transfer per rank
    table = uneven.layouts(core.original_all_gather(), group, tensor, info.world, core.settings().gloo_route, True)
    if (
        not uneven.alike(table)
        or table[0].kind != "strided"
        or [t.rows for t in table] != [s[0] for s in shapes]
        or table[0].trailing != first[1:]
    ):
        return None  # the tensors are not what the sizes the helper read say: its own way, which says so
    if padded * tensor.element_size() < limit:
        return None
    out = uneven.fill(tensor, table, group, info, Strategy.UNPADDED)
    if core.settings().verify:
        _verify(out, tensor, group, [t.rows for t in table])
    return out


def _verify(out: torch.Tensor, tensor: torch.Tensor, group: Any, rows: List[int]) -> None:
    """Verify mode: the rows against torch's own padded gather of the same input, sliced, on every
    rank; a difference anywhere raises ``VerifyError`` on every rank (``verification.compare``)."""
    original = core.original_all_gather()
    with torch.no_grad():
        padded = tensor.new_zeros((max(rows), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        scratch = [torch.zeros_like(padded) for _ in rows]
        original(scratch, padded, group=group)
    want = [slot[:n] for slot, n in zip(scratch, rows)]
    verification.compare(original, list(out.split(rows)), want, tensor, group, Strategy.UNPADDED.value)
    counters.record_verified()


def _arm(parts: List[torch.Tensor], out: torch.Tensor, tensor: Optional[torch.Tensor], elide: Optional[bool]) -> None:
    """Let a cat of the parts (one of them replaced by the input) return ``out`` as a copy-on-write
    snapshot: on the CPU, unless elision is switched off."""
    if elide is not False and cow.serves(out):
        elision.arm(parts, out, tensor)


def gather_all_tensors(original: Callable[..., Any], namespace: Dict[str, Any], result: Any, group: Any = None) -> Any:
    """torchmetrics' ``utilities.distributed.gather_all_tensors``: a list of every rank's ``result``,
    its own rank's entry ``result`` itself."""
    return _gather_all_tensors(namespace, result, group, own_entry_is_input=True)


def lightning_gather_all_tensors(
    original: Callable[..., Any], namespace: Dict[str, Any], result: Any, group: Any = None
) -> Any:
    """Lightning Fabric's ``utilities.distributed._gather_all_tensors``, torchmetrics' copy: every
    entry of its list is gathered, its own rank's too."""
    return _gather_all_tensors(namespace, result, group, own_entry_is_input=False)


def _gather_all_tensors(namespace: Dict[str, Any], result: Any, group: Any, own_entry_is_input: bool) -> Any:
    if group is None:
        group = torch.distributed.group.WORLD
    result = result.contiguous()
    world_size = torch.distributed.get_world_size(group)
    torch.distributed.barrier(group=group)
    if result.ndim == 0:
        return namespace["_simple_gather_all_tensors"](result, group, world_size)
    local_size = torch.tensor(result.shape, device=result.device)
    local_sizes = [torch.zeros_like(local_size) for _ in range(world_size)]
    core.original_all_gather()(local_sizes, local_size, group=group)
    max_size = torch.stack(local_sizes).max(dim=0).values
    all_sizes_equal = all(all(ls == max_size) for ls in local_sizes)
    if all_sizes_equal:
        return namespace["_simple_gather_all_tensors"](result, group, world_size)
    out = _unpadded(result, group, [ls.tolist() for ls in local_sizes])
    if out is not None:
        gathered_result = list(out.split([int(ls[0]) for ls in local_sizes]))
        _arm(gathered_result, out, result if own_entry_is_input else None, helpers.elide_setting())
    else:
        # torchmetrics pads under no_grad; Lightning's copy does not (its slots never require grad either way).
        with torch.no_grad() if own_entry_is_input else contextlib.nullcontext():
            pad_dims = []
            pad_by = (max_size - local_size).detach().cpu()
            for val in reversed(pad_by):
                pad_dims.append(0)
                pad_dims.append(val.item())
            result_padded = namespace["F"].pad(result, pad_dims)
            gathered_result = [torch.zeros_like(result_padded) for _ in range(world_size)]
            core.all_gather(gathered_result, result_padded, group)
            for idx, item_size in enumerate(local_sizes):
                slice_param = [slice(dim_size) for dim_size in item_size]
                gathered_result[idx] = gathered_result[idx][tuple(slice_param)]
    if own_entry_is_input:
        gathered_result[torch.distributed.get_rank(group)] = result
    return gathered_result


def all_gather_tensors_with_shapes(
    original: Callable[..., Any], namespace: Dict[str, Any], tensor: Any, shapes: Any, group: Any = None
) -> Any:
    """Ignite's ``distributed.utils.all_gather_tensors_with_shapes``: every rank's ``tensor``, each of
    the shape ``shapes`` gives it, as a list of views of one tensor."""
    model = namespace["_model"]
    if namespace["_need_to_sync"] and isinstance(model, namespace["_SerialModel"]):
        namespace["sync"](temporary=True)
        model = namespace["_model"]
    if isinstance(group, list) and all(isinstance(item, int) for item in group):
        group = model.new_group(group)
    if namespace["_rank_not_in_group"](group):
        return [tensor]
    out = None
    if getattr(model, "name", None) == "native-dist" and isinstance(tensor, torch.Tensor):
        listed = [tuple(int(d) for d in shape) for shape in shapes]
        out = _unpadded(tensor, group, listed)
    if out is not None:
        parts = list(out.split([shape[0] for shape in listed]))
        _arm(parts, out, None, helpers.elide_setting())
        return parts
    max_shape = torch.tensor(shapes).amax(dim=0)
    padding_sizes = (max_shape - torch.tensor(tensor.shape)).tolist()
    padded_tensor = torch.nn.functional.pad(
        tensor, tuple(itertools.chain.from_iterable(map(lambda dim_size: (0, dim_size), reversed(padding_sizes))))
    )
    all_padded_tensors: torch.Tensor = model.all_gather(padded_tensor, group=group)
    return [
        all_padded_tensors[
            [
                slice(rank * max_shape[0] if dim == 0 else 0, rank * max_shape[0] + dim_size if dim == 0 else dim_size)
                for dim, dim_size in enumerate(shape)
            ]
        ]
        for rank, shape in enumerate(shapes)
    ]


def evenly_divisible_all_gather(
    original: Callable[..., Any], namespace: Dict[str, Any], data: Any, concat: bool = True
) -> Any:
    """MONAI's ``utils.dist.evenly_divisible_all_gather``: every rank's ``data`` along dim 0, as one
    tensor (``concat``) or a list of one tensor per rank."""
    if not isinstance(data, torch.Tensor):
        raise ValueError("input data must be PyTorch Tensor.")
    ndims = data.ndimension()
    length: int = data.shape[0] if ndims > 0 else 1
    if namespace["has_ignite"]:
        idist = namespace["idist"]
        if idist.get_world_size() <= 1:
            return data
        output = _ignite_all_gather(original, namespace, data, ndims, length, concat)
    elif namespace["dist"].is_available() and namespace["dist"].is_initialized():
        if namespace["dist"].get_world_size() <= 1:
            return data
        output = _torch_all_gather(original, namespace, data, ndims, length, concat)
    else:
        return data
    if isinstance(output, torch.Tensor):  # the rows gathered unpadded: already their concatenation
        return output
    return torch.cat(output, dim=0) if concat else output


def _torch_all_gather(
    original: Callable[..., Any], namespace: Dict[str, Any], data: torch.Tensor, ndims: int, length: int, concat: bool
) -> Any:
    device = namespace["get_dist_device"]()
    orig_device = data.device
    data = data.to(device)
    data = data.unsqueeze(0) if ndims == 0 else data
    length_tensor = torch.as_tensor([length], device=device)
    all_lens = [torch.zeros_like(length_tensor) for _ in range(dist.get_world_size())]
    core.original_all_gather()(all_lens, length_tensor)
    all_lens_: List[int] = [int(i.item()) for i in all_lens]
    gathered = None if ndims == 0 else _unpadded(data, None, [(n, *data.shape[1:]) for n in all_lens_])
    if gathered is not None:
        if concat and orig_device == device:
            return gathered  # torch.cat of the slices, already made
        return [part.to(orig_device) for part in gathered.split(all_lens_)]
    max_len: int = max(all_lens_)
    if length < max_len:
        size = [max_len - length] + list(data.shape[1:])
        data = torch.cat([data, data.new_full(size, 0)], dim=0)
    output = [torch.zeros_like(data) for _ in range(dist.get_world_size())]
    core.all_gather(output, data)
    return [(o.squeeze(0) if ndims == 0 else o[:n, ...]).to(orig_device) for o, n in zip(output, all_lens_)]


def _ignite_all_gather(
    original: Callable[..., Any], namespace: Dict[str, Any], data: torch.Tensor, ndims: int, length: int, concat: bool
) -> Any:
    idist = namespace["idist"]
    data = data.unsqueeze(0) if ndims == 0 else data
    all_lens: List[int] = idist.all_gather(length)
    gathered = None
    if ndims > 0 and idist.model_name() == "native-dist":  # torch.distributed's default group underneath
        gathered = _unpadded(data, None, [(n, *data.shape[1:]) for n in all_lens])
    if gathered is not None:
        return gathered if concat else list(gathered.split(all_lens))
    max_len: int = max(all_lens)
    if length < max_len:
        size = [max_len - length] + list(data.shape[1:])
        data = torch.cat([data, data.new_full(size, 0)], dim=0)
    output = idist.all_gather(data)
    if ndims == 0:
        return list(torch.unbind(output, dim=0))
    return [output[i * max_len : i * max_len + n, ...] for i, n in enumerate(all_lens)]


