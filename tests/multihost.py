"""Multi-host jobs on simulated hosts: torchrun's multi-node launch, one agent per host namespace.

``launch(hosts, per_host, out_dir, env)`` runs tests/multihost_job.py as
``torchrun --nnodes H --nproc_per_node P`` with c10d rendezvous on host 0
(``is_host`` said explicitly: every namespace shares the machine's hostname),
gloo bound to each host's own link (``GLOO_SOCKET_IFNAME``). Every process it
starts is killed when the bounded wait ends.

    python -m tests.multihost [--hosts 2] [--per-host 2] [--mib 4] [--rate 1gbit] [--route broadcast]

prints, per caller pattern, torch's and memgather's time and peak growth on
such hosts (rate: the tbf rate of every link; latency is not simulated).
``python -m tests.multihost --matrix`` measures world 2, 4 and 8 on one host and
across hosts, 4 and 64 MiB per rank, over every link profile: the table in docs/multi-node.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from integration.harness import reports
from tests.hosts import Hosts, simulated_hosts

JOB = Path(__file__).resolve().parent / "multihost_job.py"
# Cat elision on, as `memgather bench` has it for the libraries the cat patterns stand for.
ON = {"MEMGATHER": "1", "MEMGATHER_TARGETS": "memgather_bench_patterns", "MEMGATHER_REPORT": "all",
      "MEMGATHER_ELIDE": "1"}
# (hosts, ranks per host): world 2, 4 and 8, on one host and across hosts
LAYOUTS = ((1, 2), (2, 1), (1, 4), (2, 2), (1, 8), (2, 4), (4, 2))
RATES = (None, "10gbit", "1gbit")  # None: the veth pairs unshaped
SIZES = (4, 64)


def launch(hosts: Hosts, per_host: int, out_dir: Path, env: Optional[Dict[str, str]] = None,
           mib: float = 4, timeout_s: float = 240, repeat: int = 1) -> Dict[str, Any]:
    """Run the job on every host; per rank its results, and every agent's output.

    One deadline for the whole job: each agent writes to a file of its own (a pipe
    left unread while another agent is waited for would stall its writer).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATHER")}
    full.update({"GLOO_SOCKET_IFNAME": hosts.interface, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                 "MEMGATHER_JOB_MIB": str(mib), "MEMGATHER_JOB_REPEAT": str(repeat), **(env or {})})
    count = len(hosts.names)
    logs = [out_dir / f"agent{host}.log" for host in range(count)]
    agents = []
    for host, log in enumerate(logs):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(count),
                "--nproc_per_node", str(per_host), "--rdzv_backend", "c10d",
                "--rdzv_endpoint", f"{hosts.addresses[0]}:29611", "--rdzv_id", out_dir.name,
                "--rdzv_conf", f"is_host={'1' if host == 0 else '0'}", "--local_addr", hosts.addresses[host],
                "--max_restarts", "0", str(JOB), str(out_dir)]
        with open(log, "w") as sink:
            agents.append(subprocess.Popen(hosts.command(host, argv), env=full, stdout=sink,
                                           stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        for agent in agents:
            agent.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # reported below, with what the agents wrote
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
                agent.wait()
    output = "\n".join(log.read_text(errors="replace") for log in logs)
    failed = [agent.returncode for agent in agents if agent.returncode != 0]
    if failed:
        raise AssertionError(f"multi-host job failed (exit {failed}; -9: killed at the {timeout_s:g} s deadline):\n"
                             f"{output[-6000:]}")
    world = count * per_host
    results = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]
    return {"results": results, "output": output}


def compare(hosts: Hosts, per_host: int, tmp: Path, mib: float = 4, route: Optional[str] = None,
            repeat: int = 1, other_route: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """The job under torch alone, then with MEMGATHER=1 (through memgather's .pth); ``route``
    (MEMGATHER_GLOO_ROUTE) sets memgather's in-place route instead of its own choice;
    ``other_route`` adds a third run ("other") with memgather set to that route."""
    modes = [("torch", {}), ("memgather", {**ON, **({"MEMGATHER_GLOO_ROUTE": route} if route else {})})]
    if other_route:
        modes.append(("other", {**ON, "MEMGATHER_GLOO_ROUTE": other_route}))
    timeout_s = 240 + 30 * repeat * mib * len(hosts.names) * per_host / 64  # 1 Gbit/s moves 64 MiB in about 0.6 s
    return {mode: launch(hosts, per_host, tmp / mode, env, mib, timeout_s, repeat) for mode, env in modes}


def summary(runs: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """One line of the matrix: time as a multiple of torch's over the patterns, worst peaks, routes."""
    theirs, mine = runs["torch"]["results"], runs["memgather"]["results"]
    names = [k for k in theirs[0] if isinstance(theirs[0][k], dict)]

    def ratios(mode: str) -> Tuple[float, float, float]:
        each = [runs[mode]["results"][0][n]["seconds"] / theirs[0][n]["seconds"] for n in names]
        return min(each), statistics.median(each), max(each)

    line = reports(runs["memgather"]["output"])[0].line
    return {"torch_s": statistics.median(theirs[0][n]["seconds"] for n in names),
            "time_x": ratios("memgather"), "other_x": ratios("other") if "other" in runs else None,
            "torch_peak": max(r[n]["growth"] for r in theirs for n in names),
            "memgather_peak": max(r[n]["growth"] for r in mine for n in names),
            "identical": all(x[n]["sha256"] == y[n]["sha256"] for other in ("memgather", "other") if other in runs
                             for x, y in zip(theirs, runs[other]["results"]) for n in names),
            "routes": _pattern_routes(line, mine[0].get("per_host_group", {}).get("routes", {}))}


def _pattern_routes(line: str, per_host_group: Dict[str, int]) -> str:
    """The routes of a report line, less the one gather on a group of one host's ranks."""
    text = re.search(r"routes: ([^;]*);", line).group(1)  # type: ignore[union-attr]
    counts = {k: int(v) for k, v in (pair.split("=") for pair in text.split(", ") if "=" in pair)}
    left = {k: v - per_host_group.get(k, 0) for k, v in counts.items()}
    return ", ".join(f"{k}={v}" for k, v in sorted(left.items()) if v) or "none"


def _pattern_table(runs: Dict[str, Dict[str, Any]]) -> None:
    theirs, mine = runs["torch"]["results"], runs["memgather"]["results"]
    print(f"{'pattern':<18} {'torch s':>8} {'memgather s':>12} {'time x':>7} {'torch peak':>11} {'memgather peak':>15}")
    for name in (k for k in theirs[0] if isinstance(theirs[0][k], dict)):
        a, b = theirs[0][name], mine[0][name]
        peak_a = max(r[name]["growth"] for r in theirs)
        peak_b = max(r[name]["growth"] for r in mine)
        same = all(x[name]["sha256"] == y[name]["sha256"] for x, y in zip(theirs, mine))
        print(f"{name:<18} {a['seconds']:8.3f} {b['seconds']:12.3f} {b['seconds'] / a['seconds']:7.2f} "
              f"{peak_a:10.3f}x {peak_b:14.3f}x{'' if same else '  RESULTS DIFFER'}")


def matrix(repeat: int, layouts: Sequence[Tuple[int, int]] = LAYOUTS) -> None:
    """Every layout of ``layouts`` at every size of ``SIZES``, across every link of ``RATES``
    (one host: loopback only), one markdown row each, printed as it is measured; each case
    also runs memgather set to the route it does not choose there (one host: the ring;
    across hosts: the broadcasts)."""
    print("| world | hosts x ranks | link | MiB per rank | torch s | memgather time x (min, median, max) "
          "| torch peak | memgather peak | memgather's route | the other route: time x (min, median, max) | results |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for hosts, per_host in layouts:
        for rate in RATES if hosts > 1 else (None,):
            for mib in SIZES:
                other = "ring" if hosts == 1 else "broadcast"
                with simulated_hosts(hosts, rate) as made, tempfile.TemporaryDirectory() as tmp:
                    row = summary(compare(made, per_host, Path(tmp), mib, repeat=repeat, other_route=other))
                link = rate or ("loopback" if hosts == 1 else "veth, unshaped")
                print(f"| {hosts * per_host} | {hosts} x {per_host} | {link} | {mib:g} | {row['torch_s']:.3f} "
                      f"| {_triple(row['time_x'])} | {row['torch_peak']:.3f} x | {row['memgather_peak']:.3f} x "
                      f"| {row['routes']} | {other}: {_triple(row['other_x'])} "
                      f"| {'identical' if row['identical'] else 'DIFFER'} |", flush=True)


def _layouts(parser: argparse.ArgumentParser, text: str) -> List[Tuple[int, int]]:
    try:
        return [(int(h), int(r)) for h, r in (part.lower().split("x") for part in text.split(","))]
    except ValueError:
        parser.error(f"--layouts {text!r}: expected hosts x ranks per host, comma-separated, e.g. 2x1,2x2")
        raise


def _triple(values: Tuple[float, float, float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--mib", type=float, default=4, help="MiB per rank gathered")
    parser.add_argument("--rate", default=None, help="tbf rate of every link, e.g. 1gbit (default: unshaped)")
    parser.add_argument("--route", choices=["broadcast", "ring"], default=None,
                        help="MEMGATHER_GLOO_ROUTE for memgather's run, e.g. the broadcasts across hosts "
                             "(default: auto, the ring across hosts and the broadcasts on one)")
    parser.add_argument("--repeat", type=int, default=3, help="calls timed per pattern; the median counts (default 3)")
    parser.add_argument("--matrix", action="store_true",
                        help="instead: world 2, 4 and 8 on one host and across hosts, 4 and 64 MiB per rank, "
                             "unshaped, 10gbit and 1gbit links, memgather's route and the other one; one row per case "
                             "(about an hour on 2 cores)")
    parser.add_argument("--layouts", metavar="HxR,...",
                        help="with --matrix: only these layouts, hosts x ranks per host (e.g. 2x1,2x2)")
    args = parser.parse_args()
    if args.matrix:
        matrix(args.repeat, _layouts(parser, args.layouts) if args.layouts else LAYOUTS)
        return
    with simulated_hosts(args.hosts, args.rate) as hosts, tempfile.TemporaryDirectory() as tmp:
        runs = compare(hosts, args.per_host, Path(tmp), args.mib, args.route, args.repeat)
    print(f"{args.hosts} hosts x {args.per_host} ranks, {args.mib:g} MiB per rank, link {args.rate or 'unshaped veth'}")
    _pattern_table(runs)


if __name__ == "__main__":
    main()
