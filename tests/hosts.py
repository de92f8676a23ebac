"""Simulated hosts on one machine: Linux network namespaces joined by a bridge, links shaped by ``tc``.

``simulated_hosts(n, rate=...)`` creates a "switch" namespace holding a bridge
and ``n`` host namespaces, each joined to the bridge by a veth pair and given an
address in a private /24 that exists only inside these namespaces. With
``rate`` set, each host's link is shaped with ``tbf`` in both directions (rate
only: ``netem`` is not used, so latency is not simulated). Commands run in a host with
``Hosts.command(i, ...)`` (``ip netns exec``). Everything is removed on every
exit path, namespaces first (which takes their veths along).

It needs root and the ``ip`` and ``tc`` tools; ``unavailable()`` says why not,
for a test to skip with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional

_TIMEOUT_S = 20


@dataclass(frozen=True)
class Hosts:
    """The namespaces one ``simulated_hosts`` made: host ``i`` is ``names[i]`` at ``addresses[i]``."""

    names: List[str]
    addresses: List[str]
    interface: str  # each host's own end of its link (GLOO_SOCKET_IFNAME)

    def command(self, host: int, argv: List[str]) -> List[str]:
        """``argv`` as run inside host ``host``."""
        return ["ip", "netns", "exec", self.names[host], *argv]


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "simulating hosts needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"simulating hosts needs the {tool!r} tool"
    probe = f"mgprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=_TIMEOUT_S).returncode != 0:
        return "this machine does not let even root create a network namespace"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_TIMEOUT_S)
    return None


@contextmanager
def simulated_hosts(count: int, rate: Optional[str] = None) -> Iterator[Hosts]:
    """``count`` hosts on one bridge; ``rate`` (``tc`` syntax, e.g. "1gbit") shapes every link."""
    tag = f"{os.getpid() % 100000}"
    switch = f"mgsw{tag}"
    names = [f"mgh{i}x{tag}" for i in range(count)]
    subnet = f"10.{77 + os.getpid() % 100}.{os.getpid() % 250}"
    addresses = [f"{subnet}.{i + 1}" for i in range(count)]
    made: List[str] = []
    try:
        for name in (switch, *names):
            _ip("netns", "add", name)
            made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(names, addresses)):
            _ip("link", "add", f"mgv{tag}h{i}", "type", "veth", "peer", "name", f"mgv{tag}s{i}")
            _ip("link", "set", f"mgv{tag}h{i}", "netns", name)
            _ip("link", "set", f"mgv{tag}s{i}", "netns", switch)
            _ip("-n", name, "link", "set", f"mgv{tag}h{i}", "name", "eth0")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", switch, "link", "set", f"mgv{tag}s{i}", "master", "br0")
            _ip("-n", switch, "link", "set", f"mgv{tag}s{i}", "up")
            if rate is not None:  # both directions: the host's egress, and the switch's towards it
                _shape(name, "eth0", rate)
                _shape(switch, f"mgv{tag}s{i}", rate)
        yield Hosts(names, addresses, "eth0")
    finally:
        for name in reversed(made):
            _kill_inside(name)  # torchrun's workers run in sessions of their own: an agent's kill misses them
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_TIMEOUT_S)


def _kill_inside(namespace: str) -> None:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=_TIMEOUT_S)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


def _shape(namespace: str, device: str, rate: str) -> None:
    # burst: enough for the rate at a 250 Hz timer; latency bounds the queue (no delay added)
    subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
                    "rate", rate, "burst", "1mb", "latency", "50ms"], check=True, capture_output=True,
                   timeout=_TIMEOUT_S)


def _ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")
