"""Who called all_gather: the first frame outside wrapt, memgather and torch.distributed.

With wrapt's C extension the wrapper's caller is one frame up; with
``WRAPT_DISABLE_EXTENSIONS=1`` wrapt's own Python frames sit in between, and
``all_gather_object`` calls all_gather from inside torch.distributed. Walking
past all three finds the module, and the function, that really asked for the
gather.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Any, List, Mapping, Optional, Tuple

_PASSED = ("wrapt", "memgather", "torch.distributed")
# Code objects carry their qualified name (co_qualname) from Python 3.11 on.
HAS_QUALNAME = sys.version_info >= (3, 11)


def passed_through(module: str) -> bool:
    """Frames of these modules are plumbing, not the caller."""
    return any(module == name or module.startswith(name + ".") for name in _PASSED)


def module_of(frame: FrameType) -> str:
    """The name of the module whose code ``frame`` runs ("" when it has none)."""
    return frame.f_globals.get("__name__", "")


def calling_frame(frame: Optional[FrameType]) -> Tuple[Optional[FrameType], bool]:
    """The caller's frame, and whether ``frame`` itself was the caller.

    Only a decision made from a frame that was itself the caller may be cached
    by that frame's code object: plumbing code is shared by every caller.
    """
    direct = True
    while frame is not None:
        if not passed_through(module_of(frame)):
            return frame, direct
        direct = False
        frame = frame.f_back
    return None, False


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
        return frame.f_code.co_qualname == qualname  # type: ignore[attr-defined]
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
