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
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from memgather import cow
from memgather.engine import core, counters, elision, group_facts, groups, routes, uneven, verification
from memgather.engine.reasons import Strategy
from memgather.patching import helpers, scope


class _Taken(NamedTuple):
    """The rows gathered unpadded: ``out``, and each rank's rows in it (this rank's may be left out)."""

    out: torch.Tensor
    rows: List[int]


def _unpadded(
    tensor: torch.Tensor,
    group: Any,
    padded_numel: int,
    expected: Sequence[Sequence[int]],
    ok: bool = True,
    own_rows: bool = True,
) -> Optional[_Taken]:
    """Every rank's ``tensor`` as one tensor of the summed rows, or None where the helper's padded way
    must run, decided alike on every rank.

    ``padded_numel``: the elements of one rank's padded tensor in the helper's own gather, the same on
    every rank wherever that gather works; ``expected``: every rank's shape as this rank's helper
    reads it; ``ok``: this rank's own verdict on its input. Before the exchange a rank decides from
    ``padded_numel`` alone (and facts every rank of a working program shares: the group, the backend,
    the device type, the dtype's width); after it, from the table every rank holds: every rank's
    verdict, a hash of what each read (``expected``), and each rank's rows, trailing dims, dtype and
    kind of tensor.
    """
    info = groups.describe(group)
    if routes.backend_on(info.backend, tensor.device.type) not in _ROUTED.get(tensor.device.type, ()):
        return None  # no route of memgather's for this pair (a CPU tensor on an NCCL group): the helper's way
    facts = group_facts.lookup(group, tensor, info)
    limit = facts.limit if facts is not None else 0
    if info.world * padded_numel * tensor.element_size() < limit:
        return None  # small: torch's one gather is quicker than a transfer per rank
    shapes = [tuple(int(d) for d in shape) for shape in expected]
    table = uneven.layouts(
        core.original_all_gather(), group, tensor, info.world, core.settings().gloo_route, True, hash(tuple(shapes)), ok
    )
    first = table[0]
    if not (
        all(t.ok and t.context == first.context for t in table)
        and uneven.alike(table)
        and first.kind == "strided"
        and [t.rows for t in table] == [shape[0] if shape else -1 for shape in shapes]
        and all(shape[1:] == first.trailing for shape in shapes)
        and (facts is None or facts.dtypes is None or first.dtype in facts.dtypes)  # what the backend refuses
    ):
        return None  # the tensors are not what the helpers read: the helper's way, which says so where it breaks
    out = uneven.fill(tensor, table, group, info, Strategy.UNPADDED, own_rows)
    rows = [t.rows if own_rows or rank != info.rank else 0 for rank, t in enumerate(table)]
    if core.settings().verify:
        _verify(out, tensor, group, [t.rows for t in table], own_rows)
    return _Taken(out, rows)


# The backends memgather moves uneven rows on, per device type.
_ROUTED = {"cpu": ("gloo",), "cuda": ("nccl",)}


def _exchange(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    """A helper's own small exchange (sizes, lengths), as its code makes it: through whatever
    ``torch.distributed.all_gather`` is now (a wrapper of the user's sees it), left to torch."""
    with scope.disabled():
        dist.all_gather(tensor_list, tensor, group=group)


# What became of each helper's armed lists: concatenated, or put to another use (elision.Cats).
_CATS: Dict[str, elision.Cats] = {}


def _worth_arming(helper: str, tensor: torch.Tensor) -> Optional[elision.Cats]:
    """The record to arm with, where a cat of the helper's list may return the gathered tensor: on the
    CPU (a copy-on-write result), unless elision is off, and while its callers concatenate about as
    often as not (else None)."""
    if helpers.elide_setting() is False or not cow.serves(tensor):
        return None
    cats = _CATS.setdefault(helper, elision.Cats())
    return cats if cats.worth_arming() else None


def _arm(cats: elision.Cats, parts: List[torch.Tensor], out: torch.Tensor, tensor: Optional[torch.Tensor]) -> None:
    """Let a cat of the parts (one of them replaced by the input) return ``out`` as a copy-on-write snapshot."""
    elision.expect(cats)
    try:
        elision.arm(parts, out, tensor)
    finally:
        elision.expect(None)


def _verify(out: torch.Tensor, tensor: torch.Tensor, group: Any, rows: List[int], own_rows: bool) -> None:
    """Verify mode: the rows against torch's own padded gather of the same input, sliced, on every
    rank; a difference anywhere raises ``VerifyError`` on every rank (``verification.compare``)."""
    original = core.original_all_gather()
    rank = groups.describe(group).rank
    with torch.no_grad():
        padded = tensor.new_zeros((max(rows), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        scratch = [torch.zeros_like(padded) for _ in rows]
        original(scratch, padded, group=group)
    want = [slot[:n] for slot, n in zip(scratch, rows)]
    got = list(out.split([n if own_rows or index != rank else 0 for index, n in enumerate(rows)]))
    if not own_rows:
        got[rank] = tensor  # the input stands for its rows
    verification.compare(original, got, want, tensor, group, Strategy.UNPADDED.value)
    counters.record_verified()


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
    _exchange(local_sizes, local_size, group=group)
    max_size = torch.stack(local_sizes).max(dim=0).values
    all_sizes_equal = all(all(ls == max_size) for ls in local_sizes)
    if all_sizes_equal:
        return namespace["_simple_gather_all_tensors"](result, group, world_size)
    shapes = [ls.tolist() for ls in local_sizes]
    taken, cats = None, None
    if all(shape[1:] == shapes[0][1:] for shape in shapes):  # dim 0 alone differs (read alike by every rank)
        helper = "torchmetrics" if own_entry_is_input else "lightning"
        cats = _worth_arming(helper, result)
        # torchmetrics puts the input in its own rank's place: the tensor keeps those rows only for a
        # cat to return it whole; where no cat is expected, it holds the other ranks' rows alone.
        own_rows = cats is not None or not own_entry_is_input
        taken = _unpadded(result, group, math.prod(max_size.tolist()), shapes, own_rows=own_rows)
    if taken is not None:
        gathered_result = list(taken.out.split(taken.rows))
        if cats is not None:
            _arm(cats, gathered_result, taken.out, result if own_entry_is_input else None)
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
            torch.distributed.all_gather(gathered_result, result_padded, group)
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
    max_shape = torch.tensor(shapes).amax(dim=0)
    taken, cats = None, None
    # Whole sizes (Ignite's own pad refuses others), on torch.distributed underneath.
    if (
        getattr(model, "name", None) == "native-dist"
        and isinstance(tensor, torch.Tensor)
        and not (max_shape.is_floating_point() or max_shape.is_complex())
    ):
        # Ignite pads to the largest of the shapes it is given: the same on every rank where its gather works.
        cats = _worth_arming("ignite", tensor)
        taken = _unpadded(tensor, group, math.prod(max_shape.tolist()), [tuple(shape) for shape in shapes])
    if taken is not None:
        parts = list(taken.out.split(taken.rows))
        if cats is not None:
            _arm(cats, parts, taken.out, None)
        return parts
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
        output = _ignite_all_gather(namespace, data, ndims, length, concat)
    elif namespace["dist"].is_available() and namespace["dist"].is_initialized():
        if namespace["dist"].get_world_size() <= 1:
            return data
        output = _torch_all_gather(namespace, data, ndims, length, concat)
    else:
        return data
    if isinstance(output, torch.Tensor):  # the rows gathered unpadded: already their concatenation
        return output
    return torch.cat(output, dim=0) if concat else output


def _unpadded_rows(data: torch.Tensor, lengths: List[int], ndims: int) -> Optional[_Taken]:
    """MONAI's data (dim 0 made of a 0-d input) of every rank, unpadded, or None: MONAI pads every rank
    to the longest, whose trailing dims must be the same on every rank for its own gather to work."""
    trailing = tuple(data.shape[1:])
    return _unpadded(data, None, max(lengths) * math.prod(trailing), [(n, *trailing) for n in lengths], ok=ndims > 0)


def _torch_all_gather(namespace: Dict[str, Any], data: torch.Tensor, ndims: int, length: int, concat: bool) -> Any:
    device = namespace["get_dist_device"]()
    orig_device = data.device
    data = data.to(device)
    data = data.unsqueeze(0) if ndims == 0 else data
    length_tensor = torch.as_tensor([length], device=device)
    all_lens = [torch.zeros_like(length_tensor) for _ in range(dist.get_world_size())]
    _exchange(all_lens, length_tensor)
    all_lens_: List[int] = [int(i.item()) for i in all_lens]
    taken = _unpadded_rows(data, all_lens_, ndims)
    if taken is not None:
        if concat and orig_device == device:
            return taken.out  # torch.cat of the slices, already made
        return [part.to(orig_device) for part in taken.out.split(taken.rows)]
    max_len: int = max(all_lens_)
    if length < max_len:
        size = [max_len - length] + list(data.shape[1:])
        data = torch.cat([data, data.new_full(size, 0)], dim=0)
    output = [torch.zeros_like(data) for _ in range(dist.get_world_size())]
    dist.all_gather(output, data)
    return [(o.squeeze(0) if ndims == 0 else o[:n, ...]).to(orig_device) for o, n in zip(output, all_lens_)]


def _ignite_all_gather(namespace: Dict[str, Any], data: torch.Tensor, ndims: int, length: int, concat: bool) -> Any:
    idist = namespace["idist"]
    data = data.unsqueeze(0) if ndims == 0 else data
    all_lens: List[int] = idist.all_gather(length)
    taken = None
    if getattr(idist, "model_name", lambda: "")() == "native-dist":  # torch.distributed's default group underneath
        taken = _unpadded_rows(data, all_lens, ndims)
    if taken is not None:
        return taken.out if concat else list(taken.out.split(taken.rows))
    max_len: int = max(all_lens)
    if length < max_len:
        size = [max_len - length] + list(data.shape[1:])
        data = torch.cat([data, data.new_full(size, 0)], dim=0)
    output = idist.all_gather(data)
    if ndims == 0:
        return list(torch.unbind(output, dim=0))
    return [output[i * max_len : i * max_len + n, ...] for i, n in enumerate(all_lens)]
