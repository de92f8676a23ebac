"""One rank of a multi-host job (tests/test_multihost.py), started by torchrun inside a simulated host.

``python -m torch.distributed.run --nnodes H --nproc_per_node P ... multihost_job.py OUT_DIR``:
joins gloo, gathers ``MEMGATHER_JOB_MIB`` MiB per rank through every caller pattern of
``memgather bench`` (memgather.tools.patterns), and writes ``OUT_DIR/rank<R>.json``: per
pattern, the SHA-256 of what the caller holds, the peak RSS growth and the seconds the
gather took (the slowest rank's, after a barrier; the median of ``MEMGATHER_JOB_REPEAT``
calls). Nothing here patches: MEMGATHER=1
through memgather's .pth decides, as in a user's job.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist


def _digest(value: Any) -> str:
    tensors = value if isinstance(value, list) else [value]
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _gather_on_own_host(numel: int) -> Dict[str, Any]:
    """One gather on a group of this host's ranks only (torchrun numbers a node's ranks
    consecutively): whether it is right, and the route memgather took."""
    import memgather

    own_host, _ = dist.new_subgroups(group_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    local, size = dist.get_rank(own_host), dist.get_world_size(own_host)
    before = dict(memgather.stats().by_route)
    slots = [torch.empty(numel) for _ in range(size)]
    memgather.all_gather(slots, torch.full((numel,), float(dist.get_rank())), group=own_host)
    first = dist.get_rank() - local
    correct = all(torch.equal(s, torch.full((numel,), float(first + i))) for i, s in enumerate(slots))
    after = memgather.stats().by_route
    return {"correct": correct, "routes": {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}}


def _measure(gather: Any, tensor: torch.Tensor, repeat: int, rss: Any) -> Dict[str, Any]:
    """The first call's result digest and peak growth (a multiple of the gathered size), and
    the median over ``repeat`` calls of the slowest rank's seconds."""
    seconds: List[float] = []
    for call in range(repeat):
        dist.barrier()
        if call == 0:
            rss.reset_peak()
            before = rss.current_bytes()
        start = time.perf_counter()
        held = gather(tensor)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if call == 0:
            growth = (rss.peak_bytes() - before) / (tensor.numel() * tensor.element_size() * dist.get_world_size())
            digest = _digest(held)
        del held
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        seconds.append(float(took))
    return {"sha256": digest, "growth": growth, "seconds": statistics.median(seconds)}


def main() -> None:
    from memgather.tools import patterns, rss

    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = int(float(os.environ.get("MEMGATHER_JOB_MIB", "4")) * (1 << 18))
    module = patterns.load()
    rss.track_allocations(True)  # freed blocks leave the resident set: each pattern's peak is its own
    result: Dict[str, Any] = {"world": world, "host": os.environ.get("GLOO_SOCKET_IFNAME", "")}
    repeat = int(os.environ.get("MEMGATHER_JOB_REPEAT", "1"))
    for pattern in patterns.PATTERNS:
        if pattern.name == "single_tensor":
            continue  # torch's own single-tensor call: nothing for memgather to rewire
        gather = getattr(module, pattern.name)
        gather(torch.ones(1024))  # first-call costs are not the gather's
        tensor = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
        result[pattern.name] = _measure(gather, tensor, repeat, rss)
    if os.environ.get("MEMGATHER") == "1":
        result["per_host_group"] = _gather_on_own_host(numel)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
