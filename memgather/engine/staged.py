"""The staged strategy: the single-tensor call into a temporary, copied into the slots where they lie.

On a route every rank must take (ProcessGroupNCCL2's elided calls), a rank whose
own slots cannot be rebound still takes the single call: it gathers into a flat
temporary and copies rank i's part into slot i, as legacy NCCL's list call does.

An asynchronous call returns ``StagedWork``: torch's work for the single call,
with the copy that completes the gather. The copy runs when the gather is first
known to be done on the caller's side, on the caller's thread and current stream:
``wait()`` (after torch's ``wait()``, so the stream is ordered after the
collective and torch's errors and timeouts are raised as they are), an
``is_completed()`` that finds it complete, the future's callback, or at the
latest when the work object is dropped unwaited (``wait()`` then). Nothing waits
on the host that torch's own call would not wait on.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, List, Optional

import torch

from memgather import compat
from memgather.engine import elision, routes, slots, works


def run(route: routes.Route, tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any, async_op: bool) -> Any:
    """Gather into a temporary with ``route``'s single call and copy into the slots; torch's work
    wrapped as ``StagedWork`` for an async call, else None."""
    elision.settle(tensor_list)  # a slot sharing a handed-out result gets its own memory before the write
    first = tensor_list[0]
    flat = torch.empty(slots.flat_shape(first.shape, len(tensor_list)), dtype=first.dtype, device=first.device)
    work = routes.run(route, flat, tensor, group, async_op)
    if work is None:
        copy_out(tensor_list, flat)
        return None
    return StagedWork(work, tensor_list, flat)


def copy_out(tensor_list: List[torch.Tensor], flat: torch.Tensor) -> None:
    """Rank i's part of ``flat`` into slot i, on the current stream, recorded there so that neither
    the temporary nor a slot made on another stream is reused before the copy has run."""
    with torch.no_grad():
        slots.fill_from(tensor_list, flat)
    if flat.is_cuda:
        stream = torch.cuda.current_stream(flat.device)
        with compat.subclass_hooks_off():
            for tensor in (flat, *tensor_list):
                tensor.record_stream(stream)


class StagedWork(works.SlotsWork):
    """torch's work for a staged rank's single call; the slots hold the result once it is waited on."""

    def __init__(self, inner: Any, tensor_list: List[torch.Tensor], flat: torch.Tensor) -> None:
        super().__init__(inner, tensor_list)
        self._copy = _OwedCopy(inner, tensor_list, flat)
        # Dropped unwaited: the copy is still owed to the slots, which torch's call fills regardless.
        weakref.finalize(self, self._copy.make, True)

    def _completed(self) -> None:
        self._copy.make(False)


class _OwedCopy:
    """The copy a StagedWork owes its slots: made once, from whichever thread comes first."""

    def __init__(self, inner: Any, tensor_list: List[torch.Tensor], flat: torch.Tensor) -> None:
        self._inner = inner
        self._slots = tensor_list
        self._flat: Optional[torch.Tensor] = flat
        self._lock = threading.Lock()

    def make(self, wait_first: bool) -> None:
        """``wait_first``: torch's work was not waited on yet (the StagedWork was dropped). Under the
        lock throughout: a second caller returns only once the slots hold the result."""
        with self._lock:
            flat, self._flat = self._flat, None
            if flat is None:
                return
            if wait_first:
                try:
                    self._inner.wait()
                except Exception:  # noqa: BLE001 - the gather failed and nobody waited for it: slots left as they were
                    return
            copy_out(self._slots, flat)
