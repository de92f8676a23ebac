"""Cat elision's default at a live call site: the proof of ``memgather.patching.proof`` on the frames at hand.

The frames a gather is made from, innermost first:

- the gathering frame (the first outside wrapt and memgather): the function
  that called ``all_gather`` with its list;
- where that frame is an autograd Function's ``forward`` (torch.distributed.nn's
  ``all_gather``, a GatherLayer): the frames up the stack that hand the
  Function's value on (``Function.apply`` in Python, torch's ``all_gather``
  wrapper, a helper of one's own that returns it), then the frame that receives
  it and must concatenate and drop it.

Each frame's function is read from its source (``memgather.patching.sources``),
and the call it is making is found by the position of its current instruction
(Python 3.11+ records each instruction's span; before, the line alone, which
must then hold one call that fits). Names are resolved through the frame's own
globals and builtins, so ``torch.cat`` is proven to be torch's. The verdict is
kept per chain of (code object, instruction offset): it is proven once per call
site, and looked up on every later call from it.
"""

from __future__ import annotations

import ast
import inspect
import logging
import sys
import threading
from dataclasses import replace
from functools import lru_cache
from types import CodeType, FrameType, ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from memgather import cow
from memgather.engine import core
from memgather.frames import module_of, under
from memgather.patching import callers, helpers, proof, sources
from memgather.patching.proof import Verdict
from memgather.patching.wrapper import MemgatherWrapper

_log = logging.getLogger("memgather")

_HAS_POSITIONS = sys.version_info >= (3, 11)
_OWN = ("wrapt", "memgather")
_MAX_HAND_ON = 8  # frames that may hand a Function's value on, the receiver included: a bound on the walk
_MAX_SITES = 4096

Key = Tuple[Tuple[int, int, int], ...]  # (code, instruction, globals) of each frame
# What a verdict rests on besides the code: (namespace, name, object) for each global, builtin or
# module attribute the proof resolved. Checked again before a kept verdict that elides is used.
Bindings = Tuple[Tuple[Any, str, Any], ...]
_lock = threading.Lock()
_verdicts: Dict[Key, Tuple[Tuple[CodeType, ...], Verdict, Bindings]] = {}  # the gathering call sites'
_received: Dict[Key, Tuple[Tuple[CodeType, ...], Verdict, Bindings]] = {}  # returned lists' receivers
_MISSING = object()


def dropped(found: Verdict, tensor_list: Any, tensor: Any = None) -> bool:
    """Whether a gather into ``tensor_list`` of ``tensor`` from a call site with verdict ``found``
    (``verdict``) is armed for a cat: the call site's code, and (checked on every call) slots that
    nothing but the list holds, as fresh slots are. A verdict that rests on a copy-on-write result
    (``needs_cow``) holds only where the buffer will be in CPU memory."""
    if not found.proven:
        return False
    if found.needs_cow and not (isinstance(tensor, torch.Tensor) and cow.serves(tensor)):
        return False
    return _held_by_the_list_alone(tensor_list)


def verdict(frame: Optional[FrameType], gatherer: bool = False, site: Any = None) -> Verdict:
    """The proofs' verdict for the call site ``frame`` is at (proven once, then looked up): whether
    it drops the list after one cat, and (of a gatherer) whether it makes the slots like the input.

    ``site``: where a gatherer's verdict is held for its next call, with the instruction it was
    proven for (a site may serve more than one place: ``kept.Sites``), sparing the lookup by chain;
    the names it rests on are checked once per call, and only where it proves anything.
    """
    if site is not None and gatherer and frame is not None:
        held = site.elision
        # (The globals too: one code object may run under two, each with names of its own.)
        if (
            held is not None
            and held[0] == frame.f_lasti
            and held[3] is frame.f_globals
            and _still_bound(held[1], held[2])
        ):
            return held[1]
        found, bindings = _verdict(frame, gatherer)
        site.elision = (frame.f_lasti, found, bindings, frame.f_globals)
        return found
    return _verdict(frame, gatherer)[0]


def received(frame: Optional[FrameType], below: FrameType) -> Verdict:
    """Whether the list of gathered tensors that ``below``'s function returns to ``frame`` goes straight
    to one cat that drops it (``proof.receiver``), in ``frame`` or, where ``frame`` returns the value as
    it is (``proof.passes_on``), in a frame further up (at most ``_MAX_HAND_ON``). Proven once per
    chain of places, then looked up while the names it rests on still hold."""
    chain = [below]
    while frame is not None and len(chain) <= _MAX_HAND_ON:
        if not _own(module_of(frame)):  # a taken-over helper's way through memgather: not the caller's code
            chain.append(frame)
        frame = frame.f_back
    return _proven(_received, _key(chain), chain, _receiver_up, "of the list returned to")[0]


def _receiver_up(chain: List[FrameType], bindings: List[Tuple[Any, str, Any]]) -> Tuple[Verdict, FrameType]:
    for below, frame in zip(chain, chain[1:]):
        if helpers.runs(frame.f_code) is below.f_code:
            continue  # a taken-over helper's trampoline, over its own code: it returns that code's value
        link = _calls_into(frame, below, False, bindings)  # no wrapper or cache between (it could keep the list)
        if link:
            return proof.refuse(link), frame
        found = _at(frame, proof.receiver, _any_call, bindings)
        if found.proven:
            return found, frame
        handed = _at(frame, lambda function, call, resolve: proof.passes_on(function, call), _any_call, bindings)
        if not handed.proven:
            return proof.refuse(found.reason), frame
    return proof.refuse("the list is handed on further than memgather follows"), chain[-1]


def _still_bound(found: Verdict, bindings: Bindings) -> bool:
    """Whether a kept verdict still holds: a refusal always; a proof (either of them) while every
    name it resolved still names the same object."""
    if not (found.proven or found.like_input):
        return True
    for space, name, thing in bindings:  # (a loop, not all() of a generator: read on every call)
        if space.get(name, _MISSING) is not thing:
            return False
    return True


def _verdict(frame: Optional[FrameType], gatherer: bool) -> Tuple[Verdict, Bindings]:
    """``verdict``, with the bindings it rests on, looked up by the chain of frames."""
    chain = [frame] if gatherer and frame is not None else _chain(frame)
    if not chain:
        return proof.refuse("no calling frame"), ()
    # A gatherer's own frame alone, as at most call sites: its key without a generator, per call.
    key: Key = ((id(chain[0].f_code), chain[0].f_lasti, id(chain[0].f_globals)),) if len(chain) == 1 else _key(chain)
    return _proven(_verdicts, key, chain, _prove_chain, "at")


# A proof over a chain of frames: its verdict and the frame it was reached at, the names it resolved
# appended to the list it is given.
ChainProver = Callable[[List[FrameType], List[Tuple[Any, str, Any]]], Tuple[Verdict, FrameType]]


def _proven(
    table: Dict[Key, Tuple[Tuple[CodeType, ...], Verdict, Bindings]],
    key: Key,
    chain: List[FrameType],
    prove: ChainProver,
    what: str,
) -> Tuple[Verdict, Bindings]:
    """``prove``'s verdict on ``chain``, with the bindings it rests on: proven once per ``key`` (kept in
    ``table``), then looked up while the chain's code is the same and every name it resolved holds."""
    known = table.get(key)
    if known is not None and _same_codes(known[0], chain) and _still_bound(known[1], known[2]):
        return known[1], known[2]
    found, where, bindings = _prove(chain, prove)
    with _lock:
        if len(table) >= _MAX_SITES:
            table.clear()
        table[key] = (tuple(f.f_code for f in chain), found, bindings)
    _log.info(
        "memgather: cat elision %s %s: %s (%s)", what, _where(where), "on" if found.proven else "off", found.reason
    )
    return found, bindings


def _key(chain: List[FrameType]) -> Key:
    return tuple((id(f.f_code), f.f_lasti, id(f.f_globals)) for f in chain)


def _same_codes(codes: Tuple[CodeType, ...], chain: List[FrameType]) -> bool:
    """The kept verdict's code objects are the chain's (an id may have been reused by another)."""
    if len(chain) == 1:
        return codes[0] is chain[0].f_code
    return all(a is b.f_code for a, b in zip(codes, chain))


def forget() -> None:
    """Forget every verdict (``patch()`` and ``unpatch()`` do: the settings they run under change)."""
    with _lock:
        _verdicts.clear()
        _received.clear()


def _held_by_the_list_alone(tensor_list: Any) -> bool:
    """Each slot is referenced by the list only (3: the list, the loop's name, getrefcount's argument):
    a slot kept anywhere else (a pool, a cache, a name) is not a fresh one, whatever the code said."""
    return type(tensor_list) is list and all(sys.getrefcount(slot) == 3 for slot in tensor_list)


def gathering_frame(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The frame whose code makes the gather: the first past wrapt's and memgather's own."""
    while frame is not None and _own(module_of(frame)):
        frame = frame.f_back
    return frame


def _chain(frame: Optional[FrameType]) -> List[FrameType]:
    """The gathering frame, then (where it is a Function's forward) the frames up to the receiver."""
    frame = gathering_frame(frame)
    if frame is None:
        return []
    chain = [frame]
    if not callers.runs_function_forward(frame):
        return chain
    # Up to the receiver: torch's frames (Function.apply in Python, its all_gather wrapper) and
    # helpers of one's own that hand the value on; which frame receives it, the proof tells.
    frame = frame.f_back
    while frame is not None and len(chain) <= _MAX_HAND_ON:
        chain.append(frame)
        frame = frame.f_back
    return chain


@lru_cache(maxsize=4096)
def _own(module: str) -> bool:
    """wrapt's and memgather's frames stand between the wrapper and the gathering code (cached: asked per call)."""
    return under(module, _OWN)


def _prove(chain: List[FrameType], prove: ChainProver) -> Tuple[Verdict, FrameType, Bindings]:
    bindings: List[Tuple[Any, str, Any]] = []
    try:
        found, where = prove(chain, bindings)
    except Exception as error:  # noqa: BLE001 - reading a caller's code must never break its gather
        _log.debug("memgather: the elision proof failed", exc_info=True)
        found, where = proof.refuse(f"the proof failed: {type(error).__name__}: {error}"), chain[0]
    # Each name once, however often the proofs resolved it: the bindings are checked per call.
    return found, where, tuple({(id(space), name): (space, name, thing) for space, name, thing in bindings}.values())


def _prove_chain(chain: List[FrameType], bindings: List[Tuple[Any, str, Any]]) -> Tuple[Verdict, FrameType]:
    gathering = chain[0]
    if len(chain) == 1:
        if under(module_of(gathering), ("torch",)):
            return proof.refuse(f"gathered by torch's own {module_of(gathering)}"), gathering
        found = _at(gathering, proof.gatherer, _is_list_gather, bindings)
        made = _call_of(gathering, _is_list_gather, bindings)
        unlike = made if isinstance(made, str) else proof.slots_like_input(*made)
        if unlike:
            _log.debug("memgather: the slots at %s are read per call: %s", _where(gathering), unlike)
        return replace(found, like_input=not unlike), gathering
    held = _at(gathering, proof.forward, _is_list_gather, bindings)
    if not held.proven:
        return proof.refuse(f"the Function's forward: {held.reason}"), gathering
    for below, frame in zip(chain, chain[1:]):
        if callers.runs_function_forward(frame):
            return proof.refuse("a Function applied inside another Function's forward"), frame
        if not under(module_of(frame), ("torch",)):
            # The call this frame makes must reach the frame below as it is: a wrapper in C (a cache)
            # would keep the value without a frame of its own.
            link = _calls_into(frame, below, below is gathering, bindings)
            if link:
                return proof.refuse(link), frame
        received = _at(frame, proof.receiver, _any_call, bindings)
        if received.proven:
            return received, frame
        handed = _at(frame, lambda function, call, resolve: proof.passes_on(function, call), _any_call, bindings)
        if not handed.proven:
            return proof.refuse(received.reason), frame
    return proof.refuse("the Function's value is handed on further than memgather follows"), chain[-1]


Prover = Callable[[ast.AST, ast.Call, proof.Resolve], Verdict]


def _call_of(
    frame: FrameType, fits: Callable[[ast.Call, "_Resolver"], bool], bindings: List[Tuple[Any, str, Any]]
) -> Union[Tuple[ast.AST, ast.Call, "_Resolver"], str]:
    """The function ``frame`` runs, the call it is making, and a resolver of its names; else why not."""
    found = sources.function_of(frame.f_code, frame.f_globals)
    if isinstance(found, str):
        return found
    resolve = _Resolver(frame, bindings, found.function)
    position = _position(frame)
    calls = proof.calls_at(found.function, frame.f_lineno, position)
    if position is None:  # the line alone: it must hold one call that fits
        fitting = [call for call in calls if fits(call, resolve)]
        if not fitting and fits is _is_list_gather:
            fitting = [call for call in calls if isinstance(proof.gather_list(call), ast.Name)]
        calls = fitting
    if len(calls) != 1:
        return f"line {frame.f_lineno}: {'no call' if not calls else 'several calls'} found where the frame is"
    return found.function, calls[0], resolve


def _at(
    frame: FrameType,
    prover: Prover,
    fits: Callable[[ast.Call, "_Resolver"], bool],
    bindings: List[Tuple[Any, str, Any]],
) -> Verdict:
    """``prover``'s verdict on the call ``frame`` is making."""
    found = _call_of(frame, fits, bindings)
    if isinstance(found, str):
        return proof.refuse(found)
    function, call, resolve = found
    return prover(function, call, resolve)


def _calls_into(
    frame: FrameType, below: FrameType, below_is_forward: bool, bindings: List[Tuple[Any, str, Any]]
) -> str:
    """Why the call ``frame`` makes cannot be shown to run ``below``'s code directly ("" when it can)."""
    found = _call_of(frame, _any_call, bindings)
    if isinstance(found, str):
        return found
    _, call, resolve = found
    callee = resolve.object_of(call.func)
    target = getattr(callee, "__func__", callee)
    if callee is not None and getattr(target, "__code__", None) is below.f_code:
        return ""
    applies = below_is_forward or module_of(below) == "torch.autograd.function"
    if applies and callee is not None and callee is _function_apply():
        return ""
    return f"line {call.lineno}: the call is made through something memgather cannot follow (a wrapper, a cache)"


def _function_apply() -> Any:
    """``Function.apply`` as a class attribute lookup finds it (``X.apply`` for any Function X)."""
    return inspect.getattr_static(torch.autograd.Function, "apply")


def _position(frame: FrameType) -> Optional[Tuple[int, int, int, int]]:
    if not _HAS_POSITIONS:
        return None
    for index, span in enumerate(frame.f_code.co_positions()):
        if index == frame.f_lasti // 2:
            if None in span:
                return None
            return span  # type: ignore[return-value]  # checked: no None in it
    return None


def _is_list_gather(call: ast.Call, resolve: "_Resolver") -> bool:
    return proof.last_name(call.func) == "all_gather"


def _any_call(call: ast.Call, resolve: "_Resolver") -> bool:
    return True


def _where(frame: FrameType) -> str:
    return f"{module_of(frame)}:{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)} line {frame.f_lineno}"


# Name resolution through a live frame.

_known: Dict[int, Tuple[Any, str]] = {}


def _known_objects() -> Dict[int, Tuple[Any, str]]:
    """The functions the proof names, by identity: torch's own C functions (not whatever ``torch.cat``
    is bound to now: a wrapper put there is not torch's cat), and the frame readers."""
    if not _known:
        functions = torch._C._VariableFunctions
        for dotted in sorted(proof.CATS | proof.FACTORIES):
            thing = getattr(functions, dotted.split(".", 1)[1], None)
            if thing is not None:
                _known[id(thing)] = (thing, dotted)
        for thing in (tuple, list, range):
            _known[id(thing)] = (thing, thing.__name__)
        # torch's all_gather as it was before anything patched it (memgather's wrapper is read through).
        gather = core.original_all_gather()
        _known[id(gather)] = (gather, "torch.distributed.all_gather")
        for dotted in proof.FRAME_READERS:
            module, _, name = dotted.rpartition(".")
            thing = getattr(sys.modules.get(module), name, None)
            if thing is not None:
                _known[id(thing)] = (thing, dotted)
    return _known


class _Resolver:
    """Names of the function a frame runs, resolved through its globals and builtins; every lookup
    it made is recorded in ``bindings``, for the verdict to be checked against later."""

    def __init__(self, frame: FrameType, bindings: List[Tuple[Any, str, Any]], function: ast.AST) -> None:
        code = frame.f_code
        self.local = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
        self.imported = proof.imported_only(function, _absolute_only)
        self.namespace = frame.f_globals
        self.builtins = frame.f_builtins
        self.plain_dicts = type(self.namespace) is dict and type(self.builtins) is dict
        self.through_class = False
        self.bindings = bindings
        self.known = _known_objects()

    def __call__(self, expression: ast.expr) -> Optional[str]:
        thing = self.object_of(expression)
        if thing is not None and type(thing) is MemgatherWrapper:
            # What memgather's own wrapper stands for: the call is this one. Only where it was found
            # through modules and plain dicts (a class's metaclass, or a dict subclass as globals,
            # could run code on the lookup).
            if not self.plain_dicts or self.through_class:
                return None
            thing = thing.__wrapped__
        entry = self.known.get(id(thing)) if thing is not None else None
        return entry[1] if entry is not None and entry[0] is thing else None

    def object_of(self, expression: ast.expr) -> Any:
        """What ``expression`` (a name and attributes of modules or classes) is bound to now, or None."""
        parts: List[str] = []
        self.through_class = False  # (read by __call__: the lookup followed a class's attribute)
        while isinstance(expression, ast.Attribute):
            parts.append(expression.attr)
            expression = expression.value
        if not isinstance(expression, ast.Name):
            return None
        if expression.id in self.imported:
            # A local bound only by an import in the function (``from torch.distributed.nn.functional
            # import all_gather``): what that import bound, read from the imported module.
            module, attribute = self.imported[expression.id]
            if attribute and not _plain_module_attribute(sys.modules.get(module), attribute):
                return None  # the import's own lookup could run code (a module class's property)
            space = vars(sys.modules[module]) if module in sys.modules else {}
            thing = space.get(attribute, _MISSING) if attribute else sys.modules.get(module, _MISSING)
            if attribute:
                self.bindings.append((space, attribute, thing))
            else:  # ``import torch`` in the function: the module the import finds, while it is that one
                self.bindings.append((sys.modules, module, thing))
        elif expression.id in self.local:
            return None  # a local may be anything at the moment it is called
        else:
            space = self.namespace if expression.id in self.namespace else self.builtins
            thing = space.get(expression.id, _MISSING)
            self.bindings.append((space, expression.id, thing))
            if space is not self.namespace:  # found in builtins: only while no global of the name hides it
                self.bindings.append((self.namespace, expression.id, _MISSING))
        for part in reversed(parts):
            if _plain_module_attribute(thing, part):
                space = vars(thing)
                thing = space.get(part, _MISSING)
                self.bindings.append((space, part, thing))
            elif isinstance(thing, type):
                thing = inspect.getattr_static(thing, part, _MISSING)  # no descriptor runs
                self.through_class = True
            else:
                return None  # an attribute of anything else may be computed: not followed
        return None if thing is _MISSING else thing


def _plain_module_attribute(thing: Any, part: str) -> bool:
    """Whether ``thing.part`` is what the module's dict holds, looked up with no code of anyone's: a
    module whose class (a subclass of ModuleType, as lazy modules are) neither overrides attribute
    lookup nor defines ``part`` itself (a property would run code)."""
    if type(thing) is ModuleType:
        return True
    kind = type(thing)
    return (
        isinstance(thing, ModuleType)
        and kind.__getattribute__ is ModuleType.__getattribute__
        and inspect.getattr_static(kind, part, _MISSING) is _MISSING
    )


def _absolute_only(node: ast.ImportFrom) -> Optional[str]:
    """The module a live frame's ``from`` import reads: absolute imports only (a relative one is not followed)."""
    return None if node.level else node.module
