"""The taken-over helpers on older releases of their libraries (``tox -e older,oldest``).

Each environment installs older releases of torchmetrics, Lightning, MONAI and PyTorch-Ignite
beside torch 2.13 (tox.ini says which). Every helper installed there must be recognised as the
shape of its release line, and each library's uneven gather must reach its floor with memgather,
values torch's (``integration/uneven_peaks.py`` on two gloo ranks of 24 and 8 MiB).
"""

from __future__ import annotations

from importlib import metadata
from typing import Dict, Optional

from packaging.version import Version

from memgather.patching import helpers, library_helpers

# Each helper's release lines, by the first release of each (as docs/calls.md names them).
LINES: Dict[str, Dict[str, str]] = {
    "torchmetrics": {"1.0.0": "torchmetrics 1.0.0 to 1.5.2", "1.6.0": "torchmetrics 1.6.0 to 1.8.2",
                     "1.9.0": "torchmetrics 1.9"},
    "lightning": {"2.0.0": "Lightning 2.0 to 2.6"},
    "monai": {"1.1.0": "MONAI 1.1.0 to 1.6"},
    "pytorch-ignite": {"0.5.2": "PyTorch-Ignite 0.5.2 to 0.5.5"},
}
MODULES = {"torchmetrics": "torchmetrics", "lightning": "lightning", "monai": "monai", "pytorch-ignite": "ignite"}


def _installed(distribution: str) -> Optional[Version]:
    try:
        return Version(metadata.version(distribution))
    except metadata.PackageNotFoundError:
        return None


def test_each_installed_helper_is_recognised_as_its_release_lines_shape() -> None:
    states = dict(helpers.survey(library_helpers.HELPERS))
    checked = 0
    for distribution, lines in LINES.items():
        version = _installed(distribution)
        if version is None:
            continue
        line = [label for first, label in sorted(lines.items(), key=lambda item: Version(item[0]))
                if Version(first) <= version][-1]
        found = {name: state for name, state in states.items() if name.split(".")[0] == MODULES[distribution]}
        assert found, (distribution, states)
        for name, state in found.items():
            assert state.startswith(f"recognised ({line})"), (distribution, str(version), name, state)
            checked += 1
    assert checked >= 2, states


def test_the_users_peak_of_each_uneven_gather_at_its_floor() -> None:
    from integration import uneven_peaks

    uneven_peaks.check_floors()
