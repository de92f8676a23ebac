"""Which host this process runs on, as a number every rank can compare.

Across hosts gloo's broadcasts cross the host boundary several times per
gather, so the ranks of a group need to know whether they share one host. No
launcher tells it alike (torchrun's ``GROUP_WORLD_SIZE`` counts nodes of the
whole job, not of one group; Slurm, MPI and DeepSpeed's launcher say other
things, or nothing), so each rank puts this key in the agreement row
(``memgather.engine.agreement``) and every rank reads the same answer from the same
table.

The key is the kernel's boot id with the inode of the network namespace:
processes of one machine share the first, and only those that share a
network stack (and so talk over loopback) share the second. Containers of one
machine with network stacks of their own count as hosts of their own; their
traffic crosses a virtual link too. Where ``/proc`` has neither (not Linux),
the host name stands in.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import List, Optional

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_NET_NAMESPACE = "/proc/self/ns/net"

_key: Optional[int] = None


def key() -> int:
    """This process's host key: a non-negative int64, the same for every process of one host."""
    global _key
    if _key is None:
        _key = _compute()
    return _key


def _compute() -> int:
    parts: List[str] = []
    try:
        with open(_BOOT_ID) as boot:
            parts.append(boot.read().strip())
        parts.append(str(os.stat(_NET_NAMESPACE).st_ino))
    except OSError:
        parts = [socket.gethostname()]
    # Not hash(): string hashes differ between processes (PYTHONHASHSEED).
    digest = hashlib.sha256("\0".join(parts).encode()).digest()
    return int.from_bytes(digest[:7], "big")
