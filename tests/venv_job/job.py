"""A 2-process gloo job run inside a throwaway virtual environment by test_pth.py.

It never patches by itself (unless CALL_PATCH=1): memgather must switch on
through memgather.pth and MEMGATHER=1, in the spawned workers too.
"""

import json
import os
import socket
import sys

import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import memgather

    if os.environ.get("CALL_PATCH") == "1":
        memgather.patch()
    import mgtarget
    import notatarget

    result = {"patched": memgather.is_patched(), "memgather_file": memgather.__file__}
    for name, module in (("target", mgtarget), ("other", notatarget)):
        memgather.reset_stats()
        # 4 MiB per rank: above the 2 MiB under which memgather leaves gloo calls to torch
        slots = module.gather(torch.full((1 << 20,), float(rank)))
        result[name] = memgather.stats().rewired
        result[name + "_correct"] = all(torch.equal(s, torch.full((1 << 20,), float(r))) for r, s in enumerate(slots))
    dist.destroy_process_group()
    queue.put((rank, result))
    queue.close()
    queue.join_thread()


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
    print(json.dumps([results[0], results[1]]))
    sys.exit(0)
