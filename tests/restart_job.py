"""Jobs whose process groups end and begin again (tests/test_restarts.py).

Nothing here patches: MEMGATHER=1 through memgather's .pth decides, as in a
user's job. Every gather goes through a caller pattern of ``memgather bench``
(memgather.tools.patterns, a target when MEMGATHER_TARGETS=memgather_bench_patterns),
4 MiB per rank so that gloo calls are rewired at memgather's default threshold.
Each rank's input is a known function of (rank, phase, call), so every rank can
compute what the gather must give.

``python -m torch.distributed.run ... --max-restarts 1 restart_job.py torchrun OUT``:
attempt 0 gathers, writes ``OUT/attempt0_rank<R>.json``, then rank 1 SIGKILLs
itself while rank 0 is in one more gather; attempt 1 (the restart) gathers
again and writes ``OUT/attempt1_rank<R>.json``.

``python restart_job.py reinit OUT INDEX PORT_A PORT_B``, for INDEX 0, 1, 2: a
world of 3 on PORT_A gathers, destroys its group; then processes 2 and 1 init a
world of 2 on PORT_B as ranks 0 and 1 (the ranks change), gather again and
destroy; each writes ``OUT/reinit<INDEX>.json``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import sys
import time
import weakref
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist

NUMEL = 1 << 19  # int64: 4 MiB per rank, above gloo's 2 MiB rewiring threshold
ATTEMPT_PATTERNS = {  # a different number of calls per attempt tells their report lines apart
    0: ("empty_like_cat", "zeros_like_list", "views_in_place"),
    1: ("empty_like_cat", "clone_cat", "ones_like_cat", "zeros_like_list", "views_in_place"),
}
PHASE_PATTERNS = {
    "a": ("empty_like_cat", "zeros_like_list"),
    "b": ("views_in_place", "empty_like_cat", "zeros_like_list"),
}
# Phase b: the process of index 2 becomes rank 0, index 1 stays rank 1, index 0 has left.
PHASE_B_RANK = {2: 0, 1: 1}


def rank_input(rank: int, phase: int, call: int) -> torch.Tensor:
    """What ``rank`` gathers in ``call`` of ``phase``: distinct per element, rank, phase and call."""
    return torch.arange(NUMEL, dtype=torch.int64) + (rank + 1) * 10**7 + phase * 10**9 + call * 10**11


def expected_digest(world: int, phase: int, call: int) -> str:
    """SHA-256 of every rank's input in rank order: what a correct gather holds."""
    return digest([rank_input(rank, phase, call) for rank in range(world)])


def digest(value: Any) -> str:
    """SHA-256 of a tensor's bytes, or of a list's tensors one after the other (a list and
    its concatenation along dim 0 digest alike)."""
    sha = hashlib.sha256()
    for tensor in value if isinstance(value, list) else [value]:
        sha.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def gather_all(names: List[str], rank: int, world: int, phase: int) -> List[Dict[str, Any]]:
    """Each pattern's gather, and whether what the caller holds is every rank's input."""
    from memgather.tools import patterns

    module = patterns.load()
    results = []
    for call, name in enumerate(names):
        held = getattr(module, name)(rank_input(rank, phase, call))
        results.append({"pattern": name, "correct": digest(held) == expected_digest(world, phase, call)})
    return results


def memgather_state() -> Dict[str, Any]:
    """Whether memgather is on in this process, how it got there, its counters and its group cache."""
    import memgather
    from memgather.engine import groups

    stats = memgather.stats()
    world = dist.group.WORLD if dist.is_initialized() else None
    entries = [(ref(), info) for ref, info in groups._known.values()]
    return {
        "patched": memgather.is_patched(),
        "through_pth": "memgather.patching.autoload" in sys.modules,  # the .pth's hook, not the job, patched
        "wrapper": type(dist.all_gather).__name__,
        "calls": stats.calls,
        "rewired": stats.rewired,
        "strategies": dict(stats.by_strategy),
        "cache_entries": len(entries),
        "cache_live": [list(info) for pg, info in entries if pg is not None],
        "cache_live_other": sum(1 for pg, _ in entries if pg is not None and pg is not world),
        "known_world": list(groups.known(None)) if world is not None and groups.known(None) else None,
    }


def write(path: str, record: Dict[str, Any]) -> None:
    """Written whole under a temporary name, then renamed: a reader never sees half a file."""
    with open(path + ".tmp", "w") as out:
        json.dump(record, out)
    os.replace(path + ".tmp", path)


def _wait_for(path: str, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} did not appear within {limit_s} s")
        time.sleep(0.02)


def torchrun_main(out_dir: str) -> None:
    """One worker of one attempt of the torchrun job."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    record: Dict[str, Any] = {"attempt": attempt, "pid": os.getpid(), "rank": rank, "world": world,
                              "before": memgather_state()}
    record["results"] = gather_all(list(ATTEMPT_PATTERNS[attempt]), rank, world, attempt)
    record["after"] = memgather_state()
    write(os.path.join(out_dir, f"attempt{attempt}_rank{rank}.json"), record)
    if attempt == 0:
        if rank == 1:
            # Rank 0's file first: once a worker dies, the agent stops the others at once. A file,
            # not dist.barrier(): under TORCH_DISTRIBUTED_DEBUG=DETAIL rank 1 was seen to leave the
            # barrier only when rank 0's next collective timed out (30 s), torch alone too.
            _wait_for(os.path.join(out_dir, "attempt0_rank0.json"))
            os.kill(os.getpid(), signal.SIGKILL)  # mid-job: no atexit, no clean shutdown
        # Rank 0 is mid-job too: a gather its dead peer never joins. It raises, or the agent stops it.
        gather_all(list(ATTEMPT_PATTERNS[attempt]), rank, world, attempt)
        sys.exit("attempt 0 must not finish")
    dist.destroy_process_group()


def reinit_main(out_dir: str, index: int, port_a: int, port_b: int) -> None:
    """One process of the destroy-then-init job; see the module's docstring."""
    memgather_on = os.environ.get("MEMGATHER", "") not in ("", "0")
    record: Dict[str, Any] = {"index": index}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port_a}", rank=index, world_size=3,
                            timeout=timedelta(seconds=30))
    record["a"] = {"results": gather_all(list(PHASE_PATTERNS["a"]), index, 3, 0)}
    if memgather_on:
        record["a"]["state"] = memgather_state()
    old = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    record["old_group_dead"] = old() is None  # nothing (memgather included) keeps the destroyed group alive
    if memgather_on:
        record["after_destroy"] = memgather_state()
    if index in PHASE_B_RANK:
        rank = PHASE_B_RANK[index]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port_b}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        phase: Dict[str, Any] = {"rank": rank}
        if memgather_on:
            phase["before"] = memgather_state()  # the new group, not yet gathered on
        phase["results"] = gather_all(list(PHASE_PATTERNS["b"]), rank, 2, 1)
        if memgather_on:
            phase["state"] = memgather_state()
        record["b"] = phase
        dist.destroy_process_group()
    write(os.path.join(out_dir, f"reinit{index}.json"), record)


if __name__ == "__main__":
    # Bounded whatever happens to the test that started it: torchrun's workers live in sessions
    # of their own, out of reach of a kill of the launcher's process group.
    signal.alarm(int(os.environ.get("RESTART_JOB_LIMIT_S", "120")))
    torch.set_num_threads(1)
    if sys.argv[1] == "torchrun":
        torchrun_main(sys.argv[2])
    else:
        reinit_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
