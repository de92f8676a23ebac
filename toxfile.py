"""tox's inline plugin for this project: ``--discard`` removes each environment once it has passed.

Every integration environment installs its own torch (about 750 MB on disk) beside
its library, so ``tox -m ci`` keeps eight copies, 9-10 GB, if nothing removes them.
With ``--discard`` an environment whose commands passed goes as soon as it is torn
down, so a run needs room for one at a time (1-1.5 GB), and the next run installs
afresh. One that failed, in its commands or its set-up, stays, with its logs
(``.tox/NAME/log``), to be looked into. Without the flag, environments stay for the
next run to reuse, as tox does by default.

tox loads this file itself (it is ``toxfile.py`` beside ``tox.ini``); it needs
tox >= 4.0.9, the first release with the teardown hook.
"""

from __future__ import annotations

import logging
import shutil
from typing import TYPE_CHECKING

from tox.plugin import impl

if TYPE_CHECKING:
    from tox.config.cli.parser import ToxParser
    from tox.execute.api import Outcome
    from tox.tox_env.api import ToxEnv

_log = logging.getLogger(__name__)
_passed: set[str] = set()  # environments whose commands all passed, in this run


@impl
def tox_add_option(parser: ToxParser) -> None:
    parser.add_argument(
        "--discard",
        action="store_true",
        help="remove each environment's folder once it has run (a run then needs disk for one environment at a time)",
    )


@impl
def tox_after_run_commands(tox_env: ToxEnv, exit_code: int, outcomes: list[Outcome]) -> None:
    if exit_code == 0:
        _passed.add(tox_env.name)


@impl
def tox_env_teardown(tox_env: ToxEnv) -> None:
    # The package environment builds the wheel every other environment installs: it is small,
    # runs no commands, and tox tears it down last.
    if not getattr(tox_env.options, "discard", False) or tox_env.name not in _passed:
        return
    _log.warning("removing %s (--discard)", tox_env.env_dir)
    shutil.rmtree(tox_env.env_dir, ignore_errors=True)
