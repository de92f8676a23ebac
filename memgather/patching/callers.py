"""Who called all_gather: the code that asked for the gather, past the plumbing.

With wrapt's C extension the wrapper's caller is one frame up; with
``WRAPT_DISABLE_EXTENSIONS=1`` wrapt's own Python frames sit in between, and
``all_gather_object`` calls all_gather from inside torch.distributed. Walking
past all three finds the module, and the function, that really asked for the
gather.

A gather made inside an autograd Function's ``forward`` (torch's
``torch.distributed.nn`` Functions, a GatherLayer of one's own) is made on
behalf of the code that applied the Function, which is also the code that goes
on to concatenate its outputs. So the walk goes on from such a ``forward``
(past ``Function.apply``, Python code in torch.autograd.function up to torch
2.13, and any other torch frame in between) to the applying frame.
"""

from __future__ import annotations

import inspect
import sys
from functools import lru_cache
from types import CodeType, FrameType
from typing import Any, List, Mapping, Optional, Tuple

import torch

from memgather.frames import calling_frame, module_of, passed_through, under

__all__ = [
    "HAS_QUALNAME",
    "calling_frame",
    "calling_frames",
    "module_of",
    "passed_through",
    "resolve",
    "runs",
    "runs_function_forward",
]

# Code objects carry their qualified name (co_qualname) from Python 3.11 on.
HAS_QUALNAME = sys.version_info >= (3, 11)
# Appliers followed past Functions' forwards (a Function applied in another's forward, ...):
# a bound on the walk, far above the two levels real code nests.
_MAX_FUNCTIONS = 8


@lru_cache(maxsize=4096)
def _in_torch(module: str) -> bool:
    return under(module, ("torch",))


def calling_frames(frame: Optional[FrameType]) -> Tuple[List[FrameType], bool]:
    """The frames a gather is made on behalf of, innermost first, and whether the decision may be cached.

    The first frame outside the plumbing; when that runs an autograd Function's
    ``forward``, also the frame that applied the Function, past torch's own frames
    (Function.apply, functorch's custom_function_call, the dispatcher), and so
    on for a Function applied inside another's ``forward``. A ``forward`` in the
    plumbing (torch.distributed.nn's) leads the same way to its applier. Only a
    decision that rests on ``frame`` alone may be cached by ``frame``'s code:
    plumbing code, and a Function's ``forward``, serve every caller.
    """
    found: List[FrameType] = []
    cacheable = True
    past_forward = False  # from here on torch's frames are the way to an applier
    while frame is not None and len(found) < _MAX_FUNCTIONS:
        module = module_of(frame)
        if passed_through(module) or (past_forward and _in_torch(module)):
            past_forward = past_forward or runs_function_forward(frame)
            cacheable = False
        else:
            found.append(frame)
            if not runs_function_forward(frame):
                # A staticmethod forward without ctx may be a Function's applied through C
                # another time: what one call found must not be cached for its code.
                cacheable = cacheable and not _may_be_forward(frame.f_code)
                break
            past_forward, cacheable = True, False
        frame = frame.f_back
    return found, cacheable


def _may_be_forward(code: CodeType) -> bool:
    """A function called ``forward`` whose first parameter is not ``self`` (a Module's is)."""
    return code.co_name == "forward" and not (code.co_argcount and code.co_varnames[0] == "self")


def runs_function_forward(frame: FrameType) -> bool:
    """Whether ``frame`` runs the ``forward`` of a ``torch.autograd.Function``.

    Told by the frame above it being ``Function.apply`` (torch <= 2.13, where
    apply is Python), by the class its qualified name leads to (a module-level
    class), or by its first parameter being called ``ctx``, as every
    ``forward(ctx, ...)`` of a Function (torch's own included) names it. The
    frame's local variables are never read: on Python < 3.13 that would keep them
    alive (``f_locals`` snapshots them onto the frame) until the function returns.
    A ``setup_context``-style forward (no ``ctx``) of a class defined inside a
    function, on a torch whose apply is C (2.14+), is not recognised: its own
    frame is then taken for the caller.
    """
    code = frame.f_code
    if code.co_name != "forward":
        return False
    above = frame.f_back
    if above is not None and module_of(above) == "torch.autograd.function" and above.f_code.co_name == "apply":
        return True
    if code.co_argcount and code.co_varnames[0] == "ctx":
        return True
    return HAS_QUALNAME and _defined_on_function(frame)


def _defined_on_function(frame: FrameType) -> bool:
    """Whether the class ``frame``'s qualified name leads to is a Function whose ``forward`` this is."""
    owner, _, name = frame.f_code.co_qualname.rpartition(".")
    if not owner or "<locals>" in owner:
        return False
    thing: Any = frame.f_globals.get(owner.split(".")[0])
    for part in owner.split(".")[1:]:
        thing = vars(thing).get(part) if isinstance(thing, type) else None
    if not (isinstance(thing, type) and issubclass(thing, torch.autograd.Function)):
        return False
    return _code_of(inspect.getattr_static(thing, name, None)) is frame.f_code


def runs(frame: FrameType, qualname: str) -> bool:
    """Whether ``frame`` runs the function called ``qualname`` in its own module.

    Python 3.11+ records the qualified name on the code object. Older
    Pythons record only its last part (``co_name``), so there the name is
    followed from the module's globals instead (``resolve``), which tells a
    nested ``outer.<locals>.inner`` or a method ``Class.name`` from other
    functions of the same name. What cannot be followed that way (a function
    replaced by a wrapper without ``__wrapped__``, a global rebound or deleted
    after its definition) does not match on those Pythons.
    """
    if HAS_QUALNAME:
        return frame.f_code.co_qualname == qualname
    return any(code is frame.f_code for code in resolve(frame.f_globals, qualname))


def resolve(namespace: Mapping[str, Any], qualname: str) -> Tuple[CodeType, ...]:
    """The code objects that ``qualname`` names, followed from a module's globals.

    The first part is a global; each later one is a class attribute, or, after
    ``<locals>``, a code object among the enclosing code's constants (where a
    nested function's or class's code lives). Decorators are seen through
    ``__wrapped__``, static and class methods through ``__func__``.
    """
    parts = qualname.split(".")
    if parts[-1] == "<locals>":  # names a scope, not a function
        return ()
    found: List[Any] = [namespace[parts[0]]] if parts[0] in namespace else []
    try:
        for part in parts[1:]:
            if part == "<locals>":
                found = [code for code in map(_code_of, found) if code is not None]
            else:
                found = [member for thing in found for member in _members(thing, part)]
        return tuple(code for code in map(_code_of, found) if code is not None)
    except Exception:  # noqa: BLE001 - a caller's odd attribute must never break its gather
        return ()


def _members(thing: Any, name: str) -> List[Any]:
    if isinstance(thing, CodeType):  # a function's or class body's code: its nested code objects
        return [c for c in thing.co_consts if isinstance(c, CodeType) and c.co_name == name]
    if isinstance(thing, type):
        member = vars(thing).get(name)  # where it was defined, as the qualified name says: not inherited
        return [] if member is None else [member]
    return []


def _code_of(thing: Any) -> Optional[CodeType]:
    for _ in range(32):  # a bound on wrapper chains, as inspect.unwrap has
        if isinstance(thing, CodeType):
            return thing
        inner = getattr(thing, "__wrapped__", None) or getattr(thing, "__func__", None)
        if inner is None:
            code = getattr(thing, "__code__", None)
            return code if isinstance(code, CodeType) else None
        thing = inner
    return None
