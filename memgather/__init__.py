"""memgather: one flat buffer for torch.distributed.all_gather.

Public API::

    memgather.patch(targets=None, *, check=None, force=None, elide=None, verify=None) / unpatch() / is_patched()
    memgather.disabled()                 # opt out, as context manager or decorator
    memgather.all_gather(tensor_list, tensor, group=None, async_op=False)
    memgather.gather(tensor, group=None) -> Tensor
    memgather.gather_uneven(tensor, group=None) -> Tensor   # ranks' dim 0 may differ
    memgather.all_gather_object / gather_object / broadcast_object_list   # torch's signatures, by parts
    memgather.stats() / memgather.reset_stats()
    memgather.primitive()                # the single-tensor all-gather this torch offers, and why
    memgather.TARGETS                    # the built-in target registry
    memgather.UnevenShapesError, memgather.UnevenLayoutError, memgather.VerifyError, memgather.ObjectPickleError

Names are imported on first use, so ``import memgather`` (and the start-up
hook in ``memgather.pth``) does not import torch.

PYTEST_DONT_REWRITE: with ``MEMGATHER=1``, ``memgather.pth`` imports this
package at interpreter start, before pytest marks its plugins' packages
(memgather is one, through ``pytest11``) for assertion rewriting. pytest warns
about each such package already imported, and a run with ``filterwarnings =
error`` or ``-W error`` would fail on that warning; this marker tells pytest
not to rewrite the module, so it does not warn.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "all_gather": ("memgather.engine.core", "all_gather"),
    "gather": ("memgather.engine.core", "gather"),
    "gather_uneven": ("memgather.engine.core", "gather_uneven"),
    "all_gather_object": ("memgather.engine.objects", "all_gather_object"),
    "gather_object": ("memgather.engine.objects", "gather_object"),
    "broadcast_object_list": ("memgather.engine.objects", "broadcast_object_list"),
    "patch": ("memgather.patching.patcher", "patch"),
    "unpatch": ("memgather.patching.patcher", "unpatch"),
    "is_patched": ("memgather.patching.patcher", "is_patched"),
    "disabled": ("memgather.patching.scope", "disabled"),
    "stats": ("memgather.engine.counters", "stats"),
    "reset_stats": ("memgather.engine.counters", "reset_stats"),
    "Stats": ("memgather.engine.counters", "Stats"),
    "primitive": ("memgather.compat", "single_tensor_primitive"),
    "Primitive": ("memgather.compat", "Primitive"),
    "UnevenShapesError": ("memgather.errors", "UnevenShapesError"),
    "UnevenLayoutError": ("memgather.errors", "UnevenLayoutError"),
    "VerifyError": ("memgather.errors", "VerifyError"),
    "ObjectPickleError": ("memgather.errors", "ObjectPickleError"),
    "Reason": ("memgather.engine.reasons", "Reason"),
    "Strategy": ("memgather.engine.reasons", "Strategy"),
    "Target": ("memgather.patching.targets", "Target"),
    "TARGETS": ("memgather.patching.targets", "BUILTIN"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'memgather' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))


def _watch_cuda(_torch: Any = None) -> None:
    """Import ``memgather.cuda_watch``, whose hooks see CUDA graphs captured and tensors lent.

    memgather may rebind a CUDA slot only while no graph captured in this process can replay
    into it, and a capture made before the hooks exist is never seen: so they go in as
    memgather is imported, where torch already is, else as torch's own import ends (the
    kill switch ``MEMGATHER=0`` is ``cuda_watch``'s to read). Not while torch is still
    importing (from another import hook), and never at the cost of an error in torch's
    import or memgather's (a module lock another thread holds): the engine's import installs
    them then, counting any CUDA use before as a graph it could not see.
    """
    torch = sys.modules.get("torch")
    if _torch is None and torch is not None and getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return  # (called by the post-import hook, ``_torch``, torch's own code has run to its end)
    try:
        importlib.import_module("memgather.cuda_watch")
    except Exception:  # never fail torch's import, or memgather's, over it: the engine's import covers the gap
        logging.getLogger("memgather").debug("CUDA graph hooks deferred to the engine's import", exc_info=True)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs; ``import x as x`` marks a re-export
    from memgather.compat import Primitive as Primitive
    from memgather.compat import single_tensor_primitive as primitive  # noqa: F401 - re-exported as memgather.primitive
    from memgather.engine.core import all_gather as all_gather
    from memgather.engine.core import gather as gather
    from memgather.engine.core import gather_uneven as gather_uneven
    from memgather.engine.counters import Stats as Stats
    from memgather.engine.counters import reset_stats as reset_stats
    from memgather.engine.counters import stats as stats
    from memgather.engine.objects import all_gather_object as all_gather_object
    from memgather.engine.objects import broadcast_object_list as broadcast_object_list
    from memgather.engine.objects import gather_object as gather_object
    from memgather.engine.reasons import Reason as Reason
    from memgather.engine.reasons import Strategy as Strategy
    from memgather.errors import ObjectPickleError as ObjectPickleError
    from memgather.errors import UnevenLayoutError as UnevenLayoutError
    from memgather.errors import UnevenShapesError as UnevenShapesError
    from memgather.errors import VerifyError as VerifyError
    from memgather.patching.patcher import is_patched as is_patched
    from memgather.patching.patcher import patch as patch
    from memgather.patching.patcher import unpatch as unpatch
    from memgather.patching.scope import disabled as disabled
    from memgather.patching.targets import BUILTIN as TARGETS  # noqa: F401 - re-exported as memgather.TARGETS
    from memgather.patching.targets import Target as Target


if "torch" in sys.modules:
    _watch_cuda()
else:
    import wrapt

    wrapt.register_post_import_hook(_watch_cuda, "torch")
