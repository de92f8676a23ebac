"""Library helpers that pad, gather, slice and concatenate: recognised by their code, then taken over.

Libraries gather uneven tensors (a rank's rows differ) by padding each rank's tensor to the
largest rank's, gathering ``world`` x the largest, slicing each slot back and concatenating.
Their functions allocate the padding and the slots before any all_gather is called, so a
wrapper around all_gather cannot save them. memgather takes over the whole function instead,
and only where it can show what the function does:

    install(selection)                     at patch(), and when a selected library is imported
      -> recognise(function)               the function's code, read from its source as a syntax
                                           tree (docstrings and comments left out), must be exactly
                                           one of the shapes ``memgather.patching.padded`` was
                                           written from and the library environments run; and the
                                           module names it reads must be the objects it expects
      -> function.__code__ = trampoline    the same parameters, one line: enter(key, arguments).
                                           Every name that holds the function (a default argument,
                                           a ``from ... import``) reaches it; unpatch() puts the
                                           library's code back
    enter(key, ...)                        per call: memgather's replacement where patched, enabled
                                           and not compiling; else the library's own code

The replacement does what the library's code does, collective for collective, up to the
point where every rank knows every rank's sizes; there it gathers the rows unpadded into one
tensor (``memgather.engine.uneven``) where all ranks can, else it runs the library's own
padded steps. A release whose helper changed in any way is not recognised and stays as it is.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import logging
import sys
import textwrap
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import wrapt

from memgather import compat
from memgather.patching import scope

_log = logging.getLogger("memgather")

_ENTER_MODULE = __name__


@dataclass(frozen=True)
class Helper:
    """One library function memgather can take over.

    ``module`` / ``name``: where it is defined. ``shapes``: the digests (``digest``) of the code
    it is taken over for. ``expects``: module-level names the code reads, and a test each must
    pass (the replacement reads the same names). ``replacement``: ``"module:function"``, imported
    when the helper is taken over, and called as ``replacement(original, namespace, *args, **kwargs)``
    with the library's own function.
    """

    key: str
    module: str
    name: str
    shapes: Tuple[str, ...]
    expects: Tuple[Tuple[str, Callable[[Any], bool]], ...]
    replacement: str


@dataclass
class _Installed:
    helper: Helper
    function: types.FunctionType
    code: types.CodeType  # the library's own
    original: types.FunctionType  # a function of the library's own code, for the paths memgather leaves
    replacement: Callable[..., Any]


_lock = threading.RLock()
_registry: Dict[str, Helper] = {}
_installed: Dict[str, _Installed] = {}  # taken over now
# Every helper ever taken over in this process, kept: a trampoline already running when
# unpatch() gives the code back still finds the library's code to run.
_seen: Dict[str, _Installed] = {}
_hooked: set = set()
_enabled = False
_elide: Optional[bool] = None  # the active patch's elide= (None: memgather decides)
_selected: Callable[[str], bool] = frozenset().__contains__  # the active patch's: is a module's library selected?


def register(helper: Helper) -> None:
    """Make ``helper`` one that ``install`` looks for."""
    _registry[helper.key] = helper


def digest(function: Any) -> Optional[str]:
    """The shape of ``function``'s code: a hash of its syntax tree without docstrings, positions or
    comments, and without the empty fields a newer Python's tree adds (None where its source
    cannot be read)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    return _digest_of(tree.body[0] if len(tree.body) == 1 else tree)


def _digest_of(node: Any) -> str:
    return hashlib.sha256(_canonical(node).encode()).hexdigest()[:32]


def survey(known: Optional[Iterable[Helper]] = None) -> List[Tuple[str, str]]:
    """Each helper (default: the registered ones), as ``module.name``, and what ``patch()`` would make
    of its installed code, read from the library's files without importing the library (for
    ``memgather doctor``)."""
    found = []
    for helper in _registry.values() if known is None else known:
        found.append((f"{helper.module}.{helper.name}", _state_on_disk(helper)))
    return found


def _state_on_disk(helper: Helper) -> str:
    top, _, rest = helper.module.partition(".")
    try:
        spec = importlib.util.find_spec(top)  # the top package alone: found, not imported
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "not installed"
    for folder in spec.submodule_search_locations:
        path = Path(folder, *rest.split(".")).with_suffix(".py")
        if path.is_file():
            break
    else:
        return "not installed"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return f"unreadable ({path})"
    defined = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == helper.name]
    if not defined:
        return "not defined there: left to the library"
    if _digest_of(defined[-1]) not in helper.shapes:  # the last definition is the one the module keeps
        return "its code is not a shape memgather was written from: left to the library"
    return "recognised: taken over where its library is a selected target"


def _canonical(node: Any) -> str:
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    for name, value in ast.iter_fields(node):
        if name == "body" and isinstance(value, list) and _is_docstring(node, value):
            value = value[1:]
        if value is None or value == [] or name in ("type_comment", "kind"):
            continue
        fields.append(f"{name}={_canonical(value)}")
    return f"{type(node).__name__}({','.join(fields)})"


def _is_docstring(node: Any, body: List[Any]) -> bool:
    return (
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )


def recognise(helper: Helper, function: Any) -> Optional[str]:
    """Why ``function`` is not ``helper``'s code as memgather knows it (None: it is)."""
    if not isinstance(function, types.FunctionType) or function.__closure__:
        return "not a plain module-level function"
    if digest(function) not in helper.shapes:
        return "its code is not a shape memgather was written from"
    namespace = function.__globals__
    for name, test in helper.expects:
        if name not in namespace or not test(namespace[name]):
            return f"its module's {name!r} is not what its code expects"
    return None


def install(selected: Callable[[str], bool], elide: Optional[bool] = None) -> None:
    """Take over every registered helper whose module is imported and ``selected``; hook the rest.

    ``elide``: the patch's setting, which the replacements follow (``elide_setting``).
    """
    global _enabled, _elide, _selected
    with _lock:
        _enabled, _elide, _selected = True, elide, selected
        for helper in _registry.values():
            if not selected(helper.module):
                continue
            module = sys.modules.get(helper.module)
            if module is not None:
                _take_over(helper, module)
            elif helper.module not in _hooked:
                _hooked.add(helper.module)
                wrapt.register_post_import_hook(_on_import(helper), helper.module)


def uninstall() -> None:
    """Give every helper taken over its own code back."""
    global _enabled
    with _lock:
        _enabled = False
        for entry in _installed.values():
            entry.function.__code__ = entry.code
        _installed.clear()


def elide_setting() -> Optional[bool]:
    """The active patch's ``elide`` (None: where memgather can show it is safe)."""
    return _elide


def taken_over() -> List[str]:
    """The helpers memgather runs now, as ``module.name``."""
    return [f"{entry.helper.module}.{entry.helper.name}" for entry in _installed.values()]


def enter(key: str, /, *args: Any, **kwargs: Any) -> Any:
    """A taken-over helper's call: memgather's replacement, or the library's code where memgather is off."""
    entry = _seen[key]
    if key not in _installed or scope.is_disabled() or compat.is_compiling():
        return entry.original(*args, **kwargs)
    return entry.replacement(entry.original, entry.function.__globals__, *args, **kwargs)


def _on_import(helper: Helper) -> Callable[[types.ModuleType], None]:
    def hook(module: types.ModuleType) -> None:
        try:  # a hook must never break the user's import
            with _lock:
                if _enabled and _selected(helper.module):
                    _take_over(helper, module)
        except Exception:  # noqa: BLE001 - a hook must never break the user's import
            _log.exception("memgather: taking over %s.%s failed; it is left as it is", helper.module, helper.name)

    return hook


def _take_over(helper: Helper, module: types.ModuleType) -> None:
    function = getattr(module, helper.name, None)
    if helper.key in _installed or any(entry.function is function for entry in _installed.values()):
        return  # taken over already (one module's function reached under two names)
    why = recognise(helper, function)
    if why is not None:
        _log.info("memgather leaves %s.%s as it is: %s", helper.module, helper.name, why)
        return
    assert isinstance(function, types.FunctionType)
    where, _, name = helper.replacement.partition(":")
    replacement = getattr(importlib.import_module(where), name)
    code = function.__code__
    original = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__)
    original.__kwdefaults__ = function.__kwdefaults__
    function.__code__ = _trampoline(code, helper.key)
    _installed[helper.key] = _seen[helper.key] = _Installed(helper, function, code, original, replacement)
    _log.info("memgather takes over %s.%s: uneven gathers without padding", helper.module, helper.name)


def _trampoline(code: types.CodeType, key: str) -> types.CodeType:
    """Code with ``code``'s parameters that calls ``enter(key, ...)`` with them.

    It finds memgather through ``__import__``, a builtin, so that the library's module gains
    no name; its file, first line and names are the library's, as tracebacks and
    ``inspect.getsource`` read them.
    """
    names = code.co_varnames
    positional = list(names[: code.co_argcount])
    keyword_only = list(names[code.co_argcount : code.co_argcount + code.co_kwonlyargcount])
    rest = code.co_argcount + code.co_kwonlyargcount
    varargs = names[rest] if code.co_flags & inspect.CO_VARARGS else None
    varkw = names[rest + (1 if varargs else 0)] if code.co_flags & inspect.CO_VARKEYWORDS else None
    params = list(positional)
    if code.co_posonlyargcount:
        params.insert(code.co_posonlyargcount, "/")
    if varargs:
        params.append("*" + varargs)
    elif keyword_only:
        params.append("*")
    params += keyword_only
    if varkw:
        params.append("**" + varkw)
    passed = [repr(key), *positional]
    if varargs:
        passed.append("*" + varargs)
    passed += [f"{name}={name}" for name in keyword_only]
    if varkw:
        passed.append("**" + varkw)
    source = (
        f"def {code.co_name}({', '.join(params)}):\n"
        f"    return __import__({_ENTER_MODULE!r}, None, None, ('enter',)).enter({', '.join(passed)})\n"
    )
    compiled = compile(source, code.co_filename, "exec")
    made = next(c for c in compiled.co_consts if isinstance(c, types.CodeType))
    changes: Dict[str, Any] = {"co_firstlineno": code.co_firstlineno}
    if hasattr(code, "co_qualname"):
        changes["co_qualname"] = code.co_qualname
    return made.replace(**changes)
