"""Jobs that exit without ``destroy_process_group``: the study's and the test's.

``python tests/exits_job.py`` is the ``plain`` job of ``python -m tests.exits``,
run under torchrun (2 ranks). Each rank joins a gloo group from torchrun's
environment, gathers 2 MiB per rank through each list-of-slots pattern of
memgather's benchmark (``memgather.tools.patterns``, module
``memgather_bench_patterns``; memgather rewires them when ``MEMGATHER=1`` and
``MEMGATHER_TARGETS=memgather_bench_patterns``), checks every gathered piece,
prints ``[exits-job rank R] done ...`` and returns **without calling**
``dist.destroy_process_group()``: the interpreter's own teardown ends the
process, as it does in a user's script that forgets the call. With
``EXITS_JOB_DESTROY=1`` it calls ``dist.destroy_process_group()`` before its
line (the workaround).

``python tests/exits_job.py teardown`` is tests/test_exits.py's probe (env://
from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no torchrun): see
``teardown_probe``.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
import weakref

MIB_PER_RANK = 2
ROUNDS = 2
LIST_PATTERNS = ("empty_like_cat", "clone_cat", "ones_like_cat", "zeros_like_list", "views_in_place")


def main() -> None:
    import torch
    import torch.distributed as dist

    from memgather.tools import patterns

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    module = patterns.load()
    numel = MIB_PER_RANK * (1 << 20) // 4  # float32
    checked = 0
    for round_ in range(ROUNDS):
        for name in LIST_PATTERNS:
            mine = torch.full((numel,), float(rank * 100 + round_))
            got = getattr(module, name)(mine)
            pieces = list(got) if isinstance(got, list) else list(got.view(world, numel).unbind(0))
            for peer, piece in enumerate(pieces):
                if not torch.equal(piece, torch.full((numel,), float(peer * 100 + round_))):
                    raise AssertionError(f"rank {rank}: {name} round {round_}: piece {peer} is wrong")
            checked += 1
    if os.environ.get("EXITS_JOB_DESTROY") == "1":
        dist.destroy_process_group()
    print(f"[exits-job rank {rank}] done: {checked} gathers of {MIB_PER_RANK} MiB per rank checked", flush=True)


def teardown_probe() -> None:
    """What memgather leaves behind for teardown, on 2 ranks run with ``MEMGATHER=1``.

    Both ranks rewire gathers (the benchmark patterns on the default group,
    ``memgather.all_gather`` on a ``new_group``), destroy the new group and check
    that its weak reference is dead after ``gc.collect()``. Rank 1 then destroys
    the default group, checks the same of it, and exits: memgather's exit report
    runs with no group left. Rank 0 keeps its default group, waits until the
    file named by ``EXITS_PROBE_PEER_GONE`` exists (the test creates it once rank 1
    has exited) and exits without ``destroy_process_group``: memgather's exit
    report runs with its peer gone. An exit handler registered before torch is
    imported (so it runs after memgather's) writes how many collectives the
    default group saw after the probe's own work: any collective memgather made at
    exit would count there (or fail, its peer being gone).
    """
    state: dict = {"rank": int(os.environ["RANK"]), "seq": None, "group": None}

    def after_everything() -> None:  # registered first: runs last, after memgather's report
        group = state["group"]() if state["group"] is not None else None
        later = None if group is None or state["seq"] is None else group._get_sequence_number_for_group() - state["seq"]
        print(f"[exits-probe rank {state['rank']}] collectives at exit: {later}", flush=True)

    atexit.register(after_everything)

    import torch
    import torch.distributed as dist

    import memgather
    from memgather.engine import groups
    from memgather.tools import patterns

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = patterns.load()
    for name in LIST_PATTERNS:
        module.__dict__[name](torch.full((1024,), float(rank)))
    sub = dist.new_group(backend="gloo")
    out = [torch.empty(1024) for _ in range(world)]
    memgather.all_gather(out, torch.full((1024,), float(rank)), group=sub)
    result = {"rank": rank, "patched": memgather.is_patched(), "rewired": memgather.stats().rewired,
              "sub_described": groups.known(sub) is not None,
              "gathered": all(torch.equal(o, torch.full((1024,), float(r))) for r, o in enumerate(out))}
    sub_ref = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    result["sub_dead"] = sub_ref() is None
    world_group = dist.distributed_c10d._get_default_group()
    if rank == 1:
        world_ref = weakref.ref(world_group)
        del world_group
        dist.destroy_process_group()
        gc.collect()
        result["world_dead"] = world_ref() is None
        print("[exits-probe] " + json.dumps(result), flush=True)
        return
    state["group"] = weakref.ref(world_group)
    state["seq"] = result["seq"] = world_group._get_sequence_number_for_group()
    print("[exits-probe] " + json.dumps(result), flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["EXITS_PROBE_PEER_GONE"]):
        if time.monotonic() > deadline:
            raise SystemExit("rank 1 did not leave within 120 s")
        time.sleep(0.05)
    # world_group stays alive (module global of torch.distributed): exit with the group, its peer gone


if __name__ == "__main__":
    teardown_probe() if sys.argv[1:] == ["teardown"] else main()
