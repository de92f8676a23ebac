"""Whether a CUDA slot may be rebound: the decision, for every combination of the facts CUDA gives.

``cuda_memory.read`` is the only place that asks CUDA; ``refusal`` decides from
what it read, so the whole decision runs here without a GPU. The tests that need
one (the facts read from real CUDA memory, the rebind itself) are in
tests/test_cuda.py.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from typing import Optional

import pytest

from memgather import cuda_watch
from memgather.engine import cuda_memory
from memgather.engine.cuda_memory import SlotFacts
from memgather.engine.strategies import Reason

ALLOCATORS = ("native", "cudaMallocAsync", "pluggable", "an allocator not known yet")
VERSIONS = (None, 0, 1, 7)


@pytest.mark.parametrize("standard,allocator,capturing,version,graphs,lent", list(itertools.product(
    (True, False), ALLOCATORS, (True, False), VERSIONS, (True, False), (True, False))))
def test_every_combination(standard: bool, allocator: str, capturing: bool, version: Optional[int], graphs: bool,
                           lent: bool) -> None:
    """Rebound only when all hold: torch's own allocator made it, frees are stream-ordered, nothing is
    capturing and no graph was ever captured here, the slot was not lent out, and nothing wrote it
    since it was made. Capture is told first (nothing may be freed then), then graphs, then the
    memory, then its history."""
    facts = SlotFacts(standard, allocator, capturing, version, graphs, lent)
    if capturing:
        expected: Optional[Reason] = Reason.GRAPH_CAPTURE
    elif graphs:
        expected = Reason.CUDA_GRAPHS
    elif not standard or allocator not in ("native", "cudaMallocAsync") or lent:
        expected = Reason.SLOT_MEMORY
    elif version != 0:
        expected = Reason.SLOT_WRITTEN
    else:
        expected = None
    assert cuda_memory.refusal(facts) is expected


@pytest.mark.parametrize("facts,expected", [
    (SlotFacts(True, "native", False, 0), None),  # torch.empty_like on the default allocator
    (SlotFacts(True, "cudaMallocAsync", False, 0), None),  # cudaFreeAsync honours record_stream too
    (SlotFacts(True, "pluggable", False, 0), Reason.SLOT_MEMORY),  # frees at once, no stream semantics
    (SlotFacts(False, "native", False, 0), Reason.SLOT_MEMORY),  # DLPack import, IPC handle, symmetric memory
    (SlotFacts(True, "native", False, 1), Reason.SLOT_WRITTEN),  # zeros_like's fill is a factory's: 0; copy_ is not
    (SlotFacts(True, "native", False, None), Reason.SLOT_WRITTEN),  # an inference tensor: no version to show
    (SlotFacts(True, "native", True, 0), Reason.GRAPH_CAPTURE),
    (SlotFacts(True, "native", False, 0, graphs_captured=True), Reason.CUDA_GRAPHS),  # a graph may replay into it
    (SlotFacts(True, "native", False, 0, lent=True), Reason.SLOT_MEMORY),  # CuPy / Numba hold it
])
def test_named_cases(facts: SlotFacts, expected: Optional[Reason]) -> None:
    assert cuda_memory.refusal(facts) is expected


def test_release_leaves_cpu_slots_alone() -> None:
    """Recording a stream is for CUDA blocks only: a CPU slot list goes through untouched."""
    import torch

    slots = [torch.ones(3), torch.ones(3)]
    versions = [slot._version for slot in slots]
    cuda_memory.release_on_current_stream(slots)
    assert [slot._version for slot in slots] == versions
    assert all(torch.equal(slot, torch.ones(3)) for slot in slots)


def test_a_graph_counts_from_its_capture_until_it_is_freed_or_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks on capture_begin and reset note a graph before its capture begins (a capture that
    cannot begin still raises, as torch's does) and forget it when it is reset or freed."""
    monkeypatch.setattr(cuda_watch, "_graphs", {})

    class Graph:
        def capture_begin(self, pool: object = None) -> None:
            raise RuntimeError("no CUDA here")

        def reset(self) -> None:
            pass

    cuda_watch._hook(Graph, "capture_begin", cuda_watch._noting_capture)
    cuda_watch._hook(Graph, "reset", cuda_watch._noting_reset)
    cuda_watch._hook(Graph, "capture_begin", cuda_watch._noting_capture)  # idempotent
    assert Graph.capture_begin.__wrapped__.__name__ == "capture_begin"
    assert not hasattr(Graph.capture_begin.__wrapped__, "_memgather_hook")
    first, second = Graph(), Graph()
    for graph in (first, second):
        with pytest.raises(RuntimeError, match="no CUDA here"):
            graph.capture_begin(pool=None)
    assert cuda_watch.graphs_alive()
    del graph
    first.reset()
    assert cuda_watch.graphs_alive()
    del second
    assert not cuda_watch.graphs_alive()


def test_the_hooks_are_installed_and_torch_behaves_as_before() -> None:
    import torch

    assert torch.cuda.CUDAGraph.capture_begin.__name__ == "capture_begin"
    assert torch.cuda.CUDAGraph.capture_begin.__wrapped__ is not None
    hooked = torch.Tensor.__dict__["__cuda_array_interface__"]
    assert hooked.fget.__wrapped__ is not None and hooked.__doc__ == hooked.fget.__wrapped__.__doc__
    assert hooked.fget.__name__ == "__cuda_array_interface__"
    cpu = torch.ones(2)
    with pytest.raises(AttributeError, match="non-CUDA tensor"):
        cpu.__cuda_array_interface__
    assert not hasattr(cpu, "__cuda_array_interface__")  # as numba and cupy probe it
    assert id(cpu) not in cuda_watch._lent


def test_a_loan_is_noted_and_forgotten_with_its_tensor() -> None:
    import torch

    interface = cuda_watch._noting_loan(lambda tensor: {"data": (tensor.data_ptr(), False)})
    tensor = torch.ones(2)
    key = id(tensor)
    assert interface(tensor)["data"][0] == tensor.data_ptr()
    assert key in cuda_watch._lent
    del tensor
    assert key not in cuda_watch._lent


_IMPORTS = """
import sys
{imports}
hook = torch.cuda.CUDAGraph.__dict__["capture_begin"]
engine = "memgather.engine.cuda_memory" in sys.modules
alive = sys.modules["memgather.cuda_watch"].graphs_alive() if "memgather.cuda_watch" in sys.modules else None
print(json.dumps([hasattr(hook, "_memgather_hook"), engine, alive]))
"""


def _after(imports: str, memgather: str = "") -> list:
    code = "import json\n" + _IMPORTS.format(imports=imports)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEMGATHER": memgather})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("imports", ["import torch\nimport memgather", "import memgather\nimport torch",
                                     "import memgather.errors\nimport torch", "from memgather.engine import core\nimport torch"])
def test_import_memgather_installs_the_hooks_before_any_capture(imports: str) -> None:
    """A capture made before the hooks exist is never seen: any import of memgather installs them, at
    once where torch is imported, else when torch's import ends, without the engine."""
    hooked, engine_imported, alive = _after(imports)
    assert hooked and alive is False
    assert engine_imported == imports.startswith("from memgather.engine")


def test_the_kill_switch_leaves_torch_alone() -> None:
    """With MEMGATHER=0 importing memgather wraps nothing of torch's (and so rules no graph out)."""
    assert _after("import torch\nimport memgather", memgather="0") == [False, False, True]
    assert _after("import memgather\nimport torch", memgather="0") == [False, False, True]


def test_memgather_imported_while_torch_imports_defers_the_hooks() -> None:
    """Imported from another hook while torch is half imported: nothing is installed then (torch
    cannot take torch.distributed's import yet), and torch's import ends normally."""
    code = ("import wrapt\n"
            "def hook(module):\n    import memgather\n"
            "wrapt.register_post_import_hook(hook, 'torch.cuda')\n"
            "import torch, sys\n"
            "print('memgather.cuda_watch' in sys.modules, torch.ones(2).sum().item())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEMGATHER": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "2.0"]


def test_cuda_in_use_before_the_hooks_counts_as_a_graph_alive() -> None:
    """Where CUDA was initialised before memgather was imported, a graph may have been captured
    unseen: one is counted alive for the rest of the process, so no CUDA slot is rebound."""
    _, _, alive = _after("import torch\ntorch.cuda.is_initialized = lambda: True\nimport memgather")
    assert alive
    facts = SlotFacts(True, "native", False, 0, cuda_watch.graphs_alive(), False)
    assert cuda_memory.refusal(facts) is None  # this process: CUDA was not in use at the import
    assert cuda_memory.refusal(facts._replace(graphs_captured=True)) is Reason.CUDA_GRAPHS


@pytest.mark.parametrize("value", ["0", "off", "false", "no"])
def test_no_kill_switch_value_wraps_torch_even_when_the_engine_is_imported(value: str) -> None:
    """Every false value of MEMGATHER (the .pth loads the patcher for some of them, and so the
    engine): nothing of torch's is wrapped, and no CUDA slot may be rebound."""
    hooked, _, alive = _after("import torch\nimport memgather\nfrom memgather.engine import core", memgather=value)
    assert not hooked and alive is True


_RACE = """
import importlib, json, sys, threading
seen = {}
def load(name):
    try:
        importlib.import_module(name)
        seen[name] = "ok"
    except BaseException as error:
        seen[name] = repr(error)
threads = [threading.Thread(target=load, args=(name,)) for name in ("memgather.engine.core", "memgather.cuda_watch")]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(60)
print(json.dumps(seen))
"""


def test_threads_importing_the_engine_and_the_hooks_at_once_both_finish() -> None:
    """The hooks' import runs inside torch's (a post-import hook) on one thread while another
    thread imports the engine: neither may fail, and torch's import may not either."""
    for _ in range(4):
        done = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "MEMGATHER": ""})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {
            "memgather.engine.core": "ok", "memgather.cuda_watch": "ok"}, done.stdout
