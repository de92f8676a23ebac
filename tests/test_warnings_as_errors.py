"""MEMGATHER=1 in a pytest run that treats warnings as errors, for real: a fresh venv with
memgather installed from its wheel (memgather.pth included), a user's project with
``filterwarnings = error`` (or ``-W error``), and pytest run there.

memgather.pth imports memgather at interpreter start, before pytest marks the packages of
its plugins' distributions for assertion rewriting; pytest warns about every such package
already imported unless its docstring says PYTEST_DONT_REWRITE, and that warning, made an
error, would fail the user's run before a test is collected.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.jobs import environment
from tests.test_pth import venv

__all__ = ["venv"]  # the fixture: a fresh venv, memgather from its freshly built wheel

PROJECT_TESTS = textwrap.dedent(
    """
    import sys

    def test_x():
        assert 1 + 1 == 2

    def test_memgather_came_in_from_the_wheel_through_its_pth():
        assert "memgather.patching.autoload" in sys.modules
        assert sys.modules["memgather"].__file__.startswith(sys.prefix)
    """
)


@pytest.mark.parametrize("ini,args", [
    ("[pytest]\nfilterwarnings = error\n", []),
    ("[pytest]\n", ["-W", "error"]),
], ids=["filterwarnings-error", "W-error"])
def test_memgather_1_passes_a_run_where_warnings_are_errors(venv: Path, tmp_path: Path, ini: str, args: list[str]) -> None:
    (tmp_path / "pytest.ini").write_text(ini)
    (tmp_path / "test_project.py").write_text(PROJECT_TESTS)
    done = subprocess.run([str(venv), "-m", "pytest", "-p", "no:cacheprovider", *args], check=False, capture_output=True, text=True,
                          env=environment(MEMGATHER="1", PYTEST_ADDOPTS=""), cwd=tmp_path, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "2 passed" in done.stdout, said[-3000:]
    assert "PytestAssertRewriteWarning" not in said
