"""Environment variables, read into one typed settings object.

- ``MEMGATHER`` (unset, ``1``, ``0``): ``1`` patches at start-up (through the
  ``.pth``); ``0`` is the kill switch: ``patch()`` does nothing.
- ``MEMGATHER_TARGETS`` (comma-separated names): targets to rewire (built-in
  names, module prefixes, ``*``); unset: every built-in.
- ``MEMGATHER_CHECK`` (boolean): cross-rank shape check on every rewired call.
- ``MEMGATHER_FORCE`` (boolean): rewire targets whose installed version is
  outside the tested range.
- ``MEMGATHER_VERIFY`` (boolean): check every rewired call against the original
  all_gather (test runs).
- ``MEMGATHER_ELIDE`` (unset, boolean): cat elision; unset: at call sites whose
  code is proven to drop the list after one cat, 1: every rewired call, 0: never.
- ``MEMGATHER_GLOO_MIN_BYTES`` (bytes per rank): gloo calls below this are left
  to torch (default 2 MiB; 0 rewires all).
- ``MEMGATHER_NCCL_MIN_BYTES`` (bytes per rank): NCCL calls below this are left
  to torch (default 72 MiB at 2 ranks, 30 MiB at 8: engine/routes.py; 0 rewires all).
- ``MEMGATHER_GLOO_ROUTE`` (``auto``, ``broadcast``, ``ring``): the in-place route
  of large gloo calls (auto: the ring where the group spans hosts).
- ``MEMGATHER_HUGE_PAGES`` (boolean, default on): huge-page advice on large CPU
  buffers memgather fills.
- ``MEMGATHER_LOG`` (a logging level name): log memgather's messages at that
  level to stderr.
- ``MEMGATHER_REPORT`` (``1``/``rank0``, ``all``, ``0``): statistics at exit, of
  rank 0 only or of every rank.

``load`` reads them once into ``Settings``; ``patch()`` hands the engine the
settings it runs under, and exports them so that spawned children re-patch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Dict, Mapping, MutableMapping, Optional, Tuple

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
GLOO_ROUTES = ("auto", "broadcast", "ring")
_REPORTS = {"": "off", "0": "off", "off": "off", "1": "rank0", "rank0": "rank0", "all": "all"}


@dataclass(frozen=True)
class Settings:
    """What the environment asks of memgather (see the module docstring)."""

    enabled: Optional[bool] = None
    targets: Optional[Tuple[str, ...]] = None
    check: bool = False
    force: bool = False
    verify: bool = False
    elide: Optional[bool] = None
    gloo_min_bytes: Optional[int] = None
    nccl_min_bytes: Optional[int] = None
    huge_pages: bool = True
    log_level: Optional[int] = None
    report: str = "off"
    gloo_route: str = "auto"


def parse_bool(name: str, value: str) -> bool:
    """Read a boolean environment variable, naming it when the value is not one."""
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use one of 1/0, true/false, yes/no, on/off")


def switched_off(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``MEMGATHER`` is set to a false value (``0``, ``false``, ``no``, ``off``): the kill switch."""
    value = (os.environ if environ is None else environ).get("MEMGATHER", "").strip().lower()
    return bool(value) and value in _FALSE


def load(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Settings from ``environ`` (default: ``os.environ``)."""
    env = os.environ if environ is None else environ
    raw_enabled = env.get("MEMGATHER", "").strip()
    raw_targets = env.get("MEMGATHER_TARGETS")
    return Settings(
        enabled=None if raw_enabled == "" else parse_bool("MEMGATHER", raw_enabled),
        targets=None if raw_targets is None else tuple(t.strip() for t in raw_targets.split(",") if t.strip()),
        check=parse_bool("MEMGATHER_CHECK", env.get("MEMGATHER_CHECK", "")),
        force=parse_bool("MEMGATHER_FORCE", env.get("MEMGATHER_FORCE", "")),
        verify=parse_bool("MEMGATHER_VERIFY", env.get("MEMGATHER_VERIFY", "")),
        elide=_optional_bool("MEMGATHER_ELIDE", env.get("MEMGATHER_ELIDE", "")),
        gloo_min_bytes=_optional_size("MEMGATHER_GLOO_MIN_BYTES", env.get("MEMGATHER_GLOO_MIN_BYTES", "")),
        nccl_min_bytes=_optional_size("MEMGATHER_NCCL_MIN_BYTES", env.get("MEMGATHER_NCCL_MIN_BYTES", "")),
        huge_pages=parse_bool("MEMGATHER_HUGE_PAGES", env.get("MEMGATHER_HUGE_PAGES", "1")),
        log_level=_parse_level(env.get("MEMGATHER_LOG", "")),
        report=_parse_report(env.get("MEMGATHER_REPORT", "")),
        gloo_route=_parse_gloo_route(env.get("MEMGATHER_GLOO_ROUTE", "")),
    )


def _optional_bool(name: str, value: str) -> Optional[bool]:
    return None if value.strip() == "" else parse_bool(name, value)


def _optional_size(name: str, value: str) -> Optional[int]:
    text = value.strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{name}={value!r} is not a number of bytes (a non-negative integer)")
    return int(text)


def _parse_level(value: str) -> Optional[int]:
    name = value.strip().upper()
    if not name:
        return None
    level = logging.getLevelName(name)
    if isinstance(level, int):
        return level
    if name.isdigit():
        return int(name)
    raise ValueError(f"MEMGATHER_LOG={value!r} is not a logging level: use DEBUG, INFO, WARNING or ERROR")


def _parse_report(value: str) -> str:
    key = value.strip().lower()
    if key not in _REPORTS:
        raise ValueError(f"MEMGATHER_REPORT={value!r}: use 1 (rank 0), all (every rank) or 0")
    return _REPORTS[key]


def _parse_gloo_route(value: str) -> str:
    route = value.strip().lower() or "auto"
    if route not in GLOO_ROUTES:
        raise ValueError(f"MEMGATHER_GLOO_ROUTE={value!r}: use auto, broadcast or ring")
    return route


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote to ``os.environ`` (``written``) and the values it wrote over (``previous``).

    The user's own settings are the environment less memgather's writes: a name that
    still holds what memgather wrote reads as it was before, so that a second
    ``patch()`` is configured by the user's environment and its own arguments, not by
    what the first one was given. A name the user has set since keeps the user's value.
    """

    previous: Mapping[str, Optional[str]]
    written: Mapping[str, str]

    def users_environment(self) -> Dict[str, str]:
        """``os.environ`` with memgather's writes taken back out."""
        environ = dict(os.environ)
        self.take_back(environ)
        return environ

    def take_back(self, environ: MutableMapping[str, str]) -> None:
        """Give each name of ``environ`` that still holds what was written its earlier value."""
        for name, value in self.previous.items():
            if environ.get(name) != self.written[name]:
                continue  # set by the user since: theirs
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value


def export(
    enabled: bool,
    targets: Tuple[str, ...],
    check: bool,
    force: bool,
    elide: Optional[bool],
    verify: bool = False,
    over: Optional[Exported] = None,
) -> Exported:
    """Write settings to ``os.environ`` so spawned children re-patch.

    ``over``: what an earlier ``export`` of the same patch wrote; the values it wrote
    over, not its own, are kept as the ones to restore.
    """
    values = {
        "MEMGATHER": "1" if enabled else "0",
        "MEMGATHER_TARGETS": ",".join(targets),
        "MEMGATHER_CHECK": "1" if check else "0",
        "MEMGATHER_FORCE": "1" if force else "0",
        "MEMGATHER_ELIDE": "" if elide is None else ("1" if elide else "0"),
        "MEMGATHER_VERIFY": "1" if verify else "0",
    }
    users = os.environ if over is None else over.users_environment()
    previous = {name: users.get(name) for name in values}
    os.environ.update(values)
    return Exported(previous, values)


def restore(exported: Exported) -> None:
    """Undo ``export``: each name that still holds what it wrote gets its earlier value back."""
    exported.take_back(os.environ)
