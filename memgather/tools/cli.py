"""The ``memgather`` command (also ``python -m memgather``): selftest, run, doctor, bench."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import List, Optional, Sequence

_DESCRIPTION = """\
memgather rewires torch.distributed.all_gather calls of selected libraries to one
flat buffer and a single collective, without editing their code.

  memgather selftest [--sizes S]                          on a new cluster, first: every caller
                                                          pattern, torch vs memgather verified
  memgather run [--targets T ...] [--check] [--verify] -- CMD ...   run CMD with memgather on
  memgather doctor                                        what memgather would do here
  memgather bench [...]                                   torch vs memgather, measured
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if args[:1] == ["bench"]:  # bench and selftest own their options
        from memgather.tools import bench

        return bench.main(args[1:])
    if args[:1] == ["selftest"]:
        from memgather.tools import selftest

        return selftest.main(args[1:])
    parsed = parser.parse_args(args)
    if parsed.command == "run":
        return _run(parsed)
    if parsed.command == "doctor":
        from memgather.tools import doctor

        return doctor.main()
    parser.print_help()
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memgather", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="{selftest,run,doctor,bench}")
    commands.add_parser(
        "selftest",
        help="run first on a new cluster, under its launcher: every caller pattern, "
        "torch vs memgather in verify mode (memgather selftest --help)",
        add_help=False,
    )
    run = commands.add_parser(
        "run",
        help="run a command with memgather switched on",
        description="Set MEMGATHER=1 (and the options below) in the environment and exec CMD. Every Python "
        "process CMD starts (torchrun's, accelerate launch's and deepspeed's workers included) patches "
        "itself when it imports torch.distributed, through memgather.pth.",
    )
    run.add_argument(
        "--targets",
        nargs="+",
        metavar="T",
        help="built-in targets, module prefixes or '*' (default: every built-in target)",
    )
    run.add_argument("--check", action="store_true", help="cross-rank shape check on every rewired call")
    run.add_argument("--force", action="store_true", help="also rewire targets outside their tested version range")
    run.add_argument(
        "--verify",
        action="store_true",
        help="check every rewired call against the original all_gather (test runs: doubles each gather)",
    )
    run.add_argument(
        "--elide",
        choices=["on", "off"],
        help="cat elision for every rewired call (on) or none (off); default: at call sites whose code is "
        "proven to drop the list after one cat",
    )
    run.add_argument("--report", choices=["rank0", "all"], help="write statistics to stderr at exit")
    run.add_argument("--log", metavar="LEVEL", help="log memgather's messages at LEVEL (DEBUG, INFO, ...)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")
    commands.add_parser("doctor", help="report torch, backends, targets and settings; exit 0 when usable")
    commands.add_parser("bench", help="measure torch vs memgather (memgather bench --help)", add_help=False)
    return parser


def _run(parsed: argparse.Namespace) -> int:
    cmd: List[str] = parsed.cmd[1:] if parsed.cmd[:1] == ["--"] else parsed.cmd
    if not cmd:
        print("memgather run: no command given (usage: memgather run [options] -- CMD ...)", file=sys.stderr)
        return 2
    env = dict(os.environ, MEMGATHER="1")
    if parsed.targets:
        env["MEMGATHER_TARGETS"] = ",".join(parsed.targets)
    if parsed.check:
        env["MEMGATHER_CHECK"] = "1"
    if parsed.force:
        env["MEMGATHER_FORCE"] = "1"
    if parsed.verify:
        env["MEMGATHER_VERIFY"] = "1"
    if parsed.elide:
        env["MEMGATHER_ELIDE"] = "1" if parsed.elide == "on" else "0"
    if parsed.report:
        env["MEMGATHER_REPORT"] = parsed.report
    if parsed.log:
        env["MEMGATHER_LOG"] = parsed.log
    program = shutil.which(cmd[0], path=env.get("PATH"))
    if program is None:
        print(f"memgather run: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    os.execve(program, cmd, env)
    return 0  # not reached
