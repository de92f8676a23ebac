"""Run on every rank of a pool: which call sites get cat elision under ``patch()`` (tests/test_patcher.py).

The stand-ins in this folder are loaded from their files under the names of
the modules they stand for (``accelerate.utils.operations``,
``transformers.trainer_pt_utils``): their frames are real, with the module
name and qualified names the audit data is keyed to, and the releases come
from real ``.dist-info`` metadata in ``metadata_dir``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import memgather
from memgather.engine import core
from memgather.engine.elision import ElidableSlot
from tests.sites import target_caller

HERE = Path(__file__).resolve().parent
STANDINS = {"accelerate.utils.operations": "audited_operations.py",
            "transformers.trainer_pt_utils": "audited_trainer_pt_utils.py"}
TARGETS = ["accelerate", "transformers", "tests.sites.target_caller"]


def elided_sites(ctx: Any, metadata_dir: str, elide: Optional[bool], env_elide: Optional[str]) -> Dict[str, Any]:
    """Per call site: whether its gather was rewired, armed for elision, and gave torch's values.

    ``elide`` goes to ``patch()``; ``env_elide`` (if not None) is ``MEMGATHER_ELIDE``.
    """
    saved_path, saved_env = list(sys.path), os.environ.get("MEMGATHER_ELIDE")
    sys.path.insert(0, metadata_dir)
    loaded = {name: _load(name, HERE / file) for name, file in STANDINS.items()}
    _forget_releases()
    try:
        if env_elide is not None:
            os.environ["MEMGATHER_ELIDE"] = env_elide
        memgather.patch(TARGETS, elide=elide)
        operations, trainer = loaded["accelerate.utils.operations"], loaded["transformers.trainer_pt_utils"]
        calls: List[Tuple[str, Any, Callable[[torch.Tensor], Any]]] = [
            ("audited", operations, operations._gpu_gather),
            ("same_name_elsewhere", operations, operations.gather_across_data_parallel_groups),
            ("other_function", operations, operations._neuron_gather_object),
            ("audited_transformers", trainer, trainer.distributed_concat),
            ("other_transformers", trainer, trainer.distributed_broadcast_scalars),
            ("user_target", None, target_caller.gather),
        ]
        return {label: _gather(ctx, module, call) for label, module, call in calls}
    finally:
        memgather.unpatch()
        for name in STANDINS:
            sys.modules.pop(name, None)
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("MEMGATHER_ELIDE", None)
        else:
            os.environ["MEMGATHER_ELIDE"] = saved_env
        # unpatch() read the environment while MEMGATHER_ELIDE was still this case's: read it again,
        # or direct calls made later on this rank would keep this case's elision setting.
        core.configure()
        _forget_releases()


def _gather(ctx: Any, module: Any, call: Callable[[torch.Tensor], Any]) -> Dict[str, Any]:
    memgather.reset_stats()
    mine = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * ctx.rank
    result = call(mine)
    if module is None:  # a list of slots, kept: armed ones are still ElidableSlot
        armed = all(isinstance(slot, ElidableSlot) for slot in result)
        result = torch.cat(result, dim=0)
    else:
        armed = module.ARMED.pop()
    expected = torch.cat([torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * r for r in range(ctx.world)])
    return {"rewired": memgather.stats().rewired, "armed": armed, "correct": torch.equal(result, expected)}


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _forget_releases() -> None:
    """Versions are read once per process; each case brings its own metadata."""
    from tests.conftest import forget_verdicts

    forget_verdicts()
