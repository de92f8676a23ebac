"""What memgather's own time per rewired call grows with: the number of ranks (one slot each).

    python benchmarks/overhead_by_world.py [--worlds 2,8,16,64] [--calls 2000]

For each world size, in a fresh process on torch's no-op ``fake`` backend (so the
collective itself costs nothing), a gather of fresh 4 KiB slots is timed under
torch's ``all_gather``, under ``memgather.all_gather`` (every call rewired:
``MEMGATHER_NCCL_MIN_BYTES=0``; planned in full, as every CUDA call is), from a
target's call site under ``patch()`` (its plan kept, as in a loop:
``memgather.engine.kept``) and as the torch calls a rebind makes, done by hand
(each slot's storage released, one flat buffer, each slot pointed into it, the
single-tensor call), taking turns for 7 rounds. It prints the medians; memgather's
excess over torch's list call, and the least-squares line excess = a + b x world that
the NCCL threshold's rule uses (``memgather.engine.routes``); and memgather's own
Python (its call less the rebind's torch calls), as a multiple of torch's list call in
the same process, with its own line own = a + b x world (b: what each further rank adds). memgather has no route for a
backend that moves nothing, so each process gives the fake backend legacy NCCL's, as
``benchmarks/overhead.py`` does (``treat_fake_as_legacy_nccl``): what is timed is
memgather's own Python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

ROOT = str(Path(__file__).resolve().parent.parent)

_ONE_WORLD = """
import json, statistics, sys, time
world, calls = int(sys.argv[1]), int(sys.argv[2])
sys.path.insert(0, sys.argv[3])  # the repository root, for memgather and benchmarks.overhead
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
import memgather
from benchmarks.overhead import treat_fake_as_legacy_nccl
treat_fake_as_legacy_nccl()  # memgather has no route for the fake backend: legacy NCCL's, in this process
tensor = torch.ones(1024)
single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
from benchmarks import user_code
park = torch.empty(0)
def by_hand(slots, tensor):
    user_code.rebind_by_hand(slots, tensor, single, park)
def run(gather):
    started = time.perf_counter()
    for _ in range(calls):
        gather([torch.empty_like(tensor) for _ in range(world)], tensor)
    return (time.perf_counter() - started) / calls * 1e6
# A call site of a target, through the wrapper: its plan kept from its first call on, as in a loop.
exec(compile("import torch.distributed as dist\\ndef gather(slots, tensor):\\n    dist.all_gather(slots, tensor)\\n",
             "<user>", "exec"), user := {"__name__": "user_code"})
def kept(slots, tensor):
    user["gather"](slots, tensor)
# A call site that makes its slots in the call, like the input (benchmarks/user_code.py): the kept
# plan's proof reads each slot only for who holds it (memgather.patching.proof.slots_like_input).
def made_like():
    started = time.perf_counter()
    for _ in range(calls):
        user_code.like_input(tensor, world)
    return (time.perf_counter() - started) / calls * 1e6
times = {"torch": [], "memgather": [], "by_hand": [], "kept": [], "made_like": []}
for _ in range(7):
    times["torch"].append(run(dist.all_gather))
    times["memgather"].append(run(memgather.all_gather))
    times["by_hand"].append(run(by_hand))
    memgather.patch(["user_code", "benchmarks.user_code"])
    times["kept"].append(run(kept))
    times["made_like"].append(made_like())
    memgather.unpatch()
assert memgather.stats().rewired == 3 * 7 * calls, memgather.stats()
print(json.dumps({name: statistics.median(values) for name, values in times.items()}))
"""


def measure(world: int, calls: int) -> Tuple[float, float, float, float, float]:
    """Median microseconds per call at ``world`` ranks: torch's, memgather's planned in full
    (``memgather.all_gather``, as every CUDA call is), the rebind's torch calls by hand, and
    memgather's from a target's call site through the wrapper, its plan kept (as in a loop):
    slots passed in, then slots made like the input in the call."""
    env = {**os.environ, "MEMGATHER_NCCL_MIN_BYTES": "0", "TORCH_DISTRIBUTED_DEBUG": "OFF"}
    done = subprocess.run(
        [sys.executable, "-c", _ONE_WORLD, str(world), str(calls), ROOT],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return row["torch"], row["memgather"], row["by_hand"], row["kept"], row["made_like"]


def fit(points: List[Tuple[int, float]]) -> Tuple[float, float]:
    """(a, b) of the least-squares line y = a + b x."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - b * mean_x, b


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/overhead_by_world.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--worlds", default="2,8,16,64", help="comma-separated world sizes (default 2,8,16,64)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (default 2000)")
    args = parser.parse_args(argv)
    points, own, own_kept, own_like = [], [], [], []
    print(
        "planned in full: memgather.all_gather (every CUDA call); kept: a target's call site, its plan kept "
        "(slots passed in); made like: the same, slots made like the input in the call"
    )
    print(
        f"{'ranks':>6} {'torch us':>10} {'memgather us':>13} {'excess us':>10} {'rebind by hand us':>18} "
        f"{'own us':>7} {'own / torch':>12} {'own kept us':>12} {'own kept / torch':>17} "
        f"{'own made like us':>17} {'made like / torch':>18}"
    )
    for world in (int(w) for w in args.worlds.split(",")):
        torchs, ours, by_hand, kept, like = measure(world, args.calls)
        points.append((world, ours - torchs))
        own.append((world, ours - by_hand))
        own_kept.append((world, kept - by_hand))
        own_like.append((world, like - by_hand))
        print(
            f"{world:>6} {torchs:>10.1f} {ours:>13.1f} {ours - torchs:>10.1f} {by_hand:>18.1f} "
            f"{ours - by_hand:>7.1f} {(ours - by_hand) / torchs:>11.2f}x {kept - by_hand:>12.1f} "
            f"{(kept - by_hand) / torchs:>16.2f}x {like - by_hand:>17.1f} {(like - by_hand) / torchs:>17.2f}x"
        )
    if len(points) > 1:
        a, b = fit(points)
        print(f"excess, planned in full ~= {a:.1f} us + {b:.2f} us x ranks")
        a, b = fit(own)
        print(f"memgather's own Python, planned in full ~= {a:.1f} us + {b:.2f} us x ranks")
        a, b = fit(own_kept)
        print(f"memgather's own Python, plan kept ~= {a:.1f} us + {b:.2f} us x ranks")
        a, b = fit(own_like)
        print(f"memgather's own Python, plan kept, slots made like the input ~= {a:.1f} us + {b:.2f} us x ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
