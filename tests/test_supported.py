"""No drift between what the README and docs/ promise, the target registry, tox.ini and the measured figures.

Every built-in target is run by an integration environment whose job imports it;
every integration environment is a row of the "Supported libraries" table
(docs/libraries.md, and the README's short one), naming the releases that
environment pins and the figures ``integration/measure_memory.py --record`` wrote
to ``integration/figures.json``; the "Targets" table (docs/targets.md) is the registry's.
"""

from __future__ import annotations

import configparser
import json
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from memgather.patching import targets

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LIBRARIES = (ROOT / "docs" / "libraries.md").read_text()
TARGETS = (ROOT / "docs" / "targets.md").read_text()
FIGURES = json.loads((ROOT / "integration" / "figures.json").read_text())
# Top-level packages a pinned distribution ships besides its own name.
SHIPS = {"pytorch-lightning": ("pytorch_lightning", "lightning_fabric"), "open_clip_torch": ("open_clip",)}
NOT_THE_LIBRARY = ("pytest", "torch", "torchvision", "scikit-learn")


def _environments() -> Dict[str, configparser.SectionProxy]:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    return {name.split(":", 1)[1]: tox[name] for name in tox.sections()
            if name.startswith("testenv:") and "integration" in tox[name].get("labels", "")}


def _pins(env: configparser.SectionProxy) -> List[Tuple[str, str]]:
    pins = [line.strip().split("==") for line in env["deps"].splitlines() if "==" in line]
    return [(name, version) for name, version in pins if name not in NOT_THE_LIBRARY]


def _job_source(env: configparser.SectionProxy) -> Tuple[str, bool]:
    """The job code of the environment's test, and whether it is a module of its own
    (integration/job_<library>.py, which may import by name) or job.py (import statements only)."""
    test = env["commands"].split()[-2]
    own = ROOT / "integration" / Path(test).name.replace("test_", "job_")
    if own.is_file():
        return own.read_text(), True
    return (ROOT / "integration" / "job.py").read_text(), False


def _imports(job: Tuple[str, bool], top: str) -> bool:
    """An import statement of ``top``, or (in a job module of its own) its name quoted as
    __import__ / import_module take it."""
    source, own = job
    name = re.escape(top)
    return bool(re.search(rf"^\s*(import|from) {name}[\s.]", source, re.MULTILINE)
                or (own and re.search(rf"[\"']{name}[\"'.]", source)))


def _torch(env: configparser.SectionProxy) -> str:
    return next(line.strip() for line in env["deps"].splitlines() if line.strip().startswith("torch==")).split("==")[1]


def _table(page: str, heading: str) -> List[List[str]]:
    """The first table under ``heading`` in ``page`` (a document's text), header left out."""
    section = ("\n" + page).split(f"\n{heading}\n", 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("## ") or line.startswith("### "):
            break
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows[1:]  # the header


def test_every_integration_environment_runs_its_test_from_a_wheel() -> None:
    for name, env in _environments().items():
        assert (ROOT / env["commands"].split()[-2]).is_file(), name
        assert env["package"] == "wheel", name  # memgather.pth installed as a user gets it
        torch_pin = next(line.strip() for line in env["deps"].splitlines() if line.strip().startswith("torch=="))
        # .ci/run runs every one that shares the unit suite's torch; open_clip needs a 5.5 GB one.
        assert ("ci" in env["labels"]) is (torch_pin == "torch==2.13.0"), name


def test_every_builtin_target_is_run_by_an_integration_environment() -> None:
    environments = _environments()
    for target in targets.BUILTIN:
        top = target.prefixes[0].split(".")[0]
        running = [name for name, env in environments.items()
                   if any(dist.replace("-", "_") == target.distribution.replace("-", "_") or top in SHIPS.get(dist, ())
                          for dist, _ in _pins(env))
                   and _imports(_job_source(env), top)]
        assert running, f"no integration environment installs and imports {target.name}"


def test_the_supported_libraries_table_is_the_environments_and_their_figures() -> None:
    environments = _environments()
    seen = set()
    for row in _table(LIBRARIES, "# Supported libraries"):
        named = re.findall(r"`([^`]+)`", row[0])
        assert named and all(name in environments for name in named), row[0]
        seen.update(named)
        # The releases named are exactly those the environments pin (and their torch, where not 2.13.0).
        pinned = {version for name in named for _, version in _pins(environments[name])}
        pinned |= {_torch(environments[name]) for name in named} - {"2.13.0"}
        assert set(re.findall(r"\d+\.\d+\.\d+", row[1])) == pinned, (row[0], pinned, row[1])
        cells = 0
        for name in named:
            figures = FIGURES[name]
            env = environments[name]
            assert figures["version"] == _pins(env)[0][1] and figures["mib"] == 196, name
            assert figures["torch"].split("+")[0] == _torch(env), (name, figures["torch"])
            text = "; ".join(f"`{path['path']}`: {path['torch']:.3f} x -> {path['memgather']:.3f} x ({path['ratio']:.3f})"
                             for path in figures["paths"])
            if len(named) > 1:  # one row for several releases: each figure says whose it is
                text += f" on {figures['version']}"
            assert text in row[-1], (name, text, row[-1])
            cells += len(figures["paths"])
        assert row[-1].count(" x -> ") == cells, row[-1]  # no figure in the row that figures.json lacks
    assert seen == set(environments) == set(FIGURES)


def test_the_targets_table_is_the_registry() -> None:
    rows = _table(TARGETS, "## Targets")
    assert [re.findall(r"`([^`]+)`", row[0])[0] for row in rows] == [t.name for t in targets.BUILTIN]
    for row, target in zip(rows, targets.BUILTIN):
        assert f"`{target.distribution}` `{target.versions}`" in row[2], row


def test_the_readme_lists_every_supported_library_at_the_versions_tested() -> None:
    """The landing page's short table names the same environments and releases as docs/libraries.md."""
    full = {tuple(re.findall(r"`([^`]+)`", row[0])): set(re.findall(r"\d+\.\d+\.\d+", row[1]))
            for row in _table(LIBRARIES, "# Supported libraries")}
    short = {tuple(re.findall(r"`([^`]+)`", row[2])): set(re.findall(r"\d+\.\d+\.\d+", row[1]))
             for row in _table(README, "## Supported libraries")}
    assert short == full


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_recorded_figures_are_whole(name: str) -> None:
    figures = FIGURES[name]
    assert figures["paths"] and figures["torch"] and figures["library"], name
    for path in figures["paths"]:
        assert path["torch"] > 0 and path["memgather"] > 0 and abs(path["ratio"] - path["memgather"] / path["torch"]) < 0.01, path


def test_the_newest_environment_upgrades_every_builtin_target() -> None:
    """``tox -e newest`` is how a maintainer learns that a release changed a call site: it must
    install the newest release of every built-in target (open_clip's needs torchvision's torch)."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    upgrade = next(line for line in tox["testenv:newest"]["commands_pre"].splitlines() if "--upgrade" in line)
    installed = {name.replace("_", "-").lower() for name in upgrade.split()}
    shipped = {top.replace("_", "-") for dist, tops in SHIPS.items() if dist in installed for top in tops}
    for target in targets.BUILTIN:
        name = str(target.distribution).replace("_", "-").lower()
        if target.family_name == "open_clip":
            continue
        assert name in installed or name in shipped, f"tox -e newest does not upgrade {target.distribution}"
