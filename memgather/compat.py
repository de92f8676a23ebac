"""What the installed torch can do.

Everything memgather needs from torch beyond the public collectives is looked up
here once, so the rest of the package can ask a plain question ("is there a
single-tensor all-gather?") and get an answer with its reason attached. Each is
found by feature, except what gloo implements behind an existing function: that
is a fact measured on the released wheels, recorded here as data.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, ContextManager, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from packaging.version import Version

_log = logging.getLogger("memgather")

# Preferred first. `all_gather_into_tensor` and `_all_gather_base` emit a
# FutureWarning on torch 2.13 where `all_gather_single` exists, so the order
# alone keeps memgather's own calls free of deprecation warnings.
_PRIMITIVE_NAMES = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")


@dataclass(frozen=True)
class Primitive:
    """The single-tensor all-gather memgather calls, and why it was chosen.

    ``function`` is None when this torch has none; memgather then leaves every
    call to the original ``all_gather``.
    """

    name: Optional[str]
    function: Optional[Callable[..., Any]]
    reason: str
    torch_version: str


@lru_cache(maxsize=None)
def single_tensor_primitive() -> Primitive:
    """Detect the best single-tensor all-gather of this torch (cached)."""
    version = torch.__version__
    for position, name in enumerate(_PRIMITIVE_NAMES):
        function = getattr(dist, name, None)
        if callable(function):
            skipped = ", ".join(_PRIMITIVE_NAMES[:position]) or "nothing"
            reason = f"torch {version} has torch.distributed.{name} (absent before it: {skipped})"
            return Primitive(name, function, reason, version)
    reason = f"torch {version} has none of {', '.join(_PRIMITIVE_NAMES)}"
    _log.warning("memgather is inactive: %s; every gather goes to torch's all_gather", reason)
    return Primitive(None, None, reason, version)


# Measured on real wheels from the package index, 2 gloo ranks calling the
# single-tensor all-gather: torch 1.13.1, 2.0.1 and 2.1.2 raise "no support for
# _allgather_base in Gloo process group"; 2.2.0, 2.3.1, 2.6.0, 2.12.1, 2.13.0 and
# 2.15.0 gather (tests/test_releases.py checks it on each release tox runs).
GLOO_SINGLE_TENSOR_SINCE = (2, 2)


@lru_cache(maxsize=None)
def gloo_has_single_tensor() -> bool:
    """Whether this torch's gloo backend implements the single-tensor all-gather."""
    return torch_release() >= GLOO_SINGLE_TENSOR_SINCE


@lru_cache(maxsize=None)
def torch_release() -> Tuple[int, ...]:
    """(major, minor) of the torch memgather runs on: what release-dependent behaviour is read from."""
    return _release(torch.__version__)


def _release(version: str) -> Tuple[int, ...]:
    """(major, minor) of a torch version such as '2.13.0+cpu' or '2.2.0a0+git1234'."""
    return Version(version).release[:2]


def _find_is_compiling() -> Callable[[], bool]:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling
    try:  # torch < 2.3
        from torch._dynamo import is_compiling
    except ImportError:  # torch without Dynamo: nothing is ever compiled
        return lambda: False
    return is_compiling


is_compiling: Callable[[], bool] = _find_is_compiling()

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_subclass_hooks_off = getattr(torch._C, "DisableTorchFunctionSubclass", None)


def _find_dispatch_mode_active() -> Callable[[], bool]:
    length = getattr(torch._C, "_len_torch_dispatch_stack", None)
    if length is not None:
        return lambda: length() > 0
    current = getattr(torch._C, "_get_torch_dispatch_mode", None)  # torch 1.13: one mode at most
    if current is not None:
        return lambda: current() is not None
    return lambda: False


# Whether a Python ``TorchDispatchMode`` is active (it sees every aten call torch makes).
dispatch_mode_active: Callable[[], bool] = _find_dispatch_mode_active()


_function_mode_enabled = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_tensor_torch_function = torch.Tensor.__torch_function__.__func__  # type: ignore[attr-defined]  # a classmethod's function


# Whether a ``TorchFunctionMode`` is active (one that would see memgather's own tensor reads): torch's
# own query, asked on every call. A torch without it (1.13) answers True: memgather then reads with
# torch functions switched off, which hides its reads from a mode that may be there.
function_mode_active: Callable[[], bool] = _function_mode_enabled or (lambda: True)


def torch_function_mode_only(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` sees ``__torch_function__`` only because a ``TorchFunctionMode`` is active
    (``with torch.device(...)``, ``torch.set_default_device``), not because its type overrides it."""
    if _function_mode_enabled is None or not _function_mode_enabled():
        return False
    impl = getattr(type(tensor), "__torch_function__", None)
    impl = getattr(impl, "__func__", impl)
    return impl is _tensor_torch_function or impl is torch._C._disabled_torch_function_impl


_function_mode_stack = getattr(torch.overrides, "_get_current_function_mode_stack", None)


def only_device_modes(tensor: torch.Tensor) -> bool:
    """Whether the only ``__torch_function__`` ``tensor`` sees is torch's own default-device mode
    (``with torch.device(...)``, ``torch.set_default_device``). That mode only fills in the device of
    factory calls that name none; memgather's name theirs, and torch's ``all_gather`` passes through
    it unchanged, so memgather may act under it as if it were not there."""
    if _function_mode_stack is None or not torch_function_mode_only(tensor):
        return False
    return device_modes_only()


def device_modes_only() -> bool:
    """Whether every ``TorchFunctionMode`` active is torch's own default-device mode (none active: True)."""
    if _function_mode_stack is None:
        return not function_mode_active()
    return all(
        type(mode).__name__ == "DeviceContext" and type(mode).__module__ == "torch.utils._device"
        for mode in _function_mode_stack()
    )


@contextlib.contextmanager
def outside_modes() -> Iterator[None]:
    """A block that no torch function or dispatch mode, subclass hook or functorch transform sees.

    Takes effect as the block is entered (not when called), so that it nests with other
    switches in the order the ``with`` statement names them.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._C.DisableTorchFunction())
        stack.enter_context(_dispatch_modes_off())
        disable_functorch = getattr(torch._C, "_DisableFuncTorch", None)
        if disable_functorch is not None:
            guard = disable_functorch()
            if hasattr(guard, "__enter__"):
                stack.enter_context(guard)
            else:  # torch 1.13: a guard that holds while it lives, not a context manager
                holder = [guard]
                del guard
                stack.callback(holder.clear)  # its last reference, dropped as the block ends
        yield


@contextlib.contextmanager
def _dispatch_modes_off() -> Iterator[None]:
    """A block that no Python dispatch mode sees: torch's own switch, or (torch 1.13, which has
    none) the modes popped off torch's stack and pushed back in order afterwards."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:
        pass
    else:
        with _disable_current_modes():
            yield
        return
    try:
        from torch.utils._python_dispatch import _pop_mode, _push_mode
    except ImportError:  # torch without Python dispatch modes
        yield
        return
    popped = []
    try:
        while dispatch_mode_active():
            popped.append(_pop_mode())
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def subclass_hooks_off() -> ContextManager[Any]:
    """A block where tensor subclasses' ``__torch_function__`` does not run: memgather looking at its own slots.

    torch 1.13 has no such switch; there memgather never arms a slot, so there is nothing to switch off.
    """
    return _subclass_hooks_off() if _subclass_hooks_off is not None else contextlib.nullcontext()


def _unhooked(tensor: torch.Tensor, read: Callable[[torch.Tensor], Any]) -> Any:
    """``read(tensor)`` with no subclass hook run: memgather looking at its own slots.

    A plain ``torch.Tensor`` has no hook to switch off, and most slots are plain:
    they skip the switch, which costs more than what they read.
    """
    if type(tensor) is torch.Tensor:
        return read(tensor)
    with subclass_hooks_off():
        return read(tensor)


def nbytes(tensor: torch.Tensor) -> int:
    """``tensor.numel() * tensor.element_size()``, read with no subclass hook run (torch's call reads neither)."""
    return int(_unhooked(tensor, lambda t: t.numel() * t.element_size()))


def _find_storage_ptr() -> Callable[[torch.Tensor], int]:
    if hasattr(torch.Tensor, "untyped_storage"):
        return lambda tensor: tensor.untyped_storage().data_ptr()
    return lambda tensor: tensor.storage().data_ptr()  # torch 1.13: the typed storage is the only one


# Where the memory of a tensor's storage starts: equal for tensors sharing one storage.
storage_ptr: Callable[[torch.Tensor], int] = _find_storage_ptr()


def can_prove_exclusive() -> bool:
    """Whether this torch lets memgather prove a tensor alone holds its storage."""
    return _use_count is not None and _tensor_use_count is not None


def holds_storage_alone(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is the only holder of its storage, and nothing in C++ holds ``tensor``.

    Three counts must all show a single holder: the C++ use count of the
    storage (views and other tensors add to it), the Python reference count
    of the storage object (a caller's ``t.untyped_storage()`` kept in a
    variable adds to it, not to the use count), and the tensor's own C++ use
    count (a DLPack capsule holds the tensor, not its storage: a rebind would
    free the memory under its consumer).
    """
    return storage_holders(tensor) == 1 and held_only_by_python(tensor)


def storage_holders(tensor: torch.Tensor) -> Optional[int]:
    """How many tensors hold ``tensor``'s storage; None when a storage object is kept in Python too."""
    use_count, references = _storage_counts(tensor)
    if references != _SOLE_HOLDER_COUNTS[1]:
        return None
    return use_count - _SOLE_HOLDER_COUNTS[0] + 1


def _untyped_storage(tensor: torch.Tensor) -> Any:
    return tensor.untyped_storage()


def _storage_counts(tensor: torch.Tensor) -> Tuple[int, int]:
    # The local storage object dies on return, so it cannot keep the memory
    # alive through a rebind. Subclass hooks stay out: this is memgather looking.
    storage = tensor.untyped_storage() if type(tensor) is torch.Tensor else _unhooked(tensor, _untyped_storage)
    return _use_count(storage._cdata), sys.getrefcount(storage)  # type: ignore[misc]  # only called when present


# What a tensor nobody else knows reports here; calibrated rather than
# hard-coded, since torch and CPython differ in the references they add.
# Outside any mode the importer may be in: a fake tensor's counts would calibrate nothing.
with torch.inference_mode(False), outside_modes():
    _SOLE_HOLDER_COUNTS = _storage_counts(torch.empty(1)) if _use_count is not None else (0, 0)

# Handles to the tensor itself (not its storage) held in C++: a DLPack capsule,
# a tensor saved for backward, a view's base. Python references do not count.
_tensor_use_count = getattr(torch.Tensor, "_use_count", None)


def _find_set_versions() -> Optional[Callable[[Sequence[torch.Tensor], Sequence[int]], None]]:
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None:
        return None
    with torch.inference_mode(False), outside_modes():  # memgather may be imported inside either
        probe = torch.empty(0)
    try:  # torch 2.2 on: sequences of tensors and versions, set in one call
        setter((probe,), (0,))
        return setter
    except TypeError:  # torch 2.0 and 2.1: one tensor, one version

        def one_by_one(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
            for tensor, version in zip(tensors, versions):
                setter(tensor, version)

        return one_by_one


_set_versions = _find_set_versions()


def can_prove_alias_free() -> bool:
    """Whether this torch lets memgather prove, at a cat, that nothing but the slots sees their buffer."""
    return _use_count is not None and _tensor_use_count is not None and _set_versions is not None


def held_only_by_python(tensor: torch.Tensor) -> bool:
    """No C++ handle to ``tensor`` beyond its Python object (only where can_prove_alias_free())."""
    if type(tensor) is torch.Tensor:  # a plain tensor has no hook to switch off
        return _tensor_use_count(tensor) == 1  # type: ignore[misc]  # present: can_prove_alias_free()
    return _unhooked(tensor, _tensor_use_count) == 1  # type: ignore[arg-type]  # present: can_prove_alias_free()


_is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


# Whether a torch.func transform (grad, vmap, jvp, functionalize) is running: memgather's own in-place
# layout of the slots (set_, .data =) is no operation of the program the transform sees, and a
# tensor made under it is the transform's wrapper. Not one on a torch without functorch.
functorch_active: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


_forward_ad = getattr(torch.autograd, "forward_ad", None)


def forward_ad_active() -> bool:
    """Whether a forward-AD dual level is open (``torch.autograd.forward_ad.dual_level``): a slot may
    then carry a tangent, and forward AD refuses ``set_`` on it (torch's copies carry tangents)."""
    return _forward_ad is not None and getattr(_forward_ad, "_current_level", -1) >= 0


def functorch_wrapped(tensor: torch.Tensor, others: Iterable[Any] = ()) -> bool:
    """Whether ``tensor`` or any tensor among ``others`` is a functorch transform's wrapper (vmap's
    BatchedTensor, grad's tracking tensor): it has no storage of its own for memgather to lay out."""
    if _is_functorch_wrapped is None:
        return False
    if _is_functorch_wrapped(tensor):
        return True
    for other in others:
        if isinstance(other, torch.Tensor) and _is_functorch_wrapped(other):
            return True
    return False


def holds(tensors: List[torch.Tensor]) -> Optional[List[Tuple[int, int]]]:
    """Each tensor's storage use count and Python reference count (None where this torch cannot
    tell, or off the CPU): read before a collective, for ``await_release`` to wait until every
    hold the backend took is gone."""
    if _use_count is None or not tensors or not tensors[0].is_cpu:
        return None
    return [(_use_count(_unhooked(t, _untyped_storage)._cdata), sys.getrefcount(t)) for t in tensors]


def _held_more(now: Optional[List[Tuple[int, int]]], before: List[Tuple[int, int]]) -> bool:
    return now is not None and any(n[0] > b[0] or n[1] > b[1] for n, b in zip(now, before))


def await_release(
    tensors: List[torch.Tensor], timeout_s: float = 5.0, before: Optional[List[Tuple[int, int]]] = None
) -> None:
    """Wait (bounded) until no C++ handle but Python's holds ``tensors``, nor more than ``before``
    (``holds`` read before the collective) holds them or their storages, where given.

    A finished collective's work object is released by the backend's worker
    thread a moment after ``wait()`` returns. Until then it holds the output,
    which a storage use count taken at that moment would see as someone else's
    hold: memgather waits for it so that its own later proofs (a rebind of the
    same slots, an elided cat) do not depend on a race. ``tensors`` are tensors
    memgather made for the collective, which no caller can hold, so the wait ends
    when the worker lets go; the bound is generous because on a loaded machine
    that can take longer than half a second, and a wait cut short refuses an
    elision that was safe.
    """
    if _tensor_use_count is None or not tensors or not tensors[0].is_cpu:
        return  # gloo's worker lets go within microseconds (up to tens of ms on a loaded machine);
        # what another backend's watchdog does with finished work is not known here: the proofs decide
    deadline = None
    while any([_tensor_use_count(t) > 1 for t in tensors]) or (
        # torch may also keep a Python list of a tensor it was given until its worker lets go
        # of the work (the worker needs the GIL for that): the tensor, and so the storage, would
        # outlive memgather's own references, and an elided cat's proof see one holder too many.
        before is not None and _held_more(holds(tensors), before)
    ):
        now = time.monotonic()
        deadline = deadline or now + timeout_s
        if now > deadline:
            return  # held for real: the proofs will refuse, which is safe
        time.sleep(0)


def hold(tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``holds([tensor])`` of one tensor, the single-tensor route's buffer, read for ``await_release_of``
    (called from the same frame: the Python references of that frame count alike in both)."""
    if _use_count is None or not tensor.is_cpu:
        return None
    return _use_count(tensor.untyped_storage()._cdata), sys.getrefcount(tensor)


def await_release_of(tensor: torch.Tensor, before: Optional[Tuple[int, int]], timeout_s: float = 5.0) -> None:
    """``await_release([tensor], before=...)`` for one tensor, ``before`` read by ``hold``: the single
    route's buffer, on every rewired call, reads its counts once where nothing holds it any more."""
    if _tensor_use_count is None or not tensor.is_cpu:
        return
    deadline = None
    # The reads are hold()'s, made at the same depth below the caller: its references count alike.
    while _tensor_use_count(tensor) > 1 or (
        before is not None
        and (_use_count(tensor.untyped_storage()._cdata) > before[0] or sys.getrefcount(tensor) > before[1])  # type: ignore[misc]  # present: before was read
    ):
        now = time.monotonic()
        deadline = deadline or now + timeout_s
        if now > deadline:
            return  # held for real: the proofs will refuse, which is safe
        time.sleep(0)


def can_set_version() -> bool:
    """Whether this torch lets memgather set a version counter (torch 2.0 on)."""
    return _set_versions is not None


def set_version(tensor: torch.Tensor, version: int) -> None:
    """Put ``tensor``'s version counter back where torch would have left it (no-op where torch cannot,
    and for inference tensors, which have no version counter)."""
    if _set_versions is not None and not tensor.is_inference():
        _set_versions((tensor,), (version,))


def set_versions(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """``set_version`` for tensors that all have a version counter (none an inference tensor), at once."""
    if _set_versions is not None:
        _set_versions(tensors, versions)


def default_private_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is plain private memory of torch's default CPU allocator.

    Only then may a rebind release it and put the data elsewhere: shared memory
    (``share_memory_()``, another process may map it), pinned memory, memory
    that torch did not allocate (``from_numpy``, ``frombuffer``, DLPack) or
    lent to numpy (``.numpy()``: its arrays point into it, and keep only the
    tensor object alive) all mean something where they are; torch marks the
    last two not resizable. CUDA memory has rules of its own
    (``memgather.engine.cuda_memory``): this answers False for it.
    """
    if type(tensor) is torch.Tensor:  # a plain tensor has no hook to switch off
        return _default_private_memory(tensor)
    return bool(_unhooked(tensor, _default_private_memory))


def cpu_slot_facts(tensor: torch.Tensor) -> Tuple[bool, bool]:
    """``(default_private_memory(tensor), holds_storage_alone(tensor))``, the storage read once: the
    two facts a rebind needs of each CPU slot (only where can_prove_exclusive())."""
    if type(tensor) is not torch.Tensor:
        return default_private_memory(tensor), holds_storage_alone(tensor)
    private, use_count, references = _cpu_storage_facts(tensor)
    if use_count != _SOLE_CPU_FACTS[0] or references != _SOLE_CPU_FACTS[1]:
        return private, False
    return private, _tensor_use_count(tensor) == 1  # type: ignore[misc]  # present: can_prove_exclusive()


def _cpu_storage_facts(tensor: torch.Tensor) -> Tuple[bool, int, int]:
    # As _storage_counts: the local storage object dies on return, and the counts it reads are
    # calibrated below on a tensor nobody else knows, through this very function.
    storage = tensor.untyped_storage()
    private = tensor.is_cpu and storage.resizable() and not storage.is_shared() and not tensor.is_pinned()
    return private, _use_count(storage._cdata), sys.getrefcount(storage)  # type: ignore[misc]  # only called when present


# What a tensor nobody else knows reports through _cpu_storage_facts, calibrated as _SOLE_HOLDER_COUNTS is.
with torch.inference_mode(False), outside_modes():
    _SOLE_CPU_FACTS = _cpu_storage_facts(torch.empty(1))[1:] if _use_count is not None else (0, 0)


def exclusive_cpu_slots(tensors: Sequence[torch.Tensor], unpinned: bool = False) -> bool:
    """Of each of ``tensors``: nothing but it holds its storage, nothing but Python holds it, and its
    memory is resizable and not shared (with ``unpinned``, not pinned either): the reads a kept plan
    makes of every slot of every call, in one loop (only where can_prove_exclusive(), and of plain
    dense CPU tensors). With ``unpinned`` it is what ``cpu_slot_facts(tensor) == (True, True)`` says
    of each (``strategies.rebinds_as_kept``); without, it serves slots whose memory the call site's
    code proved new memory of torch's CPU allocator (``strategies.made_like_as_kept``), which takes
    its not being pinned from the factory.

    The counts are calibrated through reads made as this loop makes them (``_rebindable_counts``:
    the storage held by one local), since the references they add are its own.
    """
    sole_use, sole_references = _SOLE_REBINDABLE
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if not (
            _use_count(storage._cdata) == sole_use  # type: ignore[misc]  # present: can_prove_exclusive()
            and sys.getrefcount(storage) == sole_references
            and _tensor_use_count(tensor) == 1  # type: ignore[misc]  # present: can_prove_exclusive()
            and storage.resizable()
            and not storage.is_shared()
            and not (unpinned and tensor.is_pinned())
        ):
            return False
    return True


def _rebindable_counts(tensor: torch.Tensor) -> Tuple[int, int]:
    # exclusive_cpu_slots' reads, with its references: its calibration.
    storage = tensor.untyped_storage()
    return _use_count(storage._cdata), sys.getrefcount(storage)  # type: ignore[misc]  # only called when present


with torch.inference_mode(False), outside_modes():
    _SOLE_REBINDABLE = _rebindable_counts(torch.empty(1)) if _use_count is not None else (-1, -1)

# The dispatch keys of a tensor: its device type, layout, conjugate and negative bits, whether it is
# an inference tensor or a functorch wrapper, in one read (a kept plan compares them per call).
# None where this torch has no such read: no plan is kept there.
dispatch_keys: Optional[Callable[[torch.Tensor], Any]] = getattr(torch._C, "_dispatch_keys", None)


def _default_private_memory(tensor: torch.Tensor) -> bool:
    if not tensor.is_cpu:
        return False
    storage = tensor.untyped_storage()
    # Not resizable: memory torch did not allocate (from_blob), or exported to numpy
    # (``.numpy()``, ``np.asarray``), whose arrays would point at freed memory.
    return storage.resizable() and not storage.is_shared() and not tensor.is_pinned()


def _find_increment_version() -> Callable[[torch.Tensor], None]:
    graph = getattr(torch.autograd, "graph", None)
    if graph is not None and hasattr(graph, "increment_version"):
        return graph.increment_version
    autograd = torch._C._autograd
    if hasattr(autograd, "_increment_version"):
        return autograd._increment_version
    return _increment_through_empty_view  # torch 1.13 to 2.1


def _increment_through_empty_view(tensor: torch.Tensor) -> None:
    # A view shares its base's version counter, and every in-place op bumps it:
    # an in-place op on an empty view bumps it without touching a byte.
    with torch.no_grad():
        tensor.as_strided((0,), (1,)).zero_()


# The original all_gather bumps each output slot's version counter (autograd
# uses it to detect in-place changes of saved tensors); memgather writing into
# a view of the same memory must bump it too.
increment_version: Callable[[torch.Tensor], None] = _find_increment_version()


def _find_increment_versions() -> Callable[[Sequence[torch.Tensor]], None]:
    with torch.inference_mode(False), outside_modes():
        probe = torch.empty(0)
    # torch 2.4 on: torch.autograd.graph's function takes a sequence, each tensor bumped once (a
    # counter two of them share, twice), and hands it to torch._C's, called here directly where
    # it takes the sequence itself: once per rewired call, the Python wrapper's cost saved.
    candidates: List[Any] = [getattr(torch._C, "_increment_version", None), increment_version]
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            before = probe._version
            candidate((probe,))  # the probe: does this function take a sequence?
            if probe._version == before + 1:
                taking_sequences: Callable[[Sequence[torch.Tensor]], None] = candidate
                return taking_sequences
        except (TypeError, AttributeError, RuntimeError):
            continue

    def one_by_one(tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors:
            increment_version(tensor)

    return one_by_one


# One call for all the slots of a gather: what torch's list call leaves, one bump per slot.
increment_versions: Callable[[Sequence[torch.Tensor]], None] = _find_increment_versions()

# A write steps its tensor's version counter in the ADInplaceOrView kernel, which a thread may
# exclude (torch._C._AutoDispatchBelowADInplaceOrView, an ExcludeDispatchKeyGuard of the key):
# torch's list call then leaves the slots' counters where they were.
_ad_inplace_or_view = getattr(torch._C.DispatchKey, "ADInplaceOrView", None)
_tls_excludes = getattr(torch._C, "_dispatch_tls_is_dispatch_key_excluded", None)


def writes_counted() -> bool:
    """Whether an in-place write made now, on this thread, steps the version counter of what it writes."""
    if _ad_inplace_or_view is None or _tls_excludes is None:
        return True
    return not _tls_excludes(_ad_inplace_or_view)


def not_a_group(group: Any) -> bool:
    """Neither None, a ProcessGroup, nor torch's marker for a rank outside a subgroup (an int; up
    to torch 2.0, a plain ``object()``)."""
    marker = dist.GroupMember.NON_GROUP_MEMBER
    if group is None or isinstance(group, dist.ProcessGroup) or group is marker:
        return False
    return not (type(group) is int and group == marker)


def unregistered_group(group: Any) -> bool:
    """A ProcessGroup object that torch's table of groups no longer lists: one a caller kept
    through ``destroy_process_group()``. torch's calls still run on the object itself, but its
    ranks can no longer be named (``get_process_group_ranks`` raises), which memgather's routes do."""
    if group is None or not isinstance(group, dist.ProcessGroup):
        return False
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    table = getattr(world, "pg_group_ranks", None) if world is not None else getattr(c10d, "_pg_group_ranks", None)
    return table is not None and group not in table


def rank_not_in_group(group: Any) -> bool:
    """torch's own test for 'this rank is not a member of ``group``'."""
    return dist.distributed_c10d._rank_not_in_group(group)


def default_group() -> Any:
    """torch's default group, ``GroupMember.WORLD`` (None before init_process_group)."""
    # torch 2.1 on: GroupMember.WORLD is a property of a metaclass that reads _world.default_pg, a
    # property that reads this attribute; read on every kept plan's call. torch's threaded test
    # groups put a world of another class there (ThreadLocalWorld: properties only), and torch
    # before 2.1 keeps no such attribute: both are read through GroupMember.WORLD.
    try:
        return dist.distributed_c10d._world._default_pg
    except AttributeError:
        return dist.GroupMember.WORLD


def coalesce_state() -> Any:
    """The groups inside ``torch.distributed._coalescing_manager`` now (a dict by group; None: not kept)."""
    # The attribute behind the pg_coalesce_state property: read on every kept plan's call. Read
    # through the property where the world has no such attribute (ThreadLocalWorld, as above); torch
    # 1.13 keeps no such state in Python (its manager only brackets NCCL calls).
    try:
        return dist.distributed_c10d._world._pg_coalesce_state
    except AttributeError:
        return getattr(getattr(dist.distributed_c10d, "_world", None), "pg_coalesce_state", None)


def is_coalescing(group: Any) -> bool:
    """True inside ``torch.distributed._coalescing_manager`` for ``group``."""
    state = coalesce_state()
    if not state:
        return False
    return (group or dist.distributed_c10d._get_default_group()) in state


# torch's NCCL process groups by class. The legacy one (every release's "nccl" up to 2.14)
# flattens a list all_gather into a gathered-size temporary, runs ncclAllGather (the
# single-tensor call's collective too) and copies out. ProcessGroupNCCL2 (torch 2.15's default
# "nccl"; opt-in with TORCH_DIST_USE_NCCL2=1 in 2.14) runs one ncclBroadcast per rank straight
# into the slots: no temporary, and a wire protocol other than the single-tensor call's.
NCCL_FLAVOURS = {"ProcessGroupNCCL": "legacy", "ProcessGroupNCCL2": "nccl2"}


def nccl_flavour(group: Any) -> Optional[str]:
    """ "legacy" or "nccl2" for a process group whose CUDA backend is one of torch's NCCL groups, else None.

    Told by the backend object's class, whatever name the group was created with
    ("nccl", "nccl-legacy", "nccl2", or an environment variable choosing the default).
    """
    try:
        backend = group._get_backend(torch.device("cuda"))
    except (AttributeError, RuntimeError, ValueError, TypeError):  # no CUDA backend in this group
        return None
    if type(backend).__name__ == "_ProcessGroupWrapper":  # TORCH_DISTRIBUTED_DEBUG=DETAIL's checks around it
        backend = getattr(backend, "wrapped_pg", backend)
    return NCCL_FLAVOURS.get(type(backend).__name__)


# The release from which ProcessGroupNCCL2 is "nccl" by default (TORCH_DIST_USE_NCCL2=0 keeps the
# legacy group), and the one in which it is opt-in (TORCH_DIST_USE_NCCL2=1); read in torch 2.14.1's
# and 2.15.0's distributed_c10d._register_builtin_nccl_backend.
NCCL2_DEFAULT_SINCE = (2, 15)
NCCL2_OPT_IN_SINCE = (2, 14)


def default_nccl_flavour(version: str, use_nccl2: Optional[str]) -> str:
    """The flavour a group created as "nccl" gets on torch ``version`` with TORCH_DIST_USE_NCCL2=``use_nccl2``.

    torch reads the variable once, when torch.distributed is imported.
    """
    release = _release(version)
    if release >= NCCL2_DEFAULT_SINCE:
        return "legacy" if use_nccl2 == "0" else "nccl2"
    if release >= NCCL2_OPT_IN_SINCE and use_nccl2 == "1":
        return "nccl2"
    return "legacy"


def graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (never initialises CUDA)."""
    return torch.cuda.is_current_stream_capturing()


profiler_enabled: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: False)


def _find_code_between_statements() -> Callable[[], bool]:
    gettrace, getprofile, callbacks = sys.gettrace, sys.getprofile, gc.callbacks
    monitoring = getattr(sys, "monitoring", None)  # Python 3.12 on: tools called back on events
    if monitoring is None:
        return lambda: gettrace() is not None or getprofile() is not None or bool(callbacks)
    get_tool, tools = monitoring.get_tool, range(6)  # (sys.monitoring's tool ids are 0 to 5)

    def traced() -> bool:
        return (
            gettrace() is not None
            or getprofile() is not None
            or bool(callbacks)
            or any(get_tool(i) is not None for i in tools)
        )

    return traced


# Whether this thread runs a trace or profile function, a garbage collection callback is
# registered, or (Python 3.12+) a sys.monitoring tool: then code of anyone's may run between any
# two of a function's statements, which a proof made from the function's source cannot rule out
# (a debugger, coverage, a profiler).
code_between_statements: Callable[[], bool] = _find_code_between_statements()


def inference_mode_enabled() -> bool:
    """Whether inference mode is active (in-place writes to inference tensors allowed)."""
    return torch.is_inference_mode_enabled()


def async_op_refused(value: Any) -> bool:
    """Whether this torch's ``all_gather`` raises for ``value`` as its ``async_op``: memgather then
    leaves the call to torch, which raises where it raises.

    From torch 2.12 (the first release tox runs that has it; 1.13.1 and 2.0.1 do not) it hands the
    value to its options before it gathers, and their bool field takes what pybind11 converts:
    None, numpy's bool, any object with a truth value of its own (``0``, ``1.0``), not a string or a
    list. Where the options have no such field, torch gathers first and then reads the value's
    truth, which may raise (``torch.tensor([1, 2])``). Every value it takes means its truth value,
    alike on every rank: ``0`` on one rank meets ``False`` on another.
    """
    if value is True or value is False or value is None:
        return False
    options_class = getattr(dist.distributed_c10d, "AllgatherOptions", None)
    options = options_class() if options_class is not None else None
    if not hasattr(options, "asyncOp"):
        try:
            bool(value)
        except Exception:  # noqa: BLE001 - whatever it raises, torch raises it, after its gather
            return True
        return False
    assert options is not None  # an options class without the field was answered above
    try:
        options.asyncOp = value
    except TypeError:
        return True
    return False


def collectives_checked(group: Any = None, device: Optional[torch.device] = None) -> bool:
    """Whether torch checks that every rank's collectives on ``group`` match (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

    Its wrapper then tells the single-tensor call from the list call, which gloo and NCCL let meet:
    a rank that took one while another took the other fails there, where torch alone would not.
    torch wraps a group when it creates it: the group's backend tells (the group itself on 1.13),
    whatever the debug level is now; without a group to ask, the debug level does.
    """
    pg = group if group is not None else (dist.GroupMember.WORLD if dist.is_initialized() else None)
    if pg is not None and device is not None:
        backend = getattr(pg, "_get_backend", None)
        try:
            return type(pg if backend is None else backend(device)).__name__ == "_ProcessGroupWrapper"
        except Exception:  # noqa: BLE001 - no backend for that device: the debug level decides, as below
            pass
    level = getattr(dist, "get_debug_level", None)
    return level is not None and level() == dist.DebugLevel.DETAIL
