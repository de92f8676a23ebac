"""Call sites for tests/test_made_like.py: slots made like the input, proven so or not, gathered in a loop.

Each site gathers ``calls`` times, as a loop does (the first call is planned in full, the
next ones take the kept plan), and returns what the caller can see of every call's
slots: values, dtype, shape, strides, ``requires_grad`` and version counters.
``compare`` runs each on every rank of a pool under torch, then with this module a target.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import memgather


def _seen(slots: List[torch.Tensor]) -> List[Any]:
    # (Not whether the slots share a buffer: a rebind's are views of one, by design.)
    return [
        (slot.detach().tolist(), str(slot.dtype), tuple(slot.shape), slot.stride(), slot.requires_grad, slot._version)
        for slot in slots
    ]


def moco(tensor: torch.Tensor, calls: int) -> List[Any]:
    """MoCo's concat_all_gather: the list bound just before the gather (proven)."""
    seen = []
    for _ in range(calls):
        tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(tensors_gather, tensor, async_op=False)
        seen.append(_seen(tensors_gather))
    return seen


def zeros_async(tensor: torch.Tensor, calls: int) -> List[Any]:
    """Keywords and async_op (proven): gloo's single-tensor call, the kept plan's own path."""
    seen = []
    for _ in range(calls):
        out = [torch.zeros_like(tensor), torch.zeros_like(tensor)]
        work = dist.all_gather(tensor_list=out, tensor=tensor, async_op=True)
        work.wait()
        seen.append(_seen(out))
    return seen


def requires_grad(tensor: torch.Tensor, calls: int) -> List[Any]:
    """An input that requires grad (proven): the slots must get no history."""
    leaf = tensor.detach().requires_grad_(True)
    seen = []
    for _ in range(calls):
        out = [torch.empty_like(leaf) for _ in range(2)]
        dist.all_gather(out, leaf, async_op=True).wait()
        seen.append(_seen(out) + [out[0].grad_fn is None])
    return seen


def permuted_input(tensor: torch.Tensor, calls: int) -> List[Any]:
    """A non-contiguous input (proven, but so are its slots): left to torch, as a full plan finds."""
    seen = []
    for _ in range(calls):
        t = tensor.t()
        out = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(out, t, async_op=True).wait()
        seen.append(_seen(out))
    return seen


def in_inference_mode(tensor: torch.Tensor, calls: int) -> List[Any]:
    """Made and gathered in inference mode (proven): inference slots, with no version counter."""
    seen = []
    with torch.inference_mode():
        for _ in range(calls):
            t = tensor.clone()
            out = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(out, t, async_op=True).wait()
            seen.append([(slot.tolist(), slot.is_inference()) for slot in out])
    return seen


def statement_between(tensor: torch.Tensor, calls: int) -> List[Any]:
    """A view of a slot taken between its making and the gather (not proven): the slots are read in
    full, and left to torch (a view is kept)."""
    seen = []
    for _ in range(calls):
        out = [torch.zeros_like(tensor) for _ in range(2)]
        view = out[1][0]
        dist.all_gather(out, tensor, async_op=True).wait()
        seen.append(_seen(out) + [view.tolist()])
    return seen


def scalar(tensor: torch.Tensor, calls: int) -> List[Any]:
    """A 0-d input (proven): the buffer is (world,), each slot a 0-d view of it."""
    seen = []
    for _ in range(calls):
        t = tensor.sum()
        out = [torch.empty_like(t), torch.empty_like(t)]
        dist.all_gather(out, t, async_op=True).wait()
        seen.append(_seen(out))
    return seen


def pooled_channels_last(tensor: torch.Tensor, calls: int) -> List[Any]:
    """A contiguous (N, C, 1, 1) input in channels_last strides (a global pool's): proven, and each
    slot keeps those strides, as empty_like gives them."""
    seen = []
    for _ in range(calls):
        t = tensor.reshape(3, 4, 1, 1).contiguous(memory_format=torch.channels_last)
        out = [torch.ones_like(t) for _ in range(2)]
        dist.all_gather(out, t, async_op=True).wait()
        seen.append(_seen(out))
    return seen


def traced_input_slot(tensor: torch.Tensor, calls: int) -> List[Any]:
    """A trace function (a debugger's, coverage's) that, at the gather of the last call, puts the
    input in as this rank's slot: code the proof cannot see. The site is proven; while a tracer runs
    its slots are read in full, and the input found among them."""
    seen: List[Any] = []
    rank = dist.get_rank()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_code is _traced_site.__code__ and len(seen) == calls - 1:
            out = frame.f_locals.get("out")
            if out is not None:
                out[rank] = frame.f_locals["t"]  # the list object itself: the gather sees the change
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local if frame.f_code is _traced_site.__code__ else None)
    try:
        for _ in range(calls):
            seen.append(_seen(_traced_site(tensor.clone())))
    finally:
        sys.settrace(previous)
    return seen


def _traced_site(t: torch.Tensor) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(out, t, async_op=True).wait()
    return out


class _Comm:
    """A communication object whose ``all_gather`` is a property: looking it up runs code."""

    def __init__(self) -> None:
        self.calls = 0
        self.last = 0
        self.pending: List[Any] = []

    @property
    def all_gather(self) -> Any:
        self.calls += 1
        if self.calls == self.last and self.pending:
            out, t = self.pending
            out[dist.get_rank()] = t  # the input as this rank's slot, after the slots were made
        return dist.all_gather


def property_callee(tensor: torch.Tensor, calls: int) -> List[Any]:
    """A gather whose callee is looked up through a property (not proven: the lookup could run code,
    and does at the last call). The slots are read in full."""
    comm, seen = _Comm(), []
    comm.last = calls
    for _ in range(calls):
        t = tensor.clone()
        out = [torch.empty_like(t) for _ in range(2)]
        comm.pending = [out, t]
        comm.all_gather(out, t, async_op=True).wait()
        seen.append(_seen(out))
    return seen


SITES: Dict[str, Callable[[torch.Tensor, int], List[Any]]] = {
    "traced_input_slot": traced_input_slot,
    "property_callee": property_callee,
    "scalar": scalar,
    "pooled_channels_last": pooled_channels_last,
    "moco": moco,
    "zeros_async": zeros_async,
    "requires_grad": requires_grad,
    "permuted_input": permuted_input,
    "in_inference_mode": in_inference_mode,
    "statement_between": statement_between,
}


def compare(ctx: Any, calls: int) -> Dict[str, Any]:
    """Each site under torch, then with this module a target (every call rewired: no threshold)."""
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * ctx.rank
    from dataclasses import replace

    from memgather.engine import core, strategies

    results: Dict[str, Any] = {}
    for name, site in SITES.items():
        under_torch = site(tensor, calls)
        memgather.patch([__name__])
        before = core.settings()
        core.configure(replace(before, gloo_min_bytes=0))
        checked = [0]
        made_like = strategies.made_like_as_kept

        def counting(*args: Any, **kwargs: Any) -> Any:
            checked[0] += 1
            return made_like(*args, **kwargs)

        strategies.made_like_as_kept = counting  # type: ignore[assignment]  # counts, then checks as ever
        try:
            memgather.reset_stats()
            under_memgather = site(tensor, calls)
            stats = memgather.stats()
        finally:
            strategies.made_like_as_kept = made_like  # type: ignore[assignment]  # put back
            memgather.unpatch()
            core.configure(before)
        results[name] = {"torch": under_torch, "memgather": under_memgather, "made_like": checked[0],
                         "rewired": stats.rewired}
    return results
