"""A 2-rank gloo job in which rank 1 fails one way or another (run by test_faults.py).

Not a pool: a dead rank takes its process group with it, so every scenario
gets fresh processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queues
import signal
import time
from datetime import timedelta
from typing import Any, Dict


def rank_main(rank: int, port: int, scenario: str, numel: int, async_op: bool, timeout_s: float, queue: Any) -> None:
    os.environ["MEMGATHER_GLOO_MIN_BYTES"] = "0"  # every size rewired
    import torch
    import torch.distributed as dist

    import memgather
    from tests.ranks import storage_bytes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
    dist.barrier()
    if rank == 1:
        if scenario == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        queue.put((rank, {"waited": True}))  # "absent": alive, but never joins the gather
        _close(queue)
        time.sleep(timeout_s * 4)  # outlives the survivor's timeout; the test reaps it
        os._exit(0)
    slots = [torch.zeros(numel) for _ in range(2)]
    ids = [id(s) for s in slots]
    started = time.monotonic()
    result: Dict[str, Any] = {}
    try:
        work = memgather.all_gather(slots, torch.ones(numel), async_op=async_op)
        if work is not None:
            work.wait()
        result["raised"] = None
    except Exception as error:  # noqa: BLE001 - the outcome is the point
        result["raised"] = type(error).__name__
    result["elapsed"] = time.monotonic() - started
    result["identity_kept"] = [id(s) for s in slots] == ids
    result["shapes"] = [list(s.shape) for s in slots]
    # Every byte of every slot can be read: its storage is allocated and large enough.
    result["readable"] = all(storage_bytes(s) >= s.numel() * s.element_size() for s in slots) and all(
        s.clone().numel() == numel for s in slots
    )
    result["strategy"] = dict(memgather.stats().by_strategy)
    queue.put((rank, result))
    _close(queue)
    dist.destroy_process_group()  # a clean shutdown despite the broken group: the test checks the exit code


def _close(queue: Any) -> None:
    queue.close()
    queue.join_thread()


def uneven_main(rank: int, port: int, mode: str, kind: str, queue: Any) -> None:
    """Ranks disagree on shape or dtype, check off (or pass empty tensors): torch's outcome or memgather's, as data."""
    import hashlib

    import torch
    import torch.distributed as dist

    import memgather

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=10))
    shape = (1 << 19, 2)  # 4 MiB of float32 per rank: memgather's broadcast route
    dtype = torch.float32
    if rank == 1 and kind == "first-dim":
        shape = ((1 << 19) + 1, 2)
    elif rank == 1 and kind == "trailing-dim":
        shape = (1 << 19, 3)
    elif rank == 1 and kind == "dtype":
        dtype = torch.int32  # same bytes, other dtype: torch passes the bytes through
    elif kind == "empty":  # every rank: even, but gloo before 2.1 divides by zero on it
        shape = (0, 2)
    slots = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    gather = memgather.all_gather if mode == "memgather" else dist.all_gather
    try:
        gather(slots, torch.ones(shape, dtype=dtype))
        digest = hashlib.sha256(b"".join(s.contiguous().view(torch.uint8).numpy().tobytes() for s in slots)).hexdigest()
        outcome = f"ok {digest}"
    except Exception as error:  # noqa: BLE001
        outcome = f"raised {type(error).__name__}"
    queue.put((rank, outcome))
    _close(queue)
    os._exit(0)


def pair_outcomes(mode: str, kind: str) -> Dict[int, Any]:
    """Each rank's outcome of uneven_main in a fresh pair of processes: its report, or how its process ended."""
    from tests.pool import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=uneven_main, args=(rank, port, mode, kind, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    outcomes: Dict[int, Any] = {}
    while True:
        try:
            rank, outcome = results.get(timeout=1)
        except queues.Empty:
            break
        outcomes[rank] = outcome
    for rank, proc in enumerate(procs):
        outcomes.setdefault(rank, f"exited {proc.exitcode}")
    return outcomes
