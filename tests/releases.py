"""What the torch releases that `tox -m torch-releases` runs offer, as measured there.

Tests whose expectations depend on the release read them here; test_releases.py
checks memgather's gates against them.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple, Optional

import pytest
import torch
from packaging.version import Version


class Facts(NamedTuple):
    primitive: str  # the single-tensor all-gather memgather must call
    gloo_single: bool  # gloo carries that call out (before 2.2 it raises "no support for _allgather_base")
    use_count: bool  # torch._C._storage_Use_Count exists, so a rebind can be proven safe
    gloo_empty: bool  # gloo gathers empty tensors (1.13.1 and 2.0.1 die of SIGFPE, under torch alone)
    cow: bool = False  # torch._lazy_clone is copy-on-write as memgather.cow probes it (an elided cat's snapshot)


# Measured on the wheels the package index serves (Python 3.11, CPU, gloo, 2 ranks).
MEASURED = {
    (1, 13): Facts("all_gather_into_tensor", gloo_single=False, use_count=False, gloo_empty=False),
    (2, 0): Facts("all_gather_into_tensor", gloo_single=False, use_count=False, gloo_empty=False),
    (2, 12): Facts("all_gather_into_tensor", gloo_single=True, use_count=True, gloo_empty=True, cow=True),
    (2, 13): Facts("all_gather_single", gloo_single=True, use_count=True, gloo_empty=True, cow=True),
    (2, 15): Facts("all_gather_single", gloo_single=True, use_count=True, gloo_empty=True, cow=True),
}
RELEASE = Version(torch.__version__).release[:2]
CURRENT: Optional[Facts] = MEASURED.get(RELEASE)
# torch.autograd.Function's setup_context (a forward without ctx) arrived in torch 2.0.
HAS_SETUP_CONTEXT = RELEASE >= (2, 0)


def gloo_gathers_empty_tensors() -> bool:
    """False where torch's own gloo all_gather of empty tensors kills the process (a pool with it)."""
    return CURRENT is None or CURRENT.gloo_empty


EMPTY_KILLS_GLOO = (f"torch {torch.__version__}'s gloo dies of SIGFPE gathering empty tensors, under torch alone; "
                    "test_releases compares that outcome in fresh processes")


# torch's no-op "fake" backend lets one process be a world of 2; it arrived after 2.0.
requires_fake_backend = pytest.mark.skipif(
    importlib.util.find_spec("torch.testing._internal.distributed.fake_pg") is None,
    reason="this torch has no fake backend (torch 2.0.1 and older), which lets one process be a world of 2",
)
