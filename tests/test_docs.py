"""The README and docs/ hold together: every relative link resolves, every environment
variable memgather's code reads is documented, and the README stays a landing page."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> Iterator[str]:
    """The lines of a markdown text outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> Set[str]:
    return {_anchor(m.group(1)) for line in _prose(page.read_text()) if (m := re.match(r"^#+ (.*)$", line))}


def _links() -> List[Tuple[Path, str]]:
    found = []
    for page in PAGES:
        for line in _prose(page.read_text()):
            found.extend((page, target) for target in _LINK.findall(line) if not re.match(r"^[a-z]+:", target))
    return found


def test_there_are_relative_links_to_check() -> None:
    assert len(_links()) > 20


@pytest.mark.parametrize("page,target", _links(), ids=lambda value: value.name if isinstance(value, Path) else value)
def test_every_relative_link_resolves(page: Path, target: str) -> None:
    path, _, fragment = target.partition("#")
    destination = (page.parent / path).resolve() if path else page
    assert destination.is_file(), f"{page.relative_to(ROOT)} links to {target}: no such file"
    if fragment:
        assert fragment in _anchors(destination), f"{page.relative_to(ROOT)} links to {target}: no such heading"


@lru_cache(maxsize=None)
def _read_variables() -> Dict[str, str]:
    """Environment variables memgather's code reads, each with the module that reads it.

    Found by the shape of the reading expression: ``os.environ.get("X")`` (also on
    ``env``, the mapping ``config.load`` and ``memgather run`` read), ``os.getenv("X")``,
    ``os.environ["X"]``, and ``name in os.environ for name in ("X", ...)``.
    """
    found: Dict[str, str] = {}
    for module in sorted((ROOT / "memgather").rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            for name in _names_read(node):
                found.setdefault(name, module.relative_to(ROOT / "memgather").as_posix())
    return found


def _is_environment(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id in ("environ", "env"))


def _constants(node: ast.AST) -> List[str]:
    return [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            and re.fullmatch(r"[A-Z][A-Z0-9_]{2,}", c.value)]


def _names_read(node: ast.AST) -> List[str]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        if (node.func.attr == "get" and _is_environment(node.func.value)) or node.func.attr == "getenv":
            return _constants(node.args[0])
    if isinstance(node, ast.Subscript) and _is_environment(node.value):
        return _constants(node.slice)
    if isinstance(node, ast.GeneratorExp) and isinstance(node.elt, ast.Compare) and any(
            _is_environment(c) for c in node.elt.comparators):
        return [name for generator in node.generators for name in _constants(generator.iter)]
    return []


def test_the_variable_scan_finds_what_memgather_reads() -> None:
    read = _read_variables()
    assert {"MEMGATHER", "MEMGATHER_TARGETS", "MEMGATHER_NCCL_MIN_BYTES", "TORCH_DIST_USE_NCCL2", "RANK"} <= set(read)


@pytest.mark.parametrize("name", sorted(_read_variables()))
def test_every_environment_variable_the_code_reads_is_documented(name: str) -> None:
    documented = "\n".join(page.read_text() for page in PAGES)
    assert f"`{name}`" in documented or f"`{name}=" in documented, \
        f"{name} (read in memgather/{_read_variables()[name]}) is not documented in README.md or docs/"


def test_every_setting_has_its_row_in_the_settings_table() -> None:
    table = (ROOT / "docs" / "settings.md").read_text()
    for name in sorted(n for n in _read_variables() if n.startswith("MEMGATHER")):
        assert f"| `{name}` |" in table, f"{name} has no row in docs/settings.md"


def test_the_readme_is_a_landing_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
