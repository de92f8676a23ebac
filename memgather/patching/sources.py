"""The source of a running function, and the proof that it is the source of the code that runs.

``function_of(code, globals)`` reads the file a code object was compiled from
(through ``linecache``, which asks the module's loader where the file is not on
disk: a zip import with its sources), compiles that text as the import did, and
finds the code object compiled from the same place. Only if it is the running
code (same bytecode, names, constants' shape and line table) is the text taken
for the function's: a file edited since import, code compiled from a string,
code whose bytecode was rewritten at import (pytest rewrites the asserts of test
modules) or a module imported from bytecode alone is refused, with the reason.

Each file is parsed and compiled once per text, when a call site is first seen: a
few milliseconds for a small module, about 0.1 s for 100 KiB of source, a second for
a very large file.
"""

from __future__ import annotations

import ast
import linecache
import sys
import threading
from dataclasses import dataclass
from types import CodeType
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

_lock = threading.Lock()
_files: Dict[Tuple[str, int], "_Parsed"] = {}  # (filename, hash of the text) -> parsed
_MAX_FILES = 256


@dataclass(frozen=True)
class _Parsed:
    tree: Optional[ast.Module]
    compiled: Optional[CodeType]
    error: str


@dataclass(frozen=True)
class Source:
    """A function's syntax tree, checked against the code object that runs."""

    function: ast.AST
    filename: str


def function_of(code: CodeType, module_globals: Optional[Mapping[str, Any]]) -> Union[Source, str]:
    """The checked syntax tree of the function ``code`` runs, else why it cannot be had."""
    filename = code.co_filename
    if filename.startswith("<") and filename.endswith(">"):
        return f"no source: compiled from a string ({filename})"
    if code.co_name in ("<module>", "<lambda>") or code.co_name.startswith("<"):
        return f"not a function ({code.co_name} in {filename})"
    linecache.checkcache(filename)
    lines = linecache.getlines(filename, module_globals if isinstance(module_globals, dict) else None)
    if not lines:
        return f"no source for {filename} (imported from bytecode alone, or the file is gone)"
    parsed = _parse(filename, "".join(lines))
    if parsed.tree is None or parsed.compiled is None:
        return f"{filename}: {parsed.error}"
    compiled = _find_code(parsed.compiled, code)
    if compiled is None or not _same_code(compiled, code):
        return (
            f"{filename} is not the source of the code that runs (edited since import, or its bytecode "
            "was rewritten at import, as pytest rewrites test modules' asserts)"
        )
    function = _find_function(parsed.tree, code)
    if function is None:
        return f"{filename}: no definition of {code.co_name} at line {code.co_firstlineno}"
    return Source(function, filename)


def parse_file(filename: str, text: str) -> Optional[ast.Module]:
    """The syntax tree of a file's text (cached with its compiled code), or None where it does not parse."""
    return _parse(filename, text).tree


def _parse(filename: str, text: str) -> _Parsed:
    key = (filename, hash(text))
    with _lock:
        known = _files.get(key)
    if known is not None:
        return known
    try:
        tree = ast.parse(text, filename)
        compiled = compile(tree, filename, "exec", dont_inherit=True, optimize=sys.flags.optimize)
        parsed = _Parsed(tree, compiled, "")
    except (SyntaxError, ValueError) as error:
        parsed = _Parsed(None, None, f"does not compile here ({type(error).__name__}: {error})")
    with _lock:
        if len(_files) >= _MAX_FILES:
            _files.clear()
        _files[key] = parsed
    return parsed


def _find_code(module: CodeType, code: CodeType) -> Optional[CodeType]:
    pending = [module]
    while pending:
        current = pending.pop()
        if current.co_name == code.co_name and current.co_firstlineno == code.co_firstlineno:
            if getattr(current, "co_qualname", None) == getattr(code, "co_qualname", None):
                return current
        pending.extend(c for c in current.co_consts if isinstance(c, CodeType))
    return None


def _same_code(compiled: CodeType, running: CodeType) -> bool:
    """Same bytecode, names, line table and nested code: the text compiles to what runs."""
    table = "co_linetable" if sys.version_info >= (3, 10) else "co_lnotab"
    for attribute in ("co_code", "co_names", "co_varnames", "co_freevars", "co_cellvars", table):
        if getattr(compiled, attribute) != getattr(running, attribute):
            return False
    return _shape(compiled.co_consts) == _shape(running.co_consts)


def _shape(consts: Tuple[Any, ...]) -> List[Any]:
    """Nested code by name, place and bytecode; scalars by value; anything else (a frozenset,
    whose order may differ between two builds of it) by type."""
    return [
        (c.co_name, c.co_firstlineno, c.co_code, c.co_names, c.co_varnames, _shape(c.co_consts))
        if isinstance(c, CodeType)
        else (type(c).__name__, c if isinstance(c, (int, float, str, bytes, type(None))) else None)
        for c in consts
    ]


def _find_function(tree: ast.Module, code: CodeType) -> Optional[ast.AST]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first == code.co_firstlineno:
                return node
    return None
