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
needs it, cannot be imported yet. The patch then waits for the end of the
outermost memgather import under way, which ``_Watch`` sees: until the patch
is done it wraps the loader of each memgather module imported, to count the
imports under way on this thread.
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

_state = threading.local()  # .depth: memgather imports under way on this thread
_waiting = False  # torch is ready, memgather's own import was not: patch once it is


def _patch(module: ModuleType) -> None:
    global _waiting
    if getattr(_state, "depth", 0):
        _waiting = True
        return
    _waiting = False
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


class _Watch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands each memgather module's spec on with its loader wrapped."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith("memgather."):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Counted(spec.loader)
                return spec
        return None

    @classmethod
    def install(cls) -> None:
        sys.meta_path.insert(0, cls())

    @classmethod
    def remove(cls) -> None:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, cls)]


class _Counted(importlib.abc.Loader):
    """A memgather module's own loader, counting the imports under way; the last one to end
    runs a patch that waited for it. Everything else is the wrapped loader's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            self._loader.exec_module(module)
        finally:
            _state.depth -= 1
        if _waiting and not _state.depth:
            _patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_Watch.install()
wrapt.register_post_import_hook(_on_torch_loaded, "torch")
