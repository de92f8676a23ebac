"""Every ``all_gather`` call site of an installed library, found by reading its files, with the elision proof's verdict.

``memgather doctor`` lists them so that a user sees, before a job, where a
``torch.cat`` of the gathered list will return the buffer itself. Nothing is
imported: the package is found with ``importlib.util.find_spec`` and its ``.py``
files are parsed. A call counts when its function is, by the module's and the
function's own imports, ``torch.distributed.all_gather`` (a list gather: the
proof's ``gatherer`` role, or ``forward`` inside an autograd Function) or
``torch.distributed.nn.all_gather`` (the Function: the ``receiver`` role).

The live proof (``memgather.patching.sites``) resolves names through the
running module's globals and checks the file against the code that runs; this
one resolves them through import statements alone (and takes
``torch.distributed.all_gather`` / ``dist.all_gather`` spelled out for torch's
where a star import brought the name), so a name bound some other way
(``gather = torch.distributed.all_gather``) is not followed and such a site is
not listed.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from memgather.patching import proof, sources

_MAX_FILES = 5000  # a bound on the walk of one package


@dataclass(frozen=True)
class CallSite:
    """One call of torch's all_gather in a library's code, and the proof's verdict on it."""

    module: str
    qualname: str
    line: int
    role: str  # "gatherer", "forward" or "receiver"
    verdict: proof.Verdict

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname} line {self.line}"


def of_package(top: str) -> Tuple[List[CallSite], str]:
    """The call sites in the installed package ``top`` (a top-level module name), and a note
    ("" when it was read, else why it could not be)."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as error:
        return [], f"cannot find {top}: {error}"
    if spec is None:
        return [], f"{top} is not installed"
    roots = list(spec.submodule_search_locations or [])
    files: List[Tuple[str, str]] = []
    if roots:
        for root in roots:
            files.extend(_files(root, top))
    elif spec.origin and spec.origin.endswith(".py"):
        files.append((spec.origin, top))
    found: List[CallSite] = []
    for path, module in sorted(files)[:_MAX_FILES]:
        found.extend(of_file(path, module))
    return found, ""


def _files(root: str, package: str) -> Iterator[Tuple[str, str]]:
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d.isidentifier())
        relative = os.path.relpath(directory, root)
        prefix = package if relative == "." else package + "." + relative.replace(os.sep, ".")
        for name in sorted(names):
            if name.endswith(".py") and name[:-3].isidentifier():
                module = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                yield os.path.join(directory, name), module


def of_file(path: str, module: str) -> List[CallSite]:
    """The call sites in one file (nothing where it cannot be read or parsed)."""
    try:
        with open(path, "rb") as handle:
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    if "all_gather" not in text:
        return []
    tree = sources.parse_file(path, text)
    if tree is None:
        return []
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    imported = _imports(tree.body, package)
    found: List[CallSite] = []
    for function, qualname, in_function_class in _functions(tree):
        resolve = _resolver(function, imported, package)
        for call in _own_calls(function):
            name = resolve(call.func) or _SPELLED.get(_dotted(call.func))
            if name in proof.GATHERS:
                if in_function_class and function.name == "forward":
                    role, verdict = "forward", proof.forward(function, call, resolve)
                else:
                    role, verdict = "gatherer", proof.gatherer(function, call, resolve)
            elif name in proof.FUNCTION_GATHERS:
                role, verdict = "receiver", proof.receiver(function, call, resolve)
            else:
                continue
            found.append(CallSite(module, qualname, call.lineno, role, verdict))
    return found


FunctionNode = ast.FunctionDef  # async functions are read alike (ast.AsyncFunctionDef has the same fields)


def _functions(tree: ast.Module) -> Iterator[Tuple[ast.FunctionDef, str, bool]]:
    """Every function with its qualified name, and whether it is a method of a class that
    looks like an autograd Function (a base named ``Function``)."""
    pending: List[Tuple[ast.AST, str, bool]] = [(tree, "", False)]
    while pending:
        node, prefix, function_class = pending.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = prefix + child.name
                yield child, qualname, function_class  # type: ignore[misc]  # async defs share the fields read
                pending.append((child, qualname + ".<locals>.", False))
            elif isinstance(child, ast.ClassDef):
                bases = {proof.last_name(base) for base in child.bases}
                pending.append((child, prefix + child.name + ".", "Function" in bases))
            else:
                pending.append((child, prefix, function_class))


def _own_calls(function: ast.AST) -> Iterator[ast.Call]:
    """Calls in the function's own body, not in functions or classes nested in it."""
    pending = list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node
        pending.extend(ast.iter_child_nodes(node))


# Spellings taken for torch's all_gather where imports do not say (a star import brought the name).
_SPELLED = {
    "torch.distributed.all_gather": "torch.distributed.all_gather",
    "dist.all_gather": "torch.distributed.all_gather",
}


def _dotted(expression: ast.expr) -> str:
    parts: List[str] = []
    while isinstance(expression, ast.Attribute):
        parts.append(expression.attr)
        expression = expression.value
    return ".".join([expression.id, *reversed(parts)]) if isinstance(expression, ast.Name) else ""


def _imports(statements: List[ast.stmt], package: str) -> Dict[str, str]:
    """Names bound by import statements among ``statements`` (not inside functions) -> dotted names."""
    names: Dict[str, str] = {}
    pending: List[ast.AST] = list(statements)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if base is not None:
                for alias in node.names:
                    if alias.name != "*":
                        names[alias.asname or alias.name] = f"{base}.{alias.name}"
        else:
            pending.extend(ast.iter_child_nodes(node))
    return names


def _absolute(node: ast.ImportFrom, package: str) -> Optional[str]:
    if not node.level:
        return node.module
    parts = package.split(".") if package else []
    if node.level - 1 > len(parts):
        return None
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else [])) or None


def _resolver(function: ast.FunctionDef, module_names: Dict[str, str], package: str) -> proof.Resolve:
    imported = proof.imported_only(function, lambda node: _absolute(node, package))
    own = {name: f"{module}.{attribute}" if attribute else module for name, (module, attribute) in imported.items()}
    # Every other name the function binds, in any way (an import of two objects included), is its own.
    assigned = {name for node in ast.walk(function) for name, _ in proof.bindings(node, lambda _: None)} - set(own)

    def resolve(expression: ast.expr) -> Optional[str]:
        parts: List[str] = []
        while isinstance(expression, ast.Attribute):
            parts.append(expression.attr)
            expression = expression.value
        if not isinstance(expression, ast.Name) or expression.id in assigned:
            return None
        base = own.get(expression.id) or module_names.get(expression.id)
        if base is None:
            return expression.id if expression.id in ("tuple", "list") and not parts else None
        dotted = ".".join([base, *reversed(parts)])
        return _CANONICAL.get(dotted, dotted)

    return resolve


# Public spellings of the same functions.
_CANONICAL = {
    "torch.distributed.distributed_c10d.all_gather": "torch.distributed.all_gather",
    "torch.distributed.nn.functional.all_gather": "torch.distributed.nn.all_gather",
}
