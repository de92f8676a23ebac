"""The names of what memgather does with a call, and of why it leaves one to torch."""

from __future__ import annotations

import enum


class Strategy(str, enum.Enum):
    """How one call is carried out."""

    DIRECT = "direct"
    # DIRECT into slots that alone tile one buffer (an earlier rebind's), armed for elision as a
    # rebind's are; counted as "direct": the same single call into the same region.
    ARMED_DIRECT = "armed_direct"
    REBIND = "rebind"
    # REBIND of plain CPU slots, each released by parking it (``slots.rebind``): its one set_() into the
    # buffer leaves its version counter as torch's copy does, with nothing to set back; counted as "rebind".
    PARKED_REBIND = "parked_rebind"
    IN_SLOTS = "in_slots"
    STAGED = "staged"  # a temporary flat buffer, the single-tensor call, a copy into the slots where they lie
    UNPADDED = "unpadded"  # a library's uneven gather taken over: every rank's rows once into one tensor
    INTO_RESULT = "into_result"  # memgather.gather's small call: torch's single-tensor call into its result
    # An object collective: each rank's pickled bytes broadcast at their own size, one part at a time.
    OBJECT_PARTS = "object_parts"
    # An object collective whose parts are all small: one gather of every rank's bytes padded to the largest.
    OBJECT_PADDED = "object_padded"
    FALLBACK = "fallback"


class Reason(str, enum.Enum):
    """Why a call went to the original ``all_gather``."""

    NOT_INITIALIZED = "not_initialized"  # no default process group: torch raises its own error
    NOT_IN_GROUP = "not_in_group"  # torch warns and returns None
    UNREGISTERED_GROUP = "unregistered_group"  # a group kept through destroy_process_group(): torch's call runs on it
    COMPILING = "compiling"  # Dynamo maps all_gather to functional collectives itself
    COALESCING = "coalescing"  # inside _coalescing_manager, torch queues the op
    GRAPH_CAPTURE = "graph_capture"  # CUDA graph capture: no host sync, no allocation, no free may happen
    # a CUDA graph was captured in this process (or CUDA was in use before memgather could watch for
    # one): any CUDA slot may be memory it replays
    CUDA_GRAPHS = "cuda_graphs"
    NO_PRIMITIVE = "no_primitive"  # this torch has no single-tensor all-gather
    BACKEND = "backend"  # backend/device pair without a route known to be safe
    NCCL2 = "nccl2"  # ProcessGroupNCCL2 and no cat elided: torch fills the slots at the floor itself
    BELOW_THRESHOLD = "below_threshold"  # gloo or NCCL call too small for a saving worth memgather's time
    UNSUPPORTED_DTYPE = "unsupported_dtype"  # a dtype the backend's collectives refuse: torch raises, slots untouched
    TORCH_FUNCTION = "torch_function"  # input overrides __torch_function__
    DISPATCH_MODE = (
        "dispatch_mode"  # a TorchDispatchMode is active: it would see memgather's own operations (agreed on)
    )
    FUNCTORCH = "functorch"  # a torch.func transform runs, or the input or a slot is its wrapper
    FORWARD_AD = "forward_ad"  # a forward-AD dual level is open: a slot may carry a tangent, which set_ refuses
    BAD_ARGUMENTS = "bad_arguments"  # arguments all_gather's signature does not take, an async_op torch refuses
    NOT_A_LIST = "not_a_list"  # tuples and other sequences: torch rejects them
    WRONG_LENGTH = "wrong_length"  # list length is not the group size
    NOT_A_TENSOR = "not_a_tensor"  # input or a slot is not a tensor
    SLOT_SUBCLASS = "slot_subclass"  # a slot is a tensor subclass (Parameter, ...)
    UNSUPPORTED_LAYOUT = "unsupported_layout"  # sparse, quantized, conj/neg bit, ...
    EMPTY = "empty"  # nothing to gather, nothing to save
    DTYPE_MISMATCH = "dtype_mismatch"
    DEVICE_MISMATCH = "device_mismatch"
    UNEVEN_SLOTS = "uneven_slots"  # a slot's shape differs from the input's
    SLOT_REQUIRES_GRAD = "slot_requires_grad"
    INFERENCE_TENSOR = "inference_tensor"  # in-place write torch would refuse
    DUPLICATE_SLOT = "duplicate_slot"  # one tensor object appears twice
    INPUT_OVERLAPS_OUTPUT = "input_overlaps_output"
    INPUT_NOT_CONTIGUOUS = "input_not_contiguous"  # on a route that reads raw memory (NCCL)
    SLOT_NOT_CONTIGUOUS = "slot_not_contiguous"  # e.g. empty_like of a transposed input
    SLOTS_SHARED = "slots_shared"  # neither adjacent views nor sole owners
    SLOT_MEMORY = "slot_memory"  # shared, pinned or foreign memory: a rebind would move it
    SLOT_WRITTEN = "slot_written"  # a CUDA slot written before (or without a version counter): maybe a graph's
    CANNOT_PROVE_EXCLUSIVE = "cannot_prove_exclusive"  # torch lacks a storage use count
    PEER_FALLBACK = "peer_fallback"  # another rank could not take the rewired path
    REPLACED = "replaced"  # a helper of torch's object collectives replaced (a mock, a patch): torch runs it
    UNEVEN_RANKS = "uneven_ranks"  # ranks' inputs differ (check off: torch decides)
