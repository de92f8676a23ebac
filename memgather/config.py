"""Environment variables, read into one typed settings object."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Settings:
    """What the environment asks of memgather.

    ``check``: run the cross-rank shape check on every rewired call
    (``MEMGATHER_CHECK``).
    """

    check: bool = False


def parse_bool(name: str, value: str) -> bool:
    """Read a boolean environment variable, naming it when the value is not one."""
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use one of 1/0, true/false, yes/no, on/off")


def load(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Settings from ``environ`` (default: ``os.environ``)."""
    env = os.environ if environ is None else environ
    return Settings(check=parse_bool("MEMGATHER_CHECK", env.get("MEMGATHER_CHECK", "")))
