"""The libraries' pad, gather, slice and cat, done without the padding: the takeovers.

Each object here stands for one library helper that ``memgather.patching.helpers``
recognised by its code. For torchmetrics', Lightning's and MONAI's helpers the library's own
code runs up to its size exchange; there ``decide`` reads the sizes every rank now holds and
returns a plan where every rank gathers the rows unpadded (``_unpadded``: each rank's rows
written once into one new tensor), or None, and the library's code goes on its own padded way.
``finish`` then hands back what the library's code would have: its list of slices, or their
concatenation. Ignite's helper is given the shapes and pads before any collective: ``run``
decides from its arguments before its code runs, and leaves it the whole call otherwise.

What differs from the library's own result where memgather takes over: each slice is a view of
a tensor of its own rank's rows that shares its memory with the other ranks' (their
``storage_offset()`` and ``untyped_storage()``; docs/calls.md), where the library's were views
of ``world`` separate padded slots.
"""

from __future__ import annotations

import ast
import math
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from memgather import compat, cow
from memgather.engine import core, counters, elision, group_facts, groups, routes, slots, uneven, verification
from memgather.engine.reasons import Strategy
from memgather.patching import helpers, sites


class _Taken(NamedTuple):
    """The rows gathered unpadded: ``out``, and each rank's rows in it (this rank's may be left out)."""

    out: torch.Tensor
    rows: List[int]


def provable(tensor: Any) -> bool:
    """Whether this rank's input is one memgather can gather as bytes and hand back as the library would:
    a plain dense tensor with its shape's own strides, no conjugate or negative bit, outside every
    functorch transform, forward-AD level and Python mode (which would see memgather's ops, not the
    library's). Read without running a subclass's ``__torch_function__``."""
    if type(tensor) is not torch.Tensor:
        return False
    if compat.functorch_active() or compat.forward_ad_active() or compat.functorch_wrapped(tensor):
        return False
    if compat.dispatch_mode_active() or compat.function_mode_active():
        return False
    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_meta
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.stride() == slots.contiguous_strides(tuple(tensor.shape))
    )


def _unpadded(
    tensor: torch.Tensor,
    group: Any,
    padded_numel: int,
    expected: Sequence[Sequence[int]],
    ok: bool = True,
    own_rows: bool = True,
) -> Optional[_Taken]:
    """Every rank's ``tensor`` as one tensor of the summed rows, or None where the library's padded way
    must run, decided alike on every rank.

    ``padded_numel``: the elements of one rank's padded tensor in the library's gather, the same on
    every rank wherever that gather works; ``expected``: every rank's shape as this rank's library code
    reads it; ``ok``: what the caller found of this rank's input, beside ``provable``. Before the
    exchange a rank decides from ``padded_numel`` alone (and facts every rank of a working program
    shares: the group, the backend, the device type, the dtype's width); after it, from the table every
    rank holds: every rank's verdict, a hash of what each read (``expected``), and each rank's rows,
    trailing dims, dtype and kind of tensor.
    """
    ok = ok and provable(tensor)  # read as the caller's code runs: its modes and transforms count
    with compat.outside_modes():  # no mode, transform or subclass hook sees memgather's own reads and exchange
        info = groups.describe(group)
        device_type = tensor.device.type
        if routes.backend_on(info.backend, device_type) not in _ROUTED.get(device_type, ()):
            return None  # no route of memgather's for this pair (a CPU tensor on an NCCL group): the library's way
        facts = group_facts.lookup(group, tensor, info)
        limit = facts.limit if facts is not None else 0
        if info.world * padded_numel * tensor.element_size() < limit:
            return None  # small: torch's one gather is quicker than a transfer per rank
        shapes = [tuple(int(d) for d in shape) for shape in expected]
        table = uneven.layouts(
            core.original_all_gather(),
            group,
            tensor,
            info.world,
            core.settings().gloo_route,
            True,
            hash(tuple(shapes)),
            ok,
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
        return None  # the tensors are not what the library read: its own way, which says so where it breaks
    with compat.outside_modes():
        out = uneven.fill(tensor, table, group, info, Strategy.UNPADDED, own_rows)
        if core.settings().verify:
            _verify(out, tensor, group, [t.rows for t in table], own_rows)
    rows = [t.rows if own_rows or rank != info.rank else 0 for rank, t in enumerate(table)]
    return _Taken(out, rows)


# The backends memgather moves uneven rows on, per device type.
_ROUTED = {"cpu": ("gloo",), "cuda": ("nccl",)}


def _version(tensor: torch.Tensor) -> Optional[int]:
    """``tensor``'s version (None for an inference tensor, which has none: under ``torch.inference_mode``
    the library's slots and memgather's tensors alike)."""
    return None if tensor.is_inference() else tensor._version


def _slices(out: torch.Tensor, rows: Sequence[int]) -> List[torch.Tensor]:
    """Each rank's rows of ``out`` as a basic slice of it (as a library slices one gathered tensor; not
    ``split``'s views, which autograd treats as outputs of one multi-output op)."""
    parts = []
    start = 0
    for count in rows:
        parts.append(out[start : start + count])
        start += count
    return parts


def _own_slices(taken: _Taken, versions: Sequence[Optional[int]]) -> List[torch.Tensor]:
    """Each rank's rows as the library's slices are: a view of a tensor of that rank's own (so that
    a write into one bumps no other's version, as with the library's separate slots), whose version
    is the library's slot's after its gather (``versions``)."""
    out = taken.out
    parts = []
    offset = out.storage_offset()
    storage = out.untyped_storage()
    trailing = tuple(out.shape[1:])
    step = math.prod(trailing)
    with torch.no_grad():
        for rows, version in zip(taken.rows, versions):
            shape = (rows, *trailing)
            base = out.new_empty((0,)).set_(storage, offset, shape, slots.contiguous_strides(shape))
            offset += rows * step
            if version is not None:
                compat.set_version(base, version)
            parts.append(base[:rows])
    return parts


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


class _GatherAllTensors:
    """torchmetrics' ``utilities.distributed.gather_all_tensors`` and Lightning Fabric's
    ``utilities.distributed._gather_all_tensors`` (torchmetrics' copy): a list of every rank's
    ``result``, its own rank's entry ``result`` itself where ``own_entry_is_input`` (torchmetrics
    from 1.6), else gathered too.

    The library's code makes its barrier and exchanges each rank's shape (``local_sizes``); equal
    shapes, a 0-d input and ranks that differ past dim 0 keep its own way."""

    def decide(self, call: helpers.Call, site: helpers.Exchange, exchanged: Any) -> Any:
        result = call.argument("result")
        group = call.argument("group")
        if group is None:
            group = torch.distributed.group.WORLD
        with compat.outside_modes():
            shapes = [tuple(int(d) for d in size.tolist()) for size in exchanged]
        if len(set(shapes)) == 1 or any(shape[1:] != shapes[0][1:] for shape in shapes):
            return None  # equal (its simple gather), or differing past dim 0 (its padded slices' strides)
        padded_numel = max(shape[0] for shape in shapes) * math.prod(shapes[0][1:])
        # The library's slots are zeros_like(...) gathered into, as its size slots were: their versions.
        versions = [_version(size) for size in exchanged]
        own_entry_is_input = call.options["own_entry_is_input"]
        if _list_index_refused(call):
            return None  # this torch refuses its slices' list index: its own code raises as it does
        armed = _caller_concatenates(call, result)
        # torchmetrics puts the input in its own rank's place: the tensor keeps those rows only for a
        # cat to return it whole; where no cat is proven, it holds the other ranks' rows alone.
        taken = _unpadded(
            result, group, padded_numel, shapes, ok=call.unwinds_cleanly, own_rows=armed or not own_entry_is_input
        )
        return None if taken is None else (taken, versions, armed)

    def finish(self, call: helpers.Call, plan: Any) -> List[torch.Tensor]:
        taken, versions, armed = plan
        result = call.argument("result")
        own_entry_is_input = call.options["own_entry_is_input"]
        if armed:
            gathered = _slices(taken.out, taken.rows)
            elision.arm(gathered, taken.out, result if own_entry_is_input else None)
        else:
            gathered = _own_slices(taken, versions)
        if own_entry_is_input:  # "to propagate autograd graph from local rank"
            gathered[torch.distributed.get_rank(call.argument("group"))] = result
        if call.options["list_index"]:
            _warn_as_the_library(call, len(gathered))
        return gathered


gather_all_tensors = _GatherAllTensors()


_probed: List[Optional[List[Tuple[str, type]]]] = []


def _list_index_warnings() -> Optional[List[Tuple[str, type]]]:
    """What this torch does where a library slices a tensor with a list of slices (``x[[slice(n)]]``):
    the warnings it gives (torch 2.x: a deprecation), or None where it raises. Probed once, on a tiny
    tensor, outside every mode."""
    if not _probed:
        with compat.outside_modes(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                torch.zeros(1, 1)[[slice(1), slice(1)]]
            except Exception:  # noqa: BLE001 - any refusal: the library's own code meets it
                outcome = None
            else:
                outcome = [(str(w.message), w.category) for w in caught]
        _probed.append(outcome)
    return _probed[0]


def _list_index_refused(call: helpers.Call) -> bool:
    """Whether the library's code slices with a list of slices and this torch refuses such an index:
    then the library's own way meets the refusal, as without memgather."""
    return bool(call.options["list_index"]) and _list_index_warnings() is None


def _warn_as_the_library(call: helpers.Call, slices: int) -> None:
    """The warnings the library's own slicing gives (once per slot, attributed to its line), where
    memgather took its slicing over: a filter by module or an ``error`` filter sees them as without it."""
    line = _list_index_line(call.entry.original)
    found = _list_index_warnings()
    if line is None or not found:
        return
    namespace = call.namespace
    registry = namespace.setdefault("__warningregistry__", {})
    for _ in range(slices):
        for message, category in found:
            warnings.warn_explicit(
                message, category, call.entry.code.co_filename, line, namespace.get("__name__"), registry, namespace
            )


_lines: Dict[Any, Optional[int]] = {}


def _list_of_slices(index: ast.expr) -> bool:
    """An index the libraries build as a list of slices: torchmetrics' and Lightning's ``[slice_param]``,
    Ignite's ``[[slice(...) for ...]]``."""
    if isinstance(index, ast.Name):
        return index.id == "slice_param"
    if not (isinstance(index, ast.ListComp) and isinstance(index.elt, ast.Call)):
        return False
    return isinstance(index.elt.func, ast.Name) and index.elt.func.id == "slice"


def _list_index_line(function: Any) -> Optional[int]:
    """The line of ``function``'s file where it slices with its list of slices (``x[slice_param]``)."""
    code = function.__code__
    if code not in _lines:
        tree = helpers.source_tree(function)
        found = []
        if isinstance(tree, ast.FunctionDef):
            found = [
                code.co_firstlineno + node.lineno - tree.lineno
                for node in ast.walk(tree)
                if isinstance(node, ast.Subscript) and _list_of_slices(node.slice)
            ]
        _lines[code] = found[0] if len(found) == 1 else None
    return _lines[code]


class _EvenlyDivisibleAllGather:
    """MONAI's ``utils.dist.evenly_divisible_all_gather``: every rank's ``data`` along dim 0, as one
    tensor (``concat``) or a list of one tensor per rank. Its code exchanges each rank's length,
    through torch.distributed (``_torch_all_gather``) or Ignite (``_ignite_all_gather``, whose
    native model gathers through torch.distributed's list all_gather on the default group)."""

    def decide(self, call: helpers.Call, site: helpers.Exchange, exchanged: Any) -> Any:
        data = call.argument("data")
        through_ignite = site.nested == "_ignite_all_gather"
        with compat.outside_modes():
            lengths = [int(length.item()) for length in exchanged]
        ndims = data.ndimension()
        # Ignite's lengths come back as one tensor's slices (their versions its); torch's from slots.
        versions = [0 if through_ignite else _version(length) for length in exchanged]
        same_device = through_ignite or data.device == torch.device(call.namespace["get_dist_device"]())
        trailing = tuple(data.shape[1:])
        taken = _unpadded(
            data,
            None,
            max(lengths) * math.prod(trailing),
            [(n, *trailing) for n in lengths],
            ok=ndims > 0 and same_device and call.unwinds_cleanly,
        )
        return None if taken is None else (taken, versions, through_ignite)

    def finish(self, call: helpers.Call, plan: Any) -> Any:
        taken, versions, through_ignite = plan
        if call.argument("concat"):
            compat.set_version(taken.out, 0)  # torch.cat's result, as the library's
            return taken.out
        if through_ignite:  # slices of the one tensor Ignite's gather returns
            compat.set_version(taken.out, 0)
            return _slices(taken.out, taken.rows)
        return _own_slices(taken, versions)


evenly_divisible_all_gather = _EvenlyDivisibleAllGather()


class _AllGatherTensorsWithShapes:
    """Ignite's ``distributed.utils.all_gather_tensors_with_shapes``: every rank's ``tensor``, each of the
    shape ``shapes`` gives it, as a list of views of one tensor.

    Its shapes are given, and it pads before it makes any collective, so no exchange of its own comes
    before the padding: memgather decides from its arguments before the library's code runs, and runs
    that code, from its first line, wherever it does not take over (its first call, which sets up
    Ignite's model; a group given as ranks; a model not on torch.distributed; shapes that are not whole
    numbers; small gathers; and where any rank's verdict is no)."""

    def run(self, call: helpers.Call) -> Any:
        namespace = call.namespace
        tensor, shapes, group = call.argument("tensor"), call.argument("shapes"), call.argument("group")
        model = namespace["_model"]
        if (
            not (group is None or isinstance(group, torch.distributed.ProcessGroup))  # (ranks: Ignite makes a group)
            or getattr(model, "name", None) != "native-dist"  # (before its first sync: Ignite's serial model)
            or not isinstance(tensor, torch.Tensor)
            or namespace["_rank_not_in_group"](group)
        ):
            return call.entry.original(*call.args, **call.kwargs)
        given = _whole_shapes(shapes)
        # Ignite pads to the largest of the shapes it is given: the same on every rank where its gather works.
        taken = None
        if given and not _list_index_refused(call):
            padded_numel = math.prod(max(dims) for dims in zip(*given))
            taken = _unpadded(tensor, group, padded_numel, given)
        if taken is None:
            return call.entry.original(*call.args, **call.kwargs)
        parts = _slices(taken.out, taken.rows)
        compat.set_version(taken.out, 0)  # as the tensor Ignite's gather concatenates
        if _caller_concatenates(call, tensor):
            elision.arm(parts, taken.out, None)
        if call.options["list_index"]:
            _warn_as_the_library(call, len(parts))
        return parts


def _whole_shapes(shapes: Any) -> List[Any]:
    """``shapes`` as tuples of ints, one per rank, all of one length (else []: Ignite's own code then
    pads, or raises, as it does). Only a list or tuple of lists, tuples or sizes is read: an iterator
    read here would reach Ignite's code spent."""
    if type(shapes) not in (list, tuple) or not all(type(shape) in (list, tuple, torch.Size) for shape in shapes):
        return []
    given = [tuple(shape) for shape in shapes]
    if not given or len({len(shape) for shape in given}) != 1 or not given[0]:
        return []
    if not all(isinstance(d, int) and not isinstance(d, bool) for shape in given for d in shape):
        return []
    return given


all_gather_tensors_with_shapes = _AllGatherTensorsWithShapes()


def _caller_concatenates(call: helpers.Call, tensor: torch.Tensor) -> bool:
    """Whether the list is armed for a cat: on the CPU (a copy-on-write result), where elision is on and
    the helper's caller's code is proven to concatenate what it returns at once (``proof.receiver``),
    so that no armed slot reaches code that does not concatenate; or where the patch forces elision."""
    setting = helpers.elide_setting()
    if setting is False or not cow.serves(tensor):
        return False
    if setting is True:
        return True
    return call.caller is not None and sites.received(call.caller, call.frame).proven
