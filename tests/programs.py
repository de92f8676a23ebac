"""Programs for the stateful differential test, run on every rank of a pool.

A program is a list of operations after a gather: take aliases, concatenate,
write, run autograd, gather again (from a target, a non-target, inside
``disabled()``, through an autograd Function), run other collectives into the
slots. ``compare`` runs one program twice on each rank, once under torch
alone and once with memgather patched for this module with elision forced on,
and returns both transcripts: everything the program could observe.

This module is the *target* of those runs; ``tests.sites.other_caller`` is the
non-target.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import memgather
from tests.ranks import handed_out, without_cow
from tests.sites import other_caller

SHAPES: Dict[str, Tuple[int, ...]] = {"vector": (5,), "matrix": (3, 4), "scalar": ()}
DTYPES = ("float32", "float64", "int64", "complex64", "bfloat16")


class GatherLayer(torch.autograd.Function):
    """The all-gathering autograd Function of self-supervised losses (SimCLR-style)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        return grads[dist.get_rank()] * 1


class Tagged(torch.Tensor):
    """Another library's tensor subclass: its ``__torch_function__`` must run as under torch."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


ALIASES: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "data": lambda t: t.data,
    "T": lambda t: t.T,
    "mT": lambda t: t.mT,
    "H": lambda t: t.H,
    "mH": lambda t: t.mH,
    "real": lambda t: t.real,
    "imag": lambda t: t.imag,
    "view": lambda t: t.view(-1),
    "reshape": lambda t: t.reshape(-1),
    "index": lambda t: t[0],
    "unsqueeze": lambda t: t.unsqueeze(0),
    "detach": lambda t: t.detach(),
    "unbind": lambda t: t.unbind(0)[0],
    "as_strided": lambda t: t.as_strided((1,), (1,)),
    "contiguous": lambda t: t.contiguous(),
    "to_same": lambda t: t.to(t.dtype),
    "numpy": lambda t: torch.from_numpy(t.numpy()),
    "to_dlpack": lambda t: torch.from_dlpack(torch.utils.dlpack.to_dlpack(t)),
    "from_dlpack": lambda t: torch.from_dlpack(t),
    "via_storage": lambda t: torch.tensor([], dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride()),
    "view_as_real": lambda t: torch.view_as_real(t),
    "narrow": lambda t: t.narrow(0, 0, 1),
    "select": lambda t: t.select(0, 0),
    "slice": lambda t: t[1:],
    "diagonal": lambda t: t.diagonal(),
    "expand": lambda t: t.expand(2, *t.shape),
    "split": lambda t: t.split(1)[0],
    "chunk": lambda t: t.chunk(2)[-1],
    "transpose": lambda t: t.transpose(0, -1),
    "permute": lambda t: t.permute(*reversed(range(t.dim()))),
    "squeeze": lambda t: t.squeeze(),
    "view_as": lambda t: t.view_as(t),
    "movedim": lambda t: t.movedim(0, -1),
    "unflatten": lambda t: t.unflatten(0, (1, -1)),
    "t": lambda t: t.t(),
    "conj": lambda t: t.conj(),
}

CATS: Dict[str, Callable[[List[torch.Tensor]], torch.Tensor]] = {
    "cat": lambda s: torch.cat(s),
    "cat_kw": lambda s: torch.cat(tensors=s, dim=0),
    "cat_negative": lambda s: torch.cat(s, -s[0].dim()),
    "concat": lambda s: torch.concat(s),
    "concatenate": lambda s: torch.concatenate(s, 0),
    "cat_tuple": lambda s: torch.cat(tuple(s)),
    "stack": lambda s: torch.stack(s),
    "stack_negative": lambda s: torch.stack(s, -s[0].dim() - 1),
    "stack_dim1": lambda s: torch.stack(s, 1),
    "cat_dim1": lambda s: torch.cat(s, 1),
    "cat_reversed": lambda s: torch.cat(s[::-1]),
    "cat_partial": lambda s: torch.cat(s[:1]),
    "cat_out": lambda s: torch.cat(s, out=torch.empty(0, dtype=s[0].dtype)),
}

WRITES: Dict[str, Callable[[torch.Tensor], Any]] = {
    "add": lambda t: t.add_(1),
    "mul": lambda t: t.mul_(2),
    "zero": lambda t: t.zero_(),
    "fill": lambda t: t.fill_(7),
    "copy": lambda t: t.copy_(torch.full_like(t, 5)),
    "setitem": lambda t: t.__setitem__(..., 3),
    "numpy": lambda t: t.numpy().__setitem__(..., 9),
    "to_dlpack": lambda t: torch.from_dlpack(torch.utils.dlpack.to_dlpack(t)).add_(1),
    "requires_grad": lambda t: t.requires_grad_(),
}


class _Run:
    """One program's state on this rank, and the transcript of what it observed."""

    def __init__(self, dtype: str, shape: str) -> None:
        self.dtype = getattr(torch, dtype)
        self.shape = SHAPES[shape]
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.slots: List[torch.Tensor] = [torch.zeros(self.shape, dtype=self.dtype) for _ in range(self.world)]
        self.held: Dict[str, torch.Tensor] = {}
        self.weight = torch.ones((), requires_grad=True)
        self.inputs: List[torch.Tensor] = []
        self.log: List[Any] = []
        self.sharing: List[Any] = []
        self.elided = 0  # cats whose result is the slots' own memory (not compared: torch never elides)

    def tensor(self, name: str) -> torch.Tensor:
        if name.startswith("s"):
            return self.slots[int(name[1:]) % self.world]
        if name == "x":
            return self.inputs[-1]
        return self.held[name]

    def names(self) -> List[str]:
        return [f"s{i}" for i in range(self.world)] + sorted(self.held)

    def keep(self, prefix: str, value: torch.Tensor) -> None:
        name = f"{prefix}{sum(1 for n in self.held if n[0] == prefix)}"
        self.held[name] = value
        self.log.append(("made", name, describe(value)))

    def input(self, seed: int, grad: bool) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 31 + self.rank)
        if self.dtype.is_floating_point or self.dtype.is_complex:
            x = (torch.randn(self.shape, generator=gen, dtype=torch.float64) * 100).to(self.dtype)
        else:
            x = torch.randint(-1000, 1000, self.shape, generator=gen).to(self.dtype)
        if grad and self.dtype.is_floating_point:
            x.requires_grad_()
        self.inputs.append(x)
        return x


def _gather(run: _Run, how: str, seed: int, grad: bool) -> None:
    x = run.input(seed, grad)
    if how == "target":
        dist.all_gather(run.slots, x)
    elif how == "target_async":
        dist.all_gather(run.slots, x, async_op=True).wait()
    elif how == "non_target":
        other_caller.gather_into(run.slots, x)
    elif how == "disabled":
        with memgather.disabled():
            dist.all_gather(run.slots, x)
    elif how == "inference":  # evaluation code gathers under inference mode
        with torch.inference_mode():
            dist.all_gather(run.slots, x)
    elif how == "function":  # new slot objects, outputs of an autograd Function
        run.slots = list(GatherLayer.apply(x)) if x.requires_grad else run.slots
        if not x.requires_grad:
            dist.all_gather(run.slots, x)
    run.log.append(("gathered", [describe(s) for s in run.slots]))


def _collective(run: _Run, how: str, index: int) -> None:
    slot = run.slots[index % run.world]
    if how == "broadcast":
        dist.broadcast(slot, src=(index + 1) % run.world)
    else:
        dist.all_reduce(slot)


def _step(run: _Run, op: Sequence[Any]) -> None:
    kind = op[0]
    if kind == "gather":
        _gather(run, op[1], op[2], op[3])
    elif kind == "alias":
        run.keep("a", ALIASES[op[2]](run.tensor(op[1])))
    elif kind == "cat":
        result = CATS[op[1]](run.slots)
        run.elided += handed_out(result, run.slots[0])
        run.keep("r", result)
    elif kind == "write":
        WRITES[op[2]](run.tensor(op[1]))
        run.sharing.append((op[1], _overlapping(run, op[1])))
    elif kind == "read":
        run.log.append(("read", op[1], describe(run.tensor(op[1]), values=True)))
    elif kind == "grad_use":
        run.keep("y", (run.tensor(op[1]) * run.weight).abs().sum())
    elif kind == "backward":
        run.tensor(op[1]).backward()
        run.log.append(("grads", describe(run.weight.grad, values=True)))
    elif kind == "collective":
        _collective(run, op[1], op[2])
    elif kind == "tagged":
        run.keep("t", torch.add(run.tensor(op[1]), torch.zeros((), dtype=run.dtype).as_subclass(Tagged)))
    elif kind == "drop":
        run.held.pop(op[1], None)


def execute(program: Dict[str, Any]) -> Dict[str, Any]:
    """Run ``program`` here; the transcript of what it observed, and which writes reached which tensors."""
    run = _Run(program["dtype"], program["shape"])
    for op in program["ops"]:
        try:
            _step(run, op)
        except Exception as error:  # noqa: BLE001 - an error is an observation like any other
            run.log.append(("raised", tuple(op), type(error).__name__, _message(error)))
    final = {name: describe(run.tensor(name), values=True) for name in run.names()}
    final["input_grads"] = [describe(x.grad, values=True) for x in run.inputs]
    final["weight_grad"] = describe(run.weight.grad, values=True)
    return {"log": run.log, "final": final, "sharing": run.sharing, "elided": run.elided}


def compare(ctx: Any, program: Dict[str, Any]) -> Dict[str, Any]:
    """The program under torch alone, then with memgather rewiring this module, elision forced on
    (``program["cow"]`` False: as where the cat's result cannot be a copy-on-write snapshot)."""
    memgather.unpatch()
    torch_run = execute(program)
    memgather.patch([__name__], elide=True)
    try:
        memgather.reset_stats()
        with contextlib.nullcontext() if program.get("cow", True) else without_cow():
            memgather_run = execute(program)
        stats = memgather.stats()
    finally:
        memgather.unpatch()
    return {"torch": torch_run, "memgather": memgather_run, "rewired": stats.rewired,
            "strategies": dict(stats.by_strategy)}


def describe(t: Any, values: bool = False) -> Any:
    """What a program can observe of a tensor: type, dtype, shape, strides, autograd state, version, bytes."""
    if not isinstance(t, torch.Tensor):
        return repr(t)
    plain = type(t) is torch.Tensor or type(t).__module__.startswith("memgather")
    seen = (plain, type(t).__name__ if not plain else "Tensor", str(t.dtype), tuple(t.shape), t.stride(),
            t.requires_grad, _grad_fn(t), t.is_leaf, t._version)
    if values:
        copy = t.detach().reshape(-1).clone(memory_format=torch.contiguous_format)
        raw = copy.view(torch.uint8) if copy.numel() else copy
        seen += (hashlib.sha256(raw.numpy().tobytes() if copy.numel() else b"").hexdigest()[:16],)
    return seen


def _grad_fn(t: torch.Tensor) -> Any:
    """The name of ``t``'s ``grad_fn``, or the error reading it raises: reading it regenerates a view's
    history after an in-place write into its base, which torch refuses for some views (an output of a
    multi-output op such as ``split``, a view made under no_grad) under torch and memgather alike."""
    try:
        grad_fn = t.grad_fn
    except RuntimeError as error:
        return f"raises: {_message(error)}"
    return type(grad_fn).__name__ if grad_fn is not None else None


def _overlapping(run: _Run, name: str) -> List[str]:
    """Names of the tensors whose memory the just-written tensor shares (after the write)."""
    start, end = _span(run.tensor(name))
    return [other for other in run.names() if other != name and _overlaps(_span(run.tensor(other)), (start, end))]


def _span(t: torch.Tensor) -> Tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride > 0)
    with torch._C.DisableTorchFunctionSubclass():  # the test looking: no watched slot's hook runs
        start = t.data_ptr()  # (a copy-on-write tensor whose other side lives gets its own copy here)
    return start, start + (last + 1) * t.element_size()


def _overlaps(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a != (0, 0) and b != (0, 0)


def _message(error: BaseException) -> str:
    """The error's message without the C++ backtrace some torch errors carry (unflatten's
    re-raise quotes c10::Error's in full): its frames count the interpreter's C stack, which
    any Python layer in between (another subclass's __torch_function__, memgather's) deepens."""
    return str(error).split("\nException raised from ", 1)[0]

