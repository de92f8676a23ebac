"""Imported by ``memgather.pth`` at interpreter start-up when ``MEMGATHER`` is set and not 0.

Patches once torch and torch.distributed are both imported, through wrapt
post-import hooks, so a process that never uses torch never imports it.
torch 2.x imports torch.distributed from inside its own ``__init__``, when
torch is only half initialised; patching there would call into a torch not
ready for it, so the trigger is the end of torch's own import.

A script that imports memgather before torch (``import memgather;
memgather.patch(...)`` or ``from memgather import all_gather`` at its top)
brings torch in from inside one of memgather's own modules: when torch's
import ends, that module is still half initialised, and the patcher, which
needs it, cannot be imported yet. The patch then waits until no memgather
import is under way on any thread, which ``_Watch`` sees: until the patch is
done it wraps the loader of each memgather module imported, to count the
imports under way. pytest puts its own finder in front of every other; the
pytest plugin moves the watch back to the front (``watch_first``) when pytest
loads it, before any conftest. ``patch()`` reads the engine before it installs
anything, so one that meets a module another thread is still importing fails
whole, as it says.

A reload of this module runs it again: what it installs, it installs once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Optional, Sequence

import wrapt

# Kept across a reload (which runs this file again in the same namespace).
_lock: threading.Lock = globals().get("_lock") or threading.Lock()
_depth: int = globals().get("_depth", 0)  # memgather imports under way, on every thread
_waiting: bool = globals().get("_waiting", False)  # torch is ready, memgather's own import was not
# A fresh import after memgather's modules were dropped from sys.modules finds the first one's watch.
_started: bool = globals().get("_started", False) or any(
    type(finder).__qualname__ == "_Watch" and type(finder).__module__ == __name__ for finder in sys.meta_path
)


def _patch(module: ModuleType) -> None:
    global _waiting
    with _lock:
        _waiting = _depth > 0
        if _waiting:
            return
    _Watch.remove()
    try:
        from memgather.patching.patcher import patch

        patch()
    except Exception:
        logging.getLogger("memgather").exception("memgather could not patch at start-up; torch runs unpatched")


def _on_torch_loaded(module: ModuleType) -> None:
    if "torch.distributed" in sys.modules:
        _patch(module)
    else:  # a torch that does not import torch.distributed itself: wait for the user to
        wrapt.register_post_import_hook(_patch, "torch.distributed")


def watch_first() -> None:
    """Put the watch in front of the finders installed after it, if it is still needed."""
    watches = [finder for finder in sys.meta_path if _is_watch(finder)]
    if watches and sys.meta_path[0] is not watches[0]:
        sys.meta_path.remove(watches[0])
        sys.meta_path.insert(0, watches[0])


class _Watch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands each memgather module's spec on with its loader wrapped."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith("memgather.") or fullname == __name__:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None or _is_watch(finder):
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Counted(spec.loader)
                return spec
        return None

    @staticmethod
    def remove() -> None:
        for finder in [finder for finder in sys.meta_path if _is_watch(finder)]:
            try:
                sys.meta_path.remove(finder)
            except ValueError:  # another thread's remove() took it
                pass


def _is_watch(finder: Any) -> bool:
    # By name: a reload of this module makes a new _Watch class; the instance installed is the first one's.
    return type(finder).__qualname__ == "_Watch" and type(finder).__module__ == __name__


class _Counted(importlib.abc.Loader):
    """A memgather module's own loader, counting the imports under way; the last one to end
    runs a patch that waited for it. Everything else is the wrapped loader's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        global _depth, _waiting
        with _lock:
            _depth += 1
        try:
            self._loader.exec_module(module)
        except BaseException:
            # A patch now would import the half-run module. Said at once, as before the wait.
            with _lock:
                _depth -= 1
                failed, _waiting = _waiting and _depth == 0, _waiting and _depth > 0
            if failed:
                _Watch.remove()
                logging.getLogger("memgather").error(
                    "memgather could not patch at start-up: the import of %s failed; torch runs unpatched",
                    module.__name__,
                )
            raise
        with _lock:
            _depth -= 1
            ready = _waiting and _depth == 0
        if ready:
            _patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


if not _started:
    _started = True
    sys.meta_path.insert(0, _Watch())
    wrapt.register_post_import_hook(_on_torch_loaded, "torch")
