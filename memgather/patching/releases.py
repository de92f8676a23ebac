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
from typing import Dict, List, Optional, Union

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
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
    """A release found installed: of what (the distribution, or the top-level package when
    the version came from elsewhere), and where its version was read."""

    name: str
    version: str
    source: str


def installed(distribution: str, module: Optional[str] = None) -> Union[Installed, str]:
    """The installed release of ``distribution`` (or of ``module``'s top-level package), else why none was found.

    Metadata that cannot be read (a malformed RECORD or METADATA anywhere in the
    environment) is a refusal, never an error in the caller's gather.
    """
    try:
        return _installed(distribution, module)
    except Exception as error:  # noqa: BLE001 - someone else's broken metadata must not break a gather
        return f"cannot read the installed metadata of {distribution!r}: {type(error).__name__}: {error}"


def _installed(distribution: str, module: Optional[str]) -> Union[Installed, str]:
    top = (module or "").split(".")[0]
    try:
        own: Optional[str] = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        own = None
    try:
        own_name = canonicalize_name(distribution)
        shipping = [name for name in _shipped_by().get(top, []) if canonicalize_name(name) != own_name] if top else []
        versions = {name: metadata.version(name) for name in shipping}
    except Exception:
        if own is None:
            raise
        shipping, versions = [], {}
    if own is not None:
        versions[distribution] = own
    if len(set(versions.values())) > 1:
        # Two wheels that both hold the package: whichever was installed last is the code that runs.
        return (
            f"the distributions that ship {top} disagree on its version: "
            f"{', '.join(f'{name} {version}' for name, version in sorted(versions.items()))}"
        )
    if own is not None:
        return Installed(distribution, own, f"distribution {distribution}")
    if versions:
        return Installed(top, next(iter(versions.values())), f"distribution {', '.join(shipping)}, which ships {top}")
    own_version = getattr(sys.modules.get(top), "__version__", None) if top else None  # never imported here
    if isinstance(own_version, str):
        return Installed(top, own_version, f"{top}.__version__")
    return f"distribution {distribution!r} is not installed"


def verdict(distribution: str, versions: str, what: str, module: Optional[str] = None) -> Verdict:
    """Whether the installed release of ``distribution`` (see ``installed``) lies in ``versions``.

    Prereleases count (NGC and nightly builds are prereleases). ``what`` names
    the range in the reason ("tested range"). Not cached: callers cache their verdicts.
    """
    found = installed(distribution, module)
    if isinstance(found, str):
        return Verdict(False, None, found)
    try:
        inside = SpecifierSet(versions).contains(Version(found.version), prereleases=True)
    except (InvalidVersion, InvalidSpecifier) as error:
        return Verdict(False, found.version, f"cannot compare version {found.version!r}: {error}", found.source)
    if inside:
        return Verdict(True, found.version, f"{found.name} {found.version} is inside {versions or 'any'}", found.source)
    return Verdict(False, found.version, f"{found.name} {found.version} is outside the {what} {versions}", found.source)


def imported(module: str) -> bool:
    """Whether ``module``'s top-level package is imported (its ``__version__`` may then be read)."""
    return module.split(".")[0] in sys.modules


@lru_cache(maxsize=1)
def _shipped_by() -> Dict[str, List[str]]:
    """Top-level package -> the installed distributions whose files hold it (scanned once: about 50 ms).

    Python 3.9's importlib.metadata has no packages_distributions(): there only a
    library's own distribution and its ``__version__`` can be read.
    """
    scan = getattr(metadata, "packages_distributions", None)
    if scan is None:
        return {}
    return {top: sorted(set(names)) for top, names in scan().items()}
