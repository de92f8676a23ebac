"""A 2-process gloo job that memgather joins only through memgather.pth.

It never patches by itself (unless CALL_PATCH=1): memgather must switch on
through memgather.pth and MEMGATHER=1, in the spawned workers too. test_pth.py
runs it in a throwaway virtual environment; with GROWTH_MIB set, test_releases.py
runs it in the current one to measure one gather of that many MiB per rank.
"""

import json
import os
import socket
import sys
import traceback

import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, queue) -> None:
    try:
        result = run(rank, world, port)
    except BaseException:  # reported, so that the job fails at once instead of waiting for this rank
        result = {"error": traceback.format_exc()}
    queue.put((rank, result))
    queue.close()
    queue.join_thread()


def run(rank: int, world: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import memgather

    if os.environ.get("CALL_PATCH") == "1":
        memgather.patch()
    import mgtarget
    import notatarget

    result = {"patched": memgather.is_patched(), "memgather_file": memgather.__file__}
    if os.environ.get("GROWTH_MIB"):
        result.update(growth(rank, world, int(os.environ["GROWTH_MIB"]), mgtarget.gather, notatarget.gather))
        return result
    for name, module in (("target", mgtarget), ("other", notatarget)):
        memgather.reset_stats()
        # 4 MiB per rank: above the 2 MiB under which memgather leaves gloo calls to torch
        slots = module.gather(torch.full((1 << 20,), float(rank)))
        result[name] = memgather.stats().rewired
        result[name + "_correct"] = all(torch.equal(s, torch.full((1 << 20,), float(r))) for r, s in enumerate(slots))
    dist.destroy_process_group()
    return result


def growth(rank: int, world: int, mib: int, rewired, unpatched) -> dict:
    """Peak RSS growth of one gather of fresh slots, as a multiple of the gathered size,
    through a target module and through another one; and whether their results are identical."""
    import gc

    import torch
    import torch.distributed as dist

    import memgather
    from memgather.tools import rss

    t = torch.rand(mib << 18, generator=torch.Generator().manual_seed(rank))
    gathered = world * t.numel() * t.element_size()
    result, kept = {}, {}
    for name, gather in (("torch", unpatched), ("memgather", rewired)):
        gc.collect()
        dist.barrier()
        memgather.reset_stats()
        rss.reset_peak()
        before = rss.current_bytes()
        kept[name] = [s.view(torch.uint8) for s in gather(t)]
        result[name] = (rss.peak_bytes() - before) / gathered
        # Kept for the comparison: already resident, they add nothing to the next call's growth.
        result[name + "_stats"] = {"strategy": dict(memgather.stats().by_strategy), "route": dict(memgather.stats().by_route)}
    result["identical"] = all(torch.equal(a, b) for a, b in zip(kept["torch"], kept["memgather"]))
    result["primitive"] = memgather.primitive().name
    result["torch_version"] = torch.__version__
    return result


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, 2, port, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    failed = [results[rank]["error"] for rank in sorted(results) if "error" in results[rank]]
    print("\n".join(failed), file=sys.stderr)
    print(json.dumps([results[0], results[1]]))
    sys.exit(1 if failed else 0)
