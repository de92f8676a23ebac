"""Imported by ``memgather.pth`` at interpreter start-up when ``MEMGATHER`` is set and not 0.

Patches as soon as ``torch.distributed`` is imported, through a wrapt
post-import hook, so a process that never uses torch never imports it.
"""

from __future__ import annotations

import logging
from types import ModuleType

import wrapt


def _patch_from_environment(module: ModuleType) -> None:
    try:
        from memgather.patcher import patch

        patch()
    except Exception:  # noqa: BLE001 - never break the user's import of torch
        logging.getLogger("memgather").exception("memgather could not patch at start-up; torch runs unpatched")


wrapt.register_post_import_hook(_patch_from_environment, "torch.distributed")
