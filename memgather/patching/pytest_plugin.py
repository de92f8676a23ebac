"""pytest plugin: ``pytest --memgather`` runs an existing test suite with memgather on.

Registered through the ``pytest11`` entry point; torch-free, and patching nothing unless
``--memgather`` is given. Like any import of memgather it puts in, once torch is imported,
the hooks that note CUDA graphs captured and CUDA memory lent (``memgather.cuda_watch``):
each then does what torch's own method does. ``MEMGATHER=0`` leaves those out too.
"""

from __future__ import annotations

import sys
from typing import Any

_autoload = sys.modules.get("memgather.patching.autoload")
if _autoload is not None:
    # MEMGATHER is set: pytest's own finder went in front of autoload's watch, which must see
    # memgather's imports from here on (conftests', test modules', --memgather's) to patch after them.
    _autoload.watch_first()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("memgather", "memgather: rewire torch.distributed.all_gather")
    group.addoption(
        "--memgather",
        action="store_true",
        default=False,
        help="patch torch.distributed.all_gather for the selected targets during the run",
    )
    group.addoption(
        "--memgather-targets",
        default=None,
        metavar="T1,T2",
        help="comma-separated targets: built-in names, module prefixes, or '*' (default: every built-in)",
    )
    group.addoption(
        "--memgather-check", action="store_true", default=False, help="cross-rank shape check on every rewired call"
    )
    group.addoption(
        "--memgather-verify",
        action="store_true",
        default=False,
        help="run the original all_gather too for every rewired call and raise "
        "memgather.VerifyError where the results differ (doubles each rewired gather)",
    )


def pytest_configure(config: Any) -> None:
    if not config.getoption("memgather"):
        return
    from memgather.patching import patcher

    raw = config.getoption("memgather_targets")
    chosen = [t for t in raw.split(",") if t.strip()] if raw else None
    patcher.patch(
        chosen,
        check=True if config.getoption("memgather_check") else None,
        verify=True if config.getoption("memgather_verify") else None,
    )
    config._memgather_patched = True


def pytest_unconfigure(config: Any) -> None:
    if getattr(config, "_memgather_patched", False):
        from memgather.patching import patcher

        patcher.unpatch()


def pytest_report_header(config: Any) -> Any:
    if getattr(config, "_memgather_patched", False):
        import os

        return f"memgather: patched for {os.environ.get('MEMGATHER_TARGETS') or 'every built-in target'}"
    return None
