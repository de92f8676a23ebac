"""Multi-host jobs on simulated hosts: torchrun's multi-node launch, one agent per host namespace.

``launch(hosts, per_host, out_dir, env)`` runs tests/multihost_job.py as
``torchrun --nnodes H --nproc_per_node P`` with c10d rendezvous on host 0
(``is_host`` said explicitly: every namespace shares the machine's hostname),
gloo bound to each host's own link (``GLOO_SOCKET_IFNAME``). Every process it
starts is killed when the bounded wait ends.

    python -m tests.multihost [--hosts 2] [--per-host 2] [--mib 4] [--rate 1gbit] [--route broadcast]

prints, per caller pattern, torch's and memgather's time and peak growth on
such hosts (rate: the tbf rate of every link; latency is not simulated).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from tests.hosts import Hosts, simulated_hosts

JOB = Path(__file__).resolve().parent / "multihost_job.py"
ON = {"MEMGATHER": "1", "MEMGATHER_TARGETS": "memgather_bench_patterns", "MEMGATHER_REPORT": "all"}


def launch(hosts: Hosts, per_host: int, out_dir: Path, env: Optional[Dict[str, str]] = None,
           mib: float = 4, timeout_s: float = 240) -> Dict[str, Any]:
    """Run the job on every host; per rank its results, and every agent's output."""
    out_dir.mkdir(parents=True, exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATHER")}
    full.update({"GLOO_SOCKET_IFNAME": hosts.interface, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                 "MEMGATHER_JOB_MIB": str(mib), **(env or {})})
    count = len(hosts.names)
    agents = []
    for host in range(count):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(count),
                "--nproc_per_node", str(per_host), "--rdzv_backend", "c10d",
                "--rdzv_endpoint", f"{hosts.addresses[0]}:29611", "--rdzv_id", out_dir.name,
                "--rdzv_conf", f"is_host={'1' if host == 0 else '0'}", "--local_addr", hosts.addresses[host],
                "--max_restarts", "0", str(JOB), str(out_dir)]
        agents.append(subprocess.Popen(hosts.command(host, argv), env=full, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outputs: List[str] = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout_s)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
                agent.wait()
    output = "\n".join(outputs)
    failed = [agent.returncode for agent in agents if agent.returncode != 0]
    if failed:
        raise AssertionError(f"multi-host job failed (exit {failed}):\n{output[-6000:]}")
    world = count * per_host
    results = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]
    return {"results": results, "output": output}


def compare(hosts: Hosts, per_host: int, tmp: Path, mib: float = 4,
            route: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """The job under torch alone, then with MEMGATHER=1 (through memgather's .pth); ``route``
    "broadcast" makes memgather take the one-host route across hosts too (to measure it)."""
    mine = {**ON, **({"MEMGATHER_GLOO_ROUTE": route} if route else {})}
    return {mode: launch(hosts, per_host, tmp / mode, env, mib)
            for mode, env in (("torch", {}), ("memgather", mine))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--mib", type=float, default=4, help="MiB per rank gathered")
    parser.add_argument("--rate", default=None, help="tbf rate of every link, e.g. 1gbit (default: unshaped)")
    parser.add_argument("--route", choices=["broadcast"], default=None,
                        help="make memgather take the one-host broadcasts across hosts too (default: its choice, the ring)")
    args = parser.parse_args()
    with simulated_hosts(args.hosts, args.rate) as hosts, tempfile.TemporaryDirectory() as tmp:
        runs = compare(hosts, args.per_host, Path(tmp), args.mib, args.route)
    theirs, mine = runs["torch"]["results"], runs["memgather"]["results"]
    print(f"{args.hosts} hosts x {args.per_host} ranks, {args.mib:g} MiB per rank, link {args.rate or 'unshaped veth'}")
    print(f"{'pattern':<18} {'torch s':>8} {'memgather s':>12} {'time x':>7} {'torch peak':>11} {'memgather peak':>15}")
    for name in (k for k in theirs[0] if isinstance(theirs[0][k], dict)):
        a, b = theirs[0][name], mine[0][name]
        peak_a = max(r[name]["growth"] for r in theirs)
        peak_b = max(r[name]["growth"] for r in mine)
        same = all(x[name]["sha256"] == y[name]["sha256"] for x, y in zip(theirs, mine))
        print(f"{name:<18} {a['seconds']:8.3f} {b['seconds']:12.3f} {b['seconds'] / a['seconds']:7.2f} "
              f"{peak_a:10.3f}x {peak_b:14.3f}x{'' if same else '  RESULTS DIFFER'}")


if __name__ == "__main__":
    main()
