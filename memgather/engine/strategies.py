"""What a call's arguments allow on this rank (steps 2 and 3 of docs/calls.md).

Each question answers an ``Outcome``: a ``Strategy``, or the ``Reason`` that
rules it out. ``planner.plan`` asks them and puts the answer into the call's
plan; nothing here allocates, communicates, changes its arguments or keeps a
reference to a storage.

- ``choose``: ``Strategy.DIRECT`` where the slots already are adjacent views,
  in rank order, of one contiguous region (gather straight into it);
  ``Strategy.REBIND`` where every slot alone holds its whole storage (release
  those storages, gather into one new flat buffer, make the slots views of it).
- ``fill_in_slots``: on a route that writes each rank's part separately (gloo's
  broadcasts, the ring), slots a rebind was refused for may still be filled
  where they lie (``Strategy.IN_SLOTS``): torch's own call writes there too.
- ``stage``: on a route every rank must take (``Route.every_rank``,
  ProcessGroupNCCL2), a rank refused for a reason of its own slots gathers into
  a temporary with the same single-tensor call and copies it into its slots
  where they lie (``Strategy.STAGED``).
- ``even``: every slot shaped, typed and placed like the input.
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

import torch

from memgather import compat
from memgather.engine import cuda_memory, elision
from memgather.engine.reasons import Reason, Strategy

__all__ = ["Outcome", "Reason", "Strategy", "choose", "even", "fill_in_slots", "stage"]

# What a question of this module answers: the strategy the arguments allow, or why none.
Outcome = Union[Strategy, Reason]


def choose(tensor_list: Any, tensor: Any, world: int, rank: int) -> Outcome:
    """The strategy for ``all_gather(tensor_list, tensor)`` on this rank: DIRECT, REBIND or a reason."""
    problem = _check_input(tensor) or _check_slots(tensor_list, tensor, world)
    if problem is not None:
        return problem
    # Adjacent slots whose buffer elision handed out as a result must not be
    # written in place: that would change the result. They are rebound instead.
    if _adjacent(tensor_list) and not elision.any_given(tensor_list):
        if _input_overlaps_region(tensor, tensor_list, rank):
            return Reason.INPUT_OVERLAPS_OUTPUT
        return Strategy.DIRECT
    return _rebind_refusal(tensor_list, tensor) or Strategy.REBIND


def rebinds_as_kept(
    tensor_list: list, tensor: torch.Tensor, shape: torch.Size, keys: Any, rank: int = 0, versioned: bool = True
) -> Optional[List[int]]:
    """Whether ``choose`` would answer REBIND for these CPU slots, in one call: a kept plan's
    per-call check (``memgather.engine.kept``), where the input was found as when it was kept.
    Returns the slots' version counters (``slots.versions``; ``versioned`` False: none are read, and
    the list is empty), or None.

    ``rank`` is not needed (the signature is ``direct_as_kept``'s). ``keys`` are the dispatch keys of
    a slot that passed ``choose`` in full: the same keys mean the same device type, a strided
    layout, no conjugate or negative bit, the same inference status (inference mode is part of the
    kept plan's key) and no functorch wrapper. Each slot is then held to every other fact ``_check_slots`` and
    ``_rebind_refusal`` read: the input's dtype, the shape, no grad, contiguous, private memory held
    by the slot alone (``compat.exclusive_cpu_slots``, not pinned), not the input itself, no slot
    twice, and the second slot not starting where the first ends (storages emptied by
    ``resize_(0)`` all start at address 0: ``_adjacent`` may find such slots adjacent, and
    choose() answers DIRECT). A None sends the call to the full plan, which names the precise
    reason.
    """
    return _rebinds_as_kept(tensor_list, tensor, shape, keys, versioned, False)


def made_like_as_kept(
    tensor_list: list, tensor: torch.Tensor, shape: torch.Size, keys: Any, versioned: bool = True
) -> Optional[List[int]]:
    """``rebinds_as_kept`` for slots the call site's code proves new tensors made like the input
    (``memgather.patching.proof.slots_like_input``: ``torch.empty_like(tensor)`` and its kin), of an
    input found as when the plan was kept and contiguous, where no tracer runs (the wrapper asked:
    ``compat.code_between_statements``). Code may still run between the slots' making and this
    check (a finalizer, a kernel registered over the factory, a thread changing the input), so
    each slot is read for every fact a rebind rests on but two, taken from the factory: that the
    memory is not pinned, and that no two slots start at address 0 (storages emptied since).
    """
    return _rebinds_as_kept(tensor_list, tensor, shape, keys, versioned, True)


def _rebinds_as_kept(
    tensor_list: list, tensor: torch.Tensor, shape: torch.Size, keys: Any, versioned: bool, made_like: bool
) -> Optional[List[int]]:
    if len(tensor_list) < 2:
        return None  # one slot is a region of its own: choose() answers DIRECT for it
    dtype, read_keys, plain = tensor.dtype, keys_of, torch.Tensor
    versions: List[int] = []
    read = versions.append
    try:
        for slot in tensor_list:
            if not (
                type(slot) is plain
                and slot is not tensor
                and slot.dtype is dtype
                and slot.shape == shape
                and not slot.requires_grad
                and read_keys(slot) == keys  # type: ignore[misc]  # present: kept plans need it
                and slot.is_contiguous()
            ):
                return None
            if versioned:
                read(slot._version)
        # (Their memory read once every slot was found a plain dense CPU tensor: one with a storage.)
        if not compat.exclusive_cpu_slots(tensor_list, unpinned=not made_like):
            return None
        if not made_like:
            first, second = tensor_list[0], tensor_list[1]
            if second.data_ptr() == first.data_ptr() + first.numel() * first.element_size():
                return None  # adjacent, perhaps: choose() tells whether DIRECT
    except RuntimeError:  # (no storage, no version counter: slots made otherwise than the kept plan's)
        return None
    return versions if len(set(map(id, tensor_list))) == len(tensor_list) else None


def direct_as_kept(
    tensor_list: list, tensor: torch.Tensor, shape: torch.Size, keys: Any, rank: int, versioned: bool = True
) -> Optional[List[int]]:
    """Whether ``choose`` would answer DIRECT for these slots, read in one pass: a kept plan's
    per-call check (``memgather.engine.kept``), where the input was found as when it was kept.
    Returns the slots' version counters, read on the way, or None.

    ``keys`` and ``versioned`` as for ``rebinds_as_kept``. Each slot is held to what
    ``_check_slots`` and ``_adjacent`` read: a plain tensor of the input's dtype and shape, no
    grad, contiguous, starting where the slot before it ends, in one storage (distinct addresses
    of non-empty slots: no slot twice). Then ``_input_overlaps_region`` must clear the input.
    """
    dtype = tensor.dtype
    start = step = storage = 0
    before = []
    for index, slot in enumerate(tensor_list):
        if not (
            type(slot) is torch.Tensor
            and slot.dtype is dtype
            and slot.shape == shape
            and not slot.requires_grad
            and keys_of(slot) == keys  # type: ignore[misc]  # present: kept plans need it
            and slot.is_contiguous()
        ):
            return None
        # Addresses read only once the keys said dense memory (a sparse slot has none to read).
        if index == 0:
            start, step, storage = slot.data_ptr(), slot.numel() * slot.element_size(), compat.storage_ptr(slot)
        elif slot.data_ptr() != start + index * step or compat.storage_ptr(slot) != storage:
            return None
        if versioned:
            before.append(slot._version)
    return before if step > 0 and not _input_overlaps_region(tensor, tensor_list, rank) else None


keys_of = compat.dispatch_keys


def _check_input(tensor: Any) -> Optional[Reason]:
    if not isinstance(tensor, torch.Tensor):
        return Reason.NOT_A_TENSOR
    if _odd_layout(tensor):
        return Reason.UNSUPPORTED_LAYOUT
    if tensor.numel() == 0:
        return Reason.EMPTY
    return None


def _odd_layout(t: torch.Tensor) -> bool:
    return t.layout is not torch.strided or t.is_quantized or t.is_conj() or t.is_neg()


def _check_slots(tensor_list: Any, tensor: torch.Tensor, world: int) -> Optional[Reason]:
    if type(tensor_list) is not list:
        return Reason.NOT_A_LIST
    if len(tensor_list) != world:
        return Reason.WRONG_LENGTH
    # Read once: every slot is held to the input's.
    dtype, device, shape, strided = tensor.dtype, tensor.device, tensor.shape, torch.strided
    for slot in tensor_list:
        # Given slots are plain tensors sharing a result's buffer. Armed ones were made plain
        # before the call was planned (``elision.disarm_reused``): any other class is the caller's.
        if type(slot) is not torch.Tensor and type(slot) is not elision.GivenSlot:
            return Reason.SLOT_SUBCLASS if isinstance(slot, torch.Tensor) else Reason.NOT_A_TENSOR
        if slot.dtype != dtype:
            return Reason.DTYPE_MISMATCH
        if slot.device != device:
            return Reason.DEVICE_MISMATCH
        # Not quantized: the dtype equals the input's, which was checked.
        if slot.layout is not strided or slot.is_conj() or slot.is_neg():
            return Reason.UNSUPPORTED_LAYOUT
        if slot.shape != shape:
            return Reason.UNEVEN_SLOTS
        if slot.requires_grad:
            return Reason.SLOT_REQUIRES_GRAD
        if slot.is_inference() and not compat.inference_mode_enabled():
            return Reason.INFERENCE_TENSOR
    if len({id(slot) for slot in tensor_list}) != world:
        return Reason.DUPLICATE_SLOT
    return None


def _adjacent(slots: list) -> bool:
    """Slots are contiguous views, in order, tiling one region of one storage."""
    first = slots[0]
    step = first.numel() * first.element_size()
    start = first.data_ptr()
    # Addresses first: they rule out fresh slots at once (the second slot's, most often), without
    # a storage object.
    if len(slots) > 1 and slots[1].data_ptr() != start + step:
        return False
    if any(slot.data_ptr() != start + index * step for index, slot in enumerate(slots)):
        return False
    storage_ptr = compat.storage_ptr(first)
    return all(slot.is_contiguous() and compat.storage_ptr(slot) == storage_ptr for slot in slots)


def _input_overlaps_region(tensor: torch.Tensor, slots: list, rank: int) -> bool:
    """The input shares the region's storage anywhere but exactly its own slot.

    Exactly its own slot is safe (every route reads the input before anything
    is written there); anything else could be overwritten before it is sent.
    """
    if compat.storage_ptr(tensor) != compat.storage_ptr(slots[0]):
        return False
    own = slots[rank]
    return not (tensor.data_ptr() == own.data_ptr() and tensor.is_contiguous())


def _rebind_refusal(slots: list, tensor: torch.Tensor) -> Optional[Reason]:
    """Why the slots may not be released and rebound, or None where they may."""
    if not compat.can_prove_exclusive():
        return Reason.CANNOT_PROVE_EXCLUSIVE
    for slot in slots:
        # Rebinding to a contiguous view would change a slot's strides, and
        # ranks could disagree on a permuted layout: contiguous slots only.
        if not slot.is_contiguous():
            return Reason.SLOT_NOT_CONTIGUOUS
        if slot.is_cuda:
            refused = cuda_memory.refusal(cuda_memory.read(slot))
            if refused is not None:
                return refused
            alone = None  # asked below, once the CUDA facts allowed it
        else:
            private, alone = compat.cpu_slot_facts(slot)
            if not private:
                return Reason.SLOT_MEMORY
        if slot is tensor:  # the only way an input can share a storage a slot holds alone
            return Reason.INPUT_OVERLAPS_OUTPUT
        if alone or (alone is None and compat.holds_storage_alone(slot)):
            continue
        # A slot sharing its buffer only with a result elision handed out may
        # be released: rebinding never writes into that buffer. Unless the
        # input is (a view of) that result.
        if not elision.is_given(slot):
            return Reason.SLOTS_SHARED
        if compat.storage_ptr(slot) == compat.storage_ptr(tensor):
            return Reason.INPUT_OVERLAPS_OUTPUT
    return None


# Rebinding needs proof that nothing else holds a slot's memory, and that the memory
# means nothing where it is (SLOT_MEMORY). Filling the slots where they lie does not: torch's
# own all_gather writes there too, so a view someone kept sees what it would see under torch.
# It needs only contiguous slots that do not overlap one another, and an input that overlaps
# none of them, unless it is exactly
# its own slot.
_FILLABLE = (Reason.CANNOT_PROVE_EXCLUSIVE, Reason.SLOTS_SHARED, Reason.SLOT_MEMORY)


def fill_in_slots(tensor_list: list, tensor: torch.Tensor, rank: int, refused: Reason) -> Outcome:
    """IN_SLOTS for a route that writes into the slots where they lie, where a rebind was refused."""
    if refused not in _FILLABLE or elision.any_given(tensor_list):
        return refused
    if not all(slot.is_contiguous() for slot in tensor_list):
        return Reason.SLOT_NOT_CONTIGUOUS
    spans = sorted(_span(slot) for slot in tensor_list)
    if any(end > next_start for (_, end), (next_start, _) in zip(spans, spans[1:])):
        return refused  # two slots share memory: torch's sequential copies decide, not broadcasts
    own = tensor_list[rank]
    if tensor.data_ptr() == own.data_ptr() and tensor.is_contiguous():
        return Strategy.IN_SLOTS
    start, end = _span(tensor)
    if any(start < slot_end and slot_start < end for slot_start, slot_end in spans):
        return Reason.INPUT_OVERLAPS_OUTPUT
    return Strategy.IN_SLOTS


def _span(tensor: torch.Tensor) -> tuple:
    """[first, last + 1) byte address a strided, non-empty tensor may touch (torch strides are >= 0)."""
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def even(tensor_list: list, tensor: torch.Tensor) -> bool:
    """Every slot shaped, typed and placed like the input: in a working program, alike on every rank."""
    return all(
        slot.shape == tensor.shape and slot.dtype == tensor.dtype and slot.device == tensor.device
        for slot in tensor_list
    )


# What a rank may refuse a rebind for on its own while every other rank rebinds: its slots'
# memory, layout or aliasing, or a dispatch mode of its own (a torch-function mode of its own
# is planner._under_function_mode's). The staged copy writes such slots as torch's call would
# (the bytes, where each slot lies).
_STAGEABLE = frozenset(
    (
        Reason.DISPATCH_MODE,
        Reason.SLOT_SUBCLASS,
        Reason.DUPLICATE_SLOT,
        Reason.INPUT_OVERLAPS_OUTPUT,
        Reason.INPUT_NOT_CONTIGUOUS,
        Reason.SLOT_NOT_CONTIGUOUS,
        Reason.SLOTS_SHARED,
        Reason.SLOT_MEMORY,
        Reason.SLOT_WRITTEN,
        Reason.CUDA_GRAPHS,
        Reason.CANNOT_PROVE_EXCLUSIVE,
    )
)


def stage(refused: Reason, tensor_list: list, tensor: torch.Tensor) -> Outcome:
    """STAGED where ``refused`` is a reason of this rank's own slots and torch's call would write
    them without an error; else ``refused`` (torch's call then raises on this rank, as it would
    without memgather, or the reason is one every rank of a working program shares)."""
    if refused not in _STAGEABLE or _odd_layout(tensor):
        return refused
    inference = compat.inference_mode_enabled()
    for slot in tensor_list:
        # torch refuses these in-place writes (a leaf that requires grad, an inference tensor outside
        # inference mode) or reads them otherwise (conj and neg bits): the rank keeps torch's outcome.
        if slot.layout is not torch.strided or slot.is_conj() or slot.is_neg() or slot.requires_grad:
            return refused
        if slot.is_inference() and not inference:
            return refused
    return Strategy.STAGED
