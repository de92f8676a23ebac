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
import logging
import sys
import threading
from functools import lru_cache
from types import CodeType, FrameType, ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from memgather.frames import module_of, under
from memgather.patching import callers, proof, sources
from memgather.patching.proof import Verdict

_log = logging.getLogger("memgather")

_HAS_POSITIONS = sys.version_info >= (3, 11)
_OWN = ("wrapt", "memgather")
_MAX_HAND_ON = 8  # frames that may hand a Function's value on, the receiver included: a bound on the walk
_MAX_SITES = 4096

Key = Tuple[Tuple[int, int], ...]
_lock = threading.Lock()
_verdicts: Dict[Key, Tuple[Tuple[CodeType, ...], Verdict]] = {}


def elides(frame: Optional[FrameType]) -> bool:
    """Whether a gather made from ``frame`` (the all_gather wrapper's caller) is proven to drop its list."""
    return verdict(frame).proven


def verdict(frame: Optional[FrameType]) -> Verdict:
    """The proof's verdict for the call site ``frame`` is at (proven once, then looked up)."""
    chain = _chain(frame)
    if not chain:
        return proof.refuse("no calling frame")
    key: Key = tuple((id(f.f_code), f.f_lasti) for f in chain)
    known = _verdicts.get(key)
    if known is not None and all(a is b.f_code for a, b in zip(known[0], chain)):
        return known[1]
    found = _prove(chain)
    with _lock:
        if len(_verdicts) >= _MAX_SITES:
            _verdicts.clear()
        _verdicts[key] = (tuple(f.f_code for f in chain), found)
    _log.info("memgather: cat elision at %s: %s (%s)", _where(chain[-1]), "on" if found.proven else "off", found.reason)
    return found


def forget() -> None:
    """Forget every verdict (``patch()`` and ``unpatch()`` do: the settings they run under change)."""
    with _lock:
        _verdicts.clear()


def _chain(frame: Optional[FrameType]) -> List[FrameType]:
    """The gathering frame, then (where it is a Function's forward) the frames up to the receiver."""
    while frame is not None and _own(module_of(frame)):
        frame = frame.f_back
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


def _prove(chain: List[FrameType]) -> Verdict:
    try:
        return _prove_chain(chain)
    except Exception as error:  # noqa: BLE001 - reading a caller's code must never break its gather
        _log.debug("memgather: the elision proof failed", exc_info=True)
        return proof.refuse(f"the proof failed: {type(error).__name__}: {error}")


def _prove_chain(chain: List[FrameType]) -> Verdict:
    gathering = chain[0]
    if len(chain) == 1:
        if under(module_of(gathering), ("torch",)):
            return proof.refuse(f"gathered by torch's own {module_of(gathering)}")
        return _at(gathering, proof.gatherer, _is_list_gather)
    held = _at(gathering, proof.forward, _is_list_gather)
    if not held.proven:
        return proof.refuse(f"the Function's forward: {held.reason}")
    for frame in chain[1:]:
        if callers.runs_function_forward(frame):
            return proof.refuse(f"{_where(frame)}: a Function applied inside another Function's forward")
        received = _at(frame, proof.receiver, _any_call)
        if received.proven:
            return received
        handed = _at(frame, lambda function, call, resolve: proof.passes_on(function, call), _any_call)
        if not handed.proven:
            return proof.refuse(f"{_where(frame)}: {received.reason}")
    return proof.refuse("the Function's value is handed on further than memgather follows")


Prover = Callable[[ast.AST, ast.Call, proof.Resolve], Verdict]


def _at(frame: FrameType, prover: Prover, fits: Callable[[ast.Call, proof.Resolve], bool]) -> Verdict:
    """``prover``'s verdict on the call ``frame`` is making."""
    found = sources.function_of(frame.f_code, frame.f_globals)
    if isinstance(found, str):
        return proof.refuse(found)
    resolve = _resolver(frame)
    position = _position(frame)
    calls = proof.calls_at(found.function, frame.f_lineno, position)
    if position is None:
        calls = [call for call in calls if fits(call, resolve)]
        if len(calls) > 1:
            outer = [c for c in calls if not any(c is not o and _holds(o, c) for o in calls)]
            calls = outer if len(outer) == 1 and fits is _any_call else calls
    if len(calls) != 1:
        where = f"line {frame.f_lineno}"
        return proof.refuse(f"{where}: {'no call' if not calls else 'several calls'} found where the frame is")
    return prover(found.function, calls[0], resolve)


def _position(frame: FrameType) -> Optional[Tuple[int, int, int, int]]:
    if not _HAS_POSITIONS:
        return None
    for index, span in enumerate(frame.f_code.co_positions()):
        if index == frame.f_lasti // 2:
            if None in span:
                return None
            return span  # type: ignore[return-value]  # checked: no None in it
    return None


def _holds(outer: ast.Call, inner: ast.Call) -> bool:
    return any(node is inner for node in ast.walk(outer))


def _is_list_gather(call: ast.Call, resolve: proof.Resolve) -> bool:
    return resolve(call.func) in proof.GATHERS or _named(call.func) == "all_gather"


def _any_call(call: ast.Call, resolve: proof.Resolve) -> bool:
    return True


def _named(expression: ast.expr) -> str:
    if isinstance(expression, ast.Attribute):
        return expression.attr
    return expression.id if isinstance(expression, ast.Name) else ""


def _where(frame: FrameType) -> str:
    return f"{module_of(frame)}:{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)} line {frame.f_lineno}"


# Name resolution through a live frame.

_known: Dict[int, Tuple[Any, str]] = {}


def _known_objects() -> Dict[int, Tuple[Any, str]]:
    """torch's functions the proof names, by identity (looked up once: torch is imported)."""
    if not _known:
        for dotted in sorted(proof.CATS | proof.FACTORIES):
            thing = getattr(torch, dotted.split(".", 1)[1], None)
            if thing is not None:
                _known[id(thing)] = (thing, dotted)
        for thing in (tuple, list):
            _known[id(thing)] = (thing, thing.__name__)
    return _known


def _resolver(frame: FrameType) -> proof.Resolve:
    local = set(frame.f_code.co_varnames) | set(frame.f_code.co_cellvars) | set(frame.f_code.co_freevars)
    namespace = frame.f_globals
    own_builtins = frame.f_builtins
    known = _known_objects()

    def resolve(expression: ast.expr) -> Optional[str]:
        parts: List[str] = []
        while isinstance(expression, ast.Attribute):
            parts.append(expression.attr)
            expression = expression.value
        if not isinstance(expression, ast.Name) or expression.id in local:
            return None  # a local may be anything at the moment it is called
        missing = object()
        thing = namespace.get(expression.id, missing)
        if thing is missing:
            thing = own_builtins.get(expression.id, missing)
        for part in reversed(parts):
            if not isinstance(thing, ModuleType):
                return None  # an attribute of anything but a module may be computed: not followed
            thing = vars(thing).get(part, missing)
        entry = known.get(id(thing))
        return entry[1] if entry is not None and entry[0] is thing else None

    return resolve
