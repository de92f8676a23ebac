"""memgather.compat: what it measures of this torch at import, whatever mode the importer is in."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# memgather.compat imported in a fresh interpreter: its calibrations, and the operations a
# recording dispatch mode around the import saw (MODE: none, a recording mode, FakeTensorMode).
_IMPORT = """
import torch
from torch.utils._python_dispatch import TorchDispatchMode

seen = []

class Recording(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return func(*args, **(kwargs or {}))

def mode():
    if "MODE" == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode
        return FakeTensorMode()
    return Recording() if "MODE" == "recording" else torch.inference_mode(False)

with mode():
    from memgather import compat
print(compat._SOLE_HOLDER_COUNTS, compat._set_versions is not None, seen)
"""


def _imported(mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_IMPORT).replace("MODE", mode)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("mode", ["recording", "fake"])
def test_an_import_inside_a_dispatch_mode_measures_what_one_outside_does(mode: str) -> None:
    outside = _imported("none")
    assert outside.endswith("[]")
    assert _imported(mode) == outside  # the same counts, and the mode saw none of memgather's probes
