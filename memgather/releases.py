"""Which release of a library is installed, where that was read, and whether it lies in a range.

Read from distribution metadata, never by importing the library. A module
that has no distribution of its own (``lightning_fabric`` inside the
``pytorch-lightning`` wheel) is looked up through the distribution that ships
its top-level package (``importlib.metadata.packages_distributions()``), and,
failing that, through the ``__version__`` of the module if it is already
imported.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from typing import Dict, List, Optional, Tuple, Union

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Verdict:
    """Whether an installed release passed a range, and why.

    ``source``: where the version was read ("distribution pytorch-lightning,
    which ships lightning_fabric"); empty when none was found.
    """

    allowed: bool
    version: Optional[str]
    reason: str
    source: str = ""


@dataclass(frozen=True)
class Installed:
    """A release found installed, and where its version was read."""

    version: str
    source: str


def installed(distribution: str, module: Optional[str] = None) -> Union[Installed, str]:
    """The installed release of ``distribution`` (or of ``module``'s top-level package), else why none was found."""
    try:
        return Installed(metadata.version(distribution), f"distribution {distribution}")
    except metadata.PackageNotFoundError:
        pass
    top = (module or "").split(".")[0]
    if not top:
        return f"distribution {distribution!r} is not installed"
    shipping = _shipped_by().get(top, [])
    versions = sorted({metadata.version(name) for name in shipping})
    if len(versions) == 1:
        return Installed(versions[0], f"distribution {', '.join(shipping)}, which ships {top}")
    if len(versions) > 1:
        return (f"distribution {distribution!r} is not installed, and the distributions that ship {top} "
                f"disagree on its version: {', '.join(f'{n} {metadata.version(n)}' for n in shipping)}")
    own = getattr(sys.modules.get(top), "__version__", None)  # never imported here: only if it already is
    if isinstance(own, str):
        return Installed(own, f"{top}.__version__")
    return f"distribution {distribution!r} is not installed"


def verdict(distribution: str, versions: str, what: str, module: Optional[str] = None) -> Verdict:
    """Whether the installed release of ``distribution`` (see ``installed``) lies in ``versions``.

    Prereleases count (NGC and nightly builds are prereleases). ``what`` names
    the range in the reason ("tested range"). Not cached: callers cache their verdicts.
    """
    found = installed(distribution, module)
    if isinstance(found, str):
        return Verdict(False, None, found)
    name = distribution if found.source == f"distribution {distribution}" else (module or distribution).split(".")[0]
    try:
        inside = SpecifierSet(versions).contains(Version(found.version), prereleases=True)
    except (InvalidVersion, InvalidSpecifier) as error:
        return Verdict(False, found.version, f"cannot compare version {found.version!r}: {error}", found.source)
    if inside:
        return Verdict(True, found.version, f"{name} {found.version} is inside {versions or 'any'}", found.source)
    return Verdict(False, found.version, f"{name} {found.version} is outside the {what} {versions}", found.source)


def imported(module: str) -> bool:
    """Whether ``module``'s top-level package is imported (its ``__version__`` may then be read)."""
    return module.split(".")[0] in sys.modules


@lru_cache(maxsize=1)
def _shipped_by() -> Dict[str, List[str]]:
    """Top-level package -> the installed distributions whose files hold it (scanned once: it is slow)."""
    return {top: sorted(set(names)) for top, names in metadata.packages_distributions().items()}


def forget() -> None:
    """Drop what was read (tests install and remove metadata)."""
    _shipped_by.cache_clear()


__all__: Tuple[str, ...] = ("Installed", "Verdict", "installed", "verdict", "imported", "forget")
