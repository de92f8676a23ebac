"""Library helpers that pad, gather, slice and concatenate: recognised by their code, then taken over.

Libraries gather uneven tensors (a rank's rows differ) by padding each rank's tensor to the
largest rank's, gathering ``world`` x the largest, slicing each slot back and concatenating.
Their functions allocate the padding and the slots before the padded all_gather is called, so a
wrapper around that call cannot save them. memgather acts one step earlier, where the library's
own code exchanges the sizes, and only where it can show what the function does::

    install(selection)                     at patch(), and when a selected library is imported
      -> recognise(function)               the function's code, read from its source as a syntax
                                           tree (docstrings, comments and annotations left out),
                                           must be one of the shapes its takeover was written for
                                           (``Shape``), and the module names it reads must be the
                                           objects it expects
      -> function.__code__ = trampoline    the same parameters, one line: enter(key, arguments),
                                           through a name of memgather's in the library's module
                                           (``__memgather_helpers__``). Every name that holds the
                                           function (a default argument, a ``from ... import``)
                                           reaches it; unpatch() puts the library's code back
    enter(key, ...)                        per call:
      -> the library's own code            where memgather is off, inside disabled(), or no real
                                           process group is there (none initialised, mocks)
      -> a graph break, then the above     under torch.compile with a process group: every rank
                                           runs the helper eagerly, compiled or not
      -> Flight                            the library's own code runs, its size exchange watched:
         Flight.exchanged                  the library's list all_gather of its sizes reaches
                                           memgather's wrapper (patcher), which makes it; the
                                           takeover decides from the sizes every rank now holds,
                                           and, where it may gather unpadded, every rank's verdict
                                           on its own input travels in one exchange of memgather's
         TakeOver                          raised there where every rank can: it leaves the
                                           library's frames before any padding is allocated
      -> takeover.finish                   the rows gathered unpadded, as the library would return
                                           them; else the library's own code simply goes on

So the library's code makes its own checks, errors, warnings and size exchange, and its own
padded way wherever memgather does not take over. Ignite's ``all_gather_tensors_with_shapes``
pads before it makes any collective (its shapes are given): its takeover (``run``) decides from
the call's arguments before the library's code runs, and leaves it the whole call wherever it
does not take over. A release whose helper differs in anything but comments, docstrings and
annotations is not recognised and stays as it is.
"""

from __future__ import annotations

import ast
import contextvars
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

import torch
import wrapt

from memgather import compat
from memgather.frames import passed_through, under
from memgather.patching import scope

_log = logging.getLogger("memgather")

# The name the trampolines reach memgather through, in the library's module: a global, which
# torch.compile (Dynamo) follows as it follows the library's own names.
GLOBAL = "__memgather_helpers__"
_MAX_WALK = 32  # frames between memgather's wrapper and the helper's exchange (a wrapper of the user's, Ignite's own)


@dataclass(frozen=True)
class Shape:
    """One release line's code of a helper.

    ``digest``: its code's shape (``digest``); ``releases``: the releases that carry it, as
    ``memgather doctor`` names them; ``options``: what the takeover must know of this code
    (keyword arguments of its ``finish``).
    """

    digest: str
    releases: str
    options: Tuple[Tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Exchange:
    """Where a helper's code exchanges its sizes: the list ``all_gather`` whose first argument is
    ``listed``, in the helper's own body (``nested`` None) or in the function ``nested`` it defines."""

    listed: str
    nested: Optional[str] = None


@dataclass(frozen=True)
class Helper:
    """One library function memgather can take over.

    ``module`` / ``name``: where it is defined. ``shapes``: the code it is taken over for.
    ``expects``: module-level names the code reads, and a test each must pass. ``takeover``:
    ``"module:object"``, imported when the helper is taken over: an object with ``decide`` and
    ``finish`` where ``exchanges`` names the library's size exchanges, else with ``run`` (the
    helper taken over whole).
    """

    key: str
    module: str
    name: str
    shapes: Tuple[Shape, ...]
    expects: Tuple[Tuple[str, Callable[[Any], bool]], ...]
    takeover: str
    exchanges: Tuple[Exchange, ...] = ()


@dataclass
class _Installed:
    helper: Helper
    shape: Shape
    function: types.FunctionType
    code: types.CodeType  # the library's own
    original: types.FunctionType  # a function of the library's own code, for the paths memgather leaves
    takeover: Any
    sites: Dict[Tuple[types.CodeType, int], Exchange]  # the exchanges' (code, line)
    options: Dict[str, Any]  # the shape's (``Shape.options``), read by every call


class Call:
    """One call of a taken-over helper: its arguments as the library's signature binds them."""

    __slots__ = ("entry", "args", "kwargs", "frame", "unwinds_cleanly", "_bound")

    def __init__(self, entry: _Installed, args: Tuple[Any, ...], kwargs: Dict[str, Any], frame: Any) -> None:
        self.entry = entry
        self.args = args
        self.kwargs = kwargs
        self.frame = frame  # the helper's own frame (its trampoline's), None under torch.compile
        # Whether ``TakeOver`` would leave through the library's and memgather's frames alone: a wrapper
        # of the user's around all_gather, installed after patch(), would have the rest of its code
        # skipped (a timer, a log, a flag it resets after the call). This rank's verdict says so.
        self.unwinds_cleanly = True
        self._bound: Optional[Dict[str, Any]] = None

    @property
    def caller(self) -> Any:
        """The frame that called the helper (None where unknown)."""
        return None if self.frame is None else self.frame.f_back

    @property
    def namespace(self) -> Dict[str, Any]:
        """The library module's names, as its code reads them."""
        return self.entry.function.__globals__

    @property
    def options(self) -> Dict[str, Any]:
        """What the takeover must know of the matched code (``Shape.options``)."""
        return self.entry.options

    def argument(self, name: str) -> Any:
        """The value of the helper's parameter ``name`` in this call (its default where not given)."""
        if self._bound is None:
            bound = inspect.signature(self.entry.original).bind(*self.args, **self.kwargs)
            bound.apply_defaults()
            self._bound = dict(bound.arguments)
        return self._bound[name]


class TakeOver(BaseException):
    """Raised from the library's size exchange where every rank gathers unpadded: it leaves the
    library's frames for ``enter``. A BaseException, so that no ``except Exception`` on the way
    (a wrapper of the user's around all_gather) takes it for an error of its own."""

    def __init__(self, flight: "Flight", plan: Any) -> None:
        super().__init__("memgather takes over the rest of this helper's call")
        self.flight = flight
        self.plan = plan


class Flight:
    """A taken-over helper's call running the library's own code on this thread, until its size exchange."""

    __slots__ = ("call", "awaiting")

    def __init__(self, call: Call) -> None:
        self.call = call
        self.awaiting = True

    def site(self, frame: Any) -> Optional[Tuple[Exchange, bool]]:
        """The exchange the list all_gather made from ``frame`` (memgather's wrapper's caller) is, where
        it is one, and whether only the library's own frames lie between (``Call.unwinds_cleanly``): the
        nearest frame up the stack that runs the helper's code must be at an exchange's line (a wrapper
        of the user's around all_gather, or Ignite's own all_gather, may sit between)."""
        codes = self.call.entry.sites
        between: List[str] = []
        for _ in range(_MAX_WALK):
            if frame is None:
                return None
            found = codes.get((frame.f_code, frame.f_lineno))
            if found is not None:
                return found, all(_passed(module, found) for module in between)
            if frame.f_code is self.call.entry.code or any(code is frame.f_code for code, _ in codes):
                return None  # the helper's code, elsewhere than at an exchange
            between.append(frame.f_globals.get("__name__", ""))
            frame = frame.f_back
        return None

    def exchanged(self, site: Tuple[Exchange, bool], wrapped: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Make the library's exchange as it asked (``wrapped``: what memgather's wrapper wraps), then let
        the takeover decide from what every rank now holds; raise ``TakeOver`` where it takes over."""
        self.awaiting = False
        exchange, self.call.unwinds_cleanly = site
        done = wrapped(*args, **kwargs)
        tensor_list = args[0] if args else kwargs.get("tensor_list")
        plan = self.call.entry.takeover.decide(self.call, exchange, tensor_list)
        if plan is not None:
            raise TakeOver(self, plan)
        return done


def _passed(module: str, exchange: Exchange) -> bool:
    """Whether a frame of ``module`` between memgather's wrapper and the helper's exchange is plumbing that
    holds nothing after the call: wrapt's, memgather's, torch.distributed's, and for MONAI's exchange
    through Ignite, Ignite's own ``idist.all_gather``."""
    if passed_through(module):
        return True
    return exchange.nested == "_ignite_all_gather" and under(module, ("ignite.distributed",))


_flight: contextvars.ContextVar[Optional[Flight]] = contextvars.ContextVar("memgather_helper_flight", default=None)


def in_flight() -> Optional[Flight]:
    """The taken-over helper call on this thread that still awaits its size exchange, if any."""
    flight = _flight.get()
    return flight if flight is not None and flight.awaiting else None


_lock = threading.RLock()
_registry: Dict[str, Helper] = {}
_installed: Dict[str, _Installed] = {}  # taken over now
# Every helper ever taken over in this process, kept: a trampoline already running when
# unpatch() gives the code back still finds the library's code to run.
_seen: Dict[str, _Installed] = {}
_trampolines: Dict[types.CodeType, types.CodeType] = {}  # each trampoline -> the library's code it stands for
_hooked: set = set()
_enabled = False
_elide: Optional[bool] = None  # the active patch's elide= (None: memgather decides)
_selected: Callable[[str], bool] = frozenset().__contains__  # the active patch's: is a module's library selected?


def register(helper: Helper) -> None:
    """Make ``helper`` one that ``install`` looks for."""
    _registry[helper.key] = helper


def digest(function: Any) -> Optional[str]:
    """The shape of ``function``'s code: a hash of its syntax tree without docstrings, positions,
    comments or annotations, and without the empty fields a newer Python's tree adds (None where its
    source cannot be read).

    Annotations are left out because they never decide what a call does: a function's own are
    evaluated when it is defined (at most raising there), a local variable's never."""
    tree = source_tree(function)
    return None if tree is None else _digest_of(tree)


def source_tree(function: Any) -> Optional[ast.AST]:
    """``function``'s definition as a syntax tree, read from its source (None where it cannot be read)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    return tree.body[0] if len(tree.body) == 1 else tree


def _digest_of(node: Any) -> str:
    return hashlib.sha256(_canonical(node).encode()).hexdigest()[:32]


def shape_of(helper: Helper, found: Optional[str]) -> Optional[Shape]:
    """The registered shape of ``helper`` whose digest is ``found``, if any."""
    return next((shape for shape in helper.shapes if shape.digest == found), None)


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
    shape = shape_of(helper, _digest_of(defined[-1]))  # the last definition is the one the module keeps
    if shape is None:
        return "its code is not a shape memgather was written for: left to the library"
    return f"recognised ({shape.releases}): taken over where its library is a selected target"


# Fields that hold annotations: a parameter's, a function's return, an annotated assignment's.
_ANNOTATIONS = {
    ("arg", "annotation"),
    ("FunctionDef", "returns"),
    ("AsyncFunctionDef", "returns"),
    ("AnnAssign", "annotation"),
}


def _canonical(node: Any) -> str:
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    kind = type(node).__name__
    for name, value in ast.iter_fields(node):
        if name == "body" and isinstance(value, list) and _is_docstring(node, value):
            value = value[1:]
        if value is None or value == [] or name in ("type_comment", "kind") or (kind, name) in _ANNOTATIONS:
            continue
        fields.append(f"{name}={_canonical(value)}")
    return f"{kind}({','.join(fields)})"


def _is_docstring(node: Any, body: List[Any]) -> bool:
    return (
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )


def recognise(helper: Helper, function: Any) -> Optional[str]:
    """Why ``function`` is not ``helper``'s code as memgather knows it (None: it is)."""
    return _recognised(helper, function)[0]


def _recognised(helper: Helper, function: Any) -> Tuple[Optional[str], Optional[Shape], Optional[ast.AST]]:
    """``recognise``'s answer, and where it is none, the shape matched and the syntax tree read (one
    reading of the source, for the takeover's sites too)."""
    if not isinstance(function, types.FunctionType) or function.__closure__:
        return "not a plain module-level function", None, None
    tree = source_tree(function)
    shape = None if tree is None else shape_of(helper, _digest_of(tree))
    if shape is None:
        return "its code is not a shape memgather was written for", None, None
    namespace = function.__globals__
    for name, test in helper.expects:
        if name not in namespace or not test(namespace[name]):
            return f"its module's {name!r} is not what its code expects", None, None
    if GLOBAL in namespace and namespace[GLOBAL] is not sys.modules[__name__]:
        return f"its module's {GLOBAL!r} is something else", None, None
    return None, shape, tree


def install(selected: Callable[[str], bool], elide: Optional[bool] = None) -> None:
    """Take over every registered helper whose module is imported and ``selected``; hook the rest; give
    back those no longer selected. A helper selected before and now stays taken over throughout: a
    call of it on another thread meanwhile takes the same way as on every other rank.

    ``elide``: the patch's setting, which the takeovers follow (``elide_setting``).
    """
    global _enabled, _elide, _selected
    with _lock:
        _enabled, _elide, _selected = True, elide, selected
        for key, entry in list(_installed.items()):
            if not selected(entry.helper.module):
                entry.function.__code__ = entry.code
                del _installed[key]
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


def runs(code: types.CodeType) -> Optional[types.CodeType]:
    """The library's own code of the helper whose trampoline ``code`` is (None where it is none): the
    trampoline returns what that code returns, where memgather does not take the call over."""
    return _trampolines.get(code)


def taken_over() -> List[str]:
    """The helpers memgather runs now, as ``module.name``."""
    return [f"{entry.helper.module}.{entry.helper.name}" for entry in _installed.values()]


def enter(key: str, /, *args: Any, **kwargs: Any) -> Any:
    """A taken-over helper's call (its trampoline's one line)."""
    entry = _seen[key]
    if compat.is_compiling():
        return _traced(entry, args, kwargs)
    return _eager(entry, args, kwargs, sys._getframe(1))


def _traced(entry: _Installed, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Under torch.compile. Where a process group exists, the helper's collectives may run: the call
    leaves the graph (a graph break) and runs eagerly, so that a rank that compiles it and one that
    runs it eagerly (past the recompile limit, or not compiling at all) issue the same collectives.
    Without one, the library's own code is traced, as without memgather (``fullgraph=True`` too)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return _run_eagerly()(entry, args, kwargs, None)
    return entry.original(*args, **kwargs)


_eagerly: List[Callable[..., Any]] = []


def _run_eagerly() -> Callable[..., Any]:
    if not _eagerly:
        compiler = getattr(torch, "compiler", None)
        disable = getattr(compiler, "disable", None) or torch._dynamo.disable  # torch < 2.1
        _eagerly.append(disable(_eager))
    return _eagerly[0]


def _eager(entry: _Installed, args: Tuple[Any, ...], kwargs: Dict[str, Any], frame: Any) -> Any:
    if _installed.get(entry.helper.key) is not entry or scope.is_disabled() or not _real_group():
        return entry.original(*args, **kwargs)
    call = Call(entry, args, kwargs, frame)
    if not entry.helper.exchanges:
        return entry.takeover.run(call)
    flight = Flight(call)
    token = _flight.set(flight)
    plan: Any = None
    try:
        return entry.original(*args, **kwargs)
    except TakeOver as taken:
        if taken.flight is not flight:
            raise
        plan = taken.plan
    finally:
        _flight.reset(token)
    # Outside the except block: an error of the takeover's own is not chained to the TakeOver.
    return entry.takeover.finish(call, plan)


def _real_group() -> bool:
    """Whether the helper's collectives are torch.distributed's own on a process group: one is
    initialised, and the functions the libraries call are not mocks (a unit test's)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return not any(_is_mock(getattr(dist, name, None)) for name in ("all_gather", "barrier", "get_world_size"))


def _is_mock(value: Any) -> bool:
    return type(value).__module__ == "unittest.mock"


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
    why, shape, tree = _recognised(helper, function)
    if why is not None:
        _log.info("memgather leaves %s.%s as it is: %s", helper.module, helper.name, why)
        return
    assert isinstance(function, types.FunctionType) and shape is not None  # _recognised() found them
    sites = _sites(helper, function, tree)
    if sites is None:
        _log.info(
            "memgather leaves %s.%s as it is: its size exchange is not where its shape has it",
            helper.module,
            helper.name,
        )
        return
    where, _, name = helper.takeover.partition(":")
    takeover = getattr(importlib.import_module(where), name)
    code = function.__code__
    original = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__)
    original.__kwdefaults__ = function.__kwdefaults__
    function.__globals__[GLOBAL] = sys.modules[__name__]  # kept after unpatch(): a trampoline may be starting
    function.__code__ = _trampoline(code, helper.key)
    _trampolines[function.__code__] = code
    entry = _Installed(helper, shape, function, code, original, takeover, sites, dict(shape.options))
    _installed[helper.key] = _seen[helper.key] = entry
    _log.info(
        "memgather takes over %s.%s (%s): uneven gathers without padding", helper.module, helper.name, shape.releases
    )


def _sites(
    helper: Helper, function: types.FunctionType, tree: Optional[ast.AST]
) -> Optional[Dict[Tuple[types.CodeType, int], Exchange]]:
    """Each exchange of ``helper`` as (the code object that makes it, its line in the file), read from
    the function's syntax tree (None where one is not found exactly once)."""
    if not isinstance(tree, ast.FunctionDef):
        return None
    code = function.__code__
    sites: Dict[Tuple[types.CodeType, int], Exchange] = {}
    for exchange in helper.exchanges:
        body: ast.AST = tree
        made_by = code
        if exchange.nested is not None:
            nested = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == exchange.nested]
            codes = [c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == exchange.nested]
            if len(nested) != 1 or len(codes) != 1:
                return None
            body, made_by = nested[0], codes[0]
        calls = [
            node
            for node in ast.walk(body)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "all_gather"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == exchange.listed
        ]
        if len(calls) != 1 or calls[0].lineno != getattr(calls[0], "end_lineno", calls[0].lineno):
            return None
        sites[(made_by, code.co_firstlineno + calls[0].lineno - tree.lineno)] = exchange
    return sites


def _trampoline(code: types.CodeType, key: str) -> types.CodeType:
    """Code with ``code``'s parameters that calls ``enter(key, ...)`` with them.

    It finds memgather through a global of its module (``GLOBAL``), which torch.compile can
    follow; its file, first line and names are the library's, as tracebacks and
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
    source = f"def {code.co_name}({', '.join(params)}):\n    return {GLOBAL}.enter({', '.join(passed)})\n"
    compiled = compile(source, code.co_filename, "exec")
    made = next(c for c in compiled.co_consts if isinstance(c, types.CodeType))
    changes: Dict[str, Any] = {"co_firstlineno": code.co_firstlineno}
    if hasattr(code, "co_qualname"):
        changes["co_qualname"] = code.co_qualname
    return made.replace(**changes)
