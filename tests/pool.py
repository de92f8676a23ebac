"""A pool of real gloo ranks, started once and fed many cases.

Each worker is a spawned process that joins a gloo process group of its
world size, then runs whatever function the test process names, with the same
arguments on every rank, and sends back its result. Starting torch in a
process costs seconds on two cores; a case costs milliseconds.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional


@dataclass
class RankError:
    """An exception raised on one rank, carried back as data."""

    type_name: str
    message: str
    traceback: str


class RankPool:
    """``world`` ranks in one gloo group; ``run(fn, ...)`` calls ``fn(ctx, ...)`` on all."""

    def __init__(self, world: int, timeout_s: float = 60.0, env: Optional[Dict[str, str]] = None) -> None:
        self.world = world
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self.closed = False
        self._conns = []
        self._procs = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, rank, world, port, dict(env or {})), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect(self.timeout_s * 2)  # every rank reports once joined

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: Optional[float] = None, **kwargs: Any) -> List[Any]:
        """Results of ``fn`` per rank; a rank's exception comes back as ``RankError``."""
        target = (fn.__module__, fn.__qualname__, args, kwargs)
        for conn in self._conns:
            conn.send(target)
        return self._collect(timeout_s or self.timeout_s)

    def close(self) -> None:
        self.closed = True
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)

    def _collect(self, timeout_s: float) -> List[Any]:
        results = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout_s):
                self.close()
                raise TimeoutError(f"rank {rank} of {self.world} sent nothing within {timeout_s} s")
            results.append(conn.recv())
        return results


@dataclass
class RankContext:
    """What a case function learns about where it runs."""

    rank: int
    world: int


def _serve(conn: Any, rank: int, world: int, port: int, env: Dict[str, str]) -> None:
    os.environ.update(env)  # before memgather reads its settings
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    conn.send("ready")
    ctx = RankContext(rank, world)
    while True:
        target = conn.recv()
        if target is None:
            break
        module, qualname, args, kwargs = target
        try:
            fn = _resolve(module, qualname)
            result: Any = fn(ctx, *args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - reported to the test process
            result = RankError(type(error).__name__, str(error), traceback.format_exc())
        conn.send(result)
    dist.destroy_process_group()
    conn.close()
    os._exit(0)


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def free_port() -> int:
    """A TCP port nobody listens on now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
