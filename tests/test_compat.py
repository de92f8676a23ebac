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


# Two ranks of torch's multi-threaded process group (as DTensor's and FSDP's unit tests run), the
# gather's caller a target: torch puts a world of its own class in distributed_c10d._world, which
# has the default group and the coalescing state as properties only.
_THREADED = """
import os, threading
import torch, torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg
import memgather
exec(compile("import torch.distributed as dist\\ndef site(slots, t, **kw):\\n    dist.all_gather(slots, t, **kw)\\n",
             "<user>", "exec"), user := {"__name__": "user_code"})
if PATCHED:
    memgather.patch(["user_code"])
torch._C._distributed_c10d._set_thread_isolation_mode(True)
multi_threaded_pg._install_threaded_pg()
store, results = dist.HashStore(), {}

def rank_body(rank):
    try:
        dist.init_process_group("threaded", rank=rank, world_size=2, store=store)
        for group in (None, dist.group.WORLD):
            slots = [torch.zeros(4) for _ in range(2)]
            user["site"](slots, torch.arange(4.0) + 10 * rank, group=group)
            results.setdefault(rank, []).append([s.tolist() for s in slots])
    except Exception as error:
        results[rank] = f"{type(error).__name__}: {error}"

threads = [threading.Thread(target=rank_body, args=(rank,)) for rank in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(60)
print(sorted(results.items()))
os._exit(0)  # (the threaded group's threads are not torn down)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="torch's threaded process group: tested on Linux")
def test_a_patched_call_on_torchs_threaded_process_group_gives_torchs_result() -> None:
    def run(patched: bool) -> str:
        done = subprocess.run([sys.executable, "-c", _THREADED.replace("PATCHED", str(patched))],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    expected = run(False)
    assert "10.0" in expected and "Error" not in expected, expected
    assert run(True) == expected
