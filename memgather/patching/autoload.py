"""Imported by ``memgather.pth`` at interpreter start-up when ``MEMGATHER`` is set and not 0.

Patches once torch and torch.distributed are both imported, through wrapt
post-import hooks, so a process that never uses torch never imports it.
torch 2.x imports torch.distributed from inside its own ``__init__``, when
torch is only half initialised; patching there would call into a torch not
ready for it, so the trigger is the end of torch's own import.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

import wrapt


def _patch(module: ModuleType) -> None:
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


wrapt.register_post_import_hook(_on_torch_loaded, "torch")
