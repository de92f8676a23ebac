"""Run on every rank of a pool: cat elision under each way of setting it (tests/test_patcher.py).

Two call sites of tests/sites/proof_cases.py: MoCo's ``concat_all_gather``,
which the proof accepts, and a function that scales the cat's result in place
and then reads a slot, which it refuses. Under each setting: whether the cat
was elided, and whether the values are torch's.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

import memgather
from memgather.engine import core
from tests.sites import proof_cases

TARGETS = ["tests.sites.proof_cases"]


def elided_sites(ctx: Any, elide: Optional[bool], env_elide: Optional[str]) -> Dict[str, Any]:
    """``elide`` goes to ``patch()``; ``env_elide`` (if not None) is ``MEMGATHER_ELIDE``."""
    saved = os.environ.get("MEMGATHER_ELIDE")
    mine = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * ctx.rank
    gathered = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * r for r in range(ctx.world)])
    try:
        if env_elide is not None:
            os.environ["MEMGATHER_ELIDE"] = env_elide
        memgather.patch(TARGETS, elide=elide)
        memgather.reset_stats()
        moco = proof_cases.accepted_moco(mine.clone())
        moco_elided = memgather.stats().elided
        memgather.reset_stats()
        scaled, slot = proof_cases.refused_scale_then_read_slot(mine.clone())
        return {
            "moco": {"elided": moco_elided, "torch_values": torch.equal(moco, gathered)},
            "scale_then_read_slot": {
                "elided": memgather.stats().elided,
                "torch_values": torch.equal(scaled, gathered * 2) and torch.equal(slot, gathered[:2]),
                "slot_scaled": torch.equal(slot, gathered[:2] * 2),
            },
        }
    finally:
        memgather.unpatch()
        if saved is None:
            os.environ.pop("MEMGATHER_ELIDE", None)
        else:
            os.environ["MEMGATHER_ELIDE"] = saved
        # unpatch() read the environment while MEMGATHER_ELIDE was still this case's: read it again,
        # or direct calls made later on this rank would keep this case's elision setting.
        core.configure()
