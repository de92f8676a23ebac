"""memgather's modules import one way: compat, config, cow, cuda_watch, errors and frames <- engine <- patching <- tools.

A lower layer never imports a higher one, not even inside a function, and no two
modules of a layer import each other in a circle: each layer can be read, and
changed, knowing only the layers beneath it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "memgather"
BASE = ("memgather.compat", "memgather.config", "memgather.cow", "memgather.cuda_watch", "memgather.errors", "memgather.frames")
LAYERS = {"base": 0, "memgather.engine": 1, "memgather.patching": 2, "memgather.tools": 3}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    if module == "memgather.__main__":  # ``python -m memgather``: the command line
        return LAYERS["memgather.tools"]
    if module in BASE:
        return LAYERS["base"]
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} belongs to no layer: add it to one")


def _imports(path: Path) -> Iterator[str]:
    """Every memgather module ``path`` imports, at any depth of its code."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from memgather.engine import core`` imports memgather.engine.core
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name.startswith("memgather.") and _is_module(name):
                yield name


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative / "__init__.py").exists()


MODULES: Dict[str, Set[str]] = {
    _module_name(path): set(_imports(path)) - {_module_name(path)}
    for path in sorted(PACKAGE.rglob("*.py"))
    if path != PACKAGE / "__init__.py"  # the package's lazy exports name every layer on purpose
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_own_layer_and_those_beneath(module: str) -> None:
    above = sorted(name for name in MODULES[module]
                   if _layer(name) > _layer(module) and not _is_package_init(name))
    assert not above, f"{module} imports {above}, from a layer above its own"


def _is_package_init(name: str) -> bool:
    """``memgather.engine`` itself (a package's docstring) is no layer's code."""
    return name in LAYERS


def test_no_modules_import_each_other_in_a_circle() -> None:
    def cycle_from(start: str, path: List[str]) -> List[str]:
        for name in sorted(MODULES.get(path[-1], ())):
            if name == start:
                return path + [name]
            if name not in path and name in MODULES:
                found = cycle_from(start, path + [name])
                if found:
                    return found
        return []

    for module in sorted(MODULES):
        found = cycle_from(module, [module])
        assert not found, " -> ".join(found)


def test_the_layers_cover_every_module() -> None:
    for module in MODULES:
        _layer(module)  # raises for a module of no layer
    assert len(MODULES) > 30, sorted(MODULES)
