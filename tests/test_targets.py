"""The target registry and its version gates, on real distribution metadata."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest
from packaging.specifiers import SpecifierSet

from memgather.patching import targets
from memgather.patching.targets import Target
from tests.conftest import forget_verdicts


@pytest.fixture()
def installed(tmp_path: Path) -> Iterator[Path]:
    """A site directory holding real .dist-info metadata of made-up distributions."""
    for name, version in (("mg_fake_release", "1.4.2"), ("mg_fake_pre", "2.0.0rc1"), ("mg_fake_odd", "not-a-version")):
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    package = tmp_path / "mg_fake_release"
    package.mkdir()
    (package / "__init__.py").write_text("IMPORTED = True\n")
    sys.path.insert(0, str(tmp_path))
    forget_verdicts()
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("mg_fake_release", None)
    forget_verdicts()


@pytest.mark.parametrize(
    "distribution,versions,allowed,reason",
    [
        ("mg_fake_release", ">=1.0,<2", True, "mg_fake_release 1.4.2 is inside >=1.0,<2"),
        ("mg_fake_release", ">=1.5", False, "mg_fake_release 1.4.2 is outside the tested range >=1.5"),
        ("mg_fake_pre", ">=2.0.0rc1,<3", True, "mg_fake_pre 2.0.0rc1 is inside"),  # prereleases count
        ("mg_fake_pre", "<2.0.0rc1", False, "outside"),
        ("mg_fake_odd", ">=1", False, "cannot compare version 'not-a-version'"),
        ("mg_not_installed_anywhere", ">=1", False, "'mg_not_installed_anywhere' is not installed"),
    ],
)
def test_gate(installed: Path, distribution: str, versions: str, allowed: bool, reason: str) -> None:
    verdict = targets.gate(Target("t", ("t",), distribution, versions))
    assert verdict.allowed is allowed
    assert reason in verdict.reason


def test_force_overrides_a_failed_gate(installed: Path) -> None:
    verdict = targets.gate(Target("t", ("t",), "mg_fake_release", ">=9"), force=True)
    assert verdict.allowed and verdict.reason.endswith("; forced")


def test_gate_reads_metadata_without_importing(installed: Path) -> None:
    targets.gate(Target("t", ("mg_fake_release",), "mg_fake_release", ">=1"))
    assert "mg_fake_release" not in sys.modules


def _dist_info(site: Path, name: str, version: str, top_level: str = "") -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if top_level:
        (info / "top_level.txt").write_text(top_level + "\n")


def test_gate_reads_the_distribution_that_ships_a_module(installed: Path) -> None:
    """lightning_fabric inside pytorch-lightning's wheel: no distribution of its own."""
    _dist_info(installed, "mg_fake_bundle", "2.6.6", "mg_fake_bundled\nmg_fake_bundle")
    verdict = targets.gate(Target("t", ("mg_fake_bundled.utils",), "mg_fake_bundled", ">=2.0,<3"))
    assert verdict.allowed and verdict.version == "2.6.6", verdict
    assert verdict.source == "distribution mg_fake_bundle, which ships mg_fake_bundled"
    assert verdict.reason == "mg_fake_bundled 2.6.6 is inside >=2.0,<3"
    assert "mg_fake_bundled" not in sys.modules


def test_gate_refuses_when_the_shipping_distributions_disagree(installed: Path) -> None:
    _dist_info(installed, "mg_fake_one", "1.0", "mg_fake_shared")
    _dist_info(installed, "mg_fake_two", "2.0", "mg_fake_shared")
    verdict = targets.gate(Target("t", ("mg_fake_shared",), "mg_fake_shared", ">=0"))
    assert not verdict.allowed and "disagree on its version: mg_fake_one 1.0, mg_fake_two 2.0" in verdict.reason


def test_gate_refuses_a_package_its_own_and_another_distribution_disagree_on(installed: Path) -> None:
    """Both wheels installed: whichever came last is the code that runs, so neither version can be trusted."""
    _dist_info(installed, "mg_fake_own", "2.1.0", "mg_fake_own")
    _dist_info(installed, "mg_fake_bigger", "2.7.0", "mg_fake_bigger\nmg_fake_own")
    verdict = targets.gate(Target("t", ("mg_fake_own",), "mg_fake_own", ">=2,<3"))
    assert not verdict.allowed
    assert "disagree on its version: mg_fake_bigger 2.7.0, mg_fake_own 2.1.0" in verdict.reason


def test_unreadable_metadata_elsewhere_is_a_refusal_not_an_error(installed: Path) -> None:
    """A RECORD with a blank line makes importlib.metadata raise TypeError while scanning."""
    _dist_info(installed, "mg_fake_broken", "1.0")
    (installed / "mg_fake_broken-1.0.dist-info" / "RECORD").write_text("mg_fake_broken/__init__.py,,\n\n")
    verdict = targets.gate(Target("t", ("mg_fake_missing",), "mg_fake_missing", ">=0"))
    assert not verdict.allowed and verdict.reason.startswith("cannot read the installed metadata of 'mg_fake_missing'")


def test_gate_without_packages_distributions_reads_the_own_distribution(
        installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.9's importlib.metadata has no packages_distributions(): the own metadata still counts."""
    from importlib import metadata

    monkeypatch.delattr(metadata, "packages_distributions", raising=False)
    verdict = targets.gate(Target("t", ("mg_fake_release",), "mg_fake_release", ">=1,<2"))
    assert verdict.allowed and verdict.source == "distribution mg_fake_release", verdict


def test_gate_reads_version_of_an_imported_module_without_metadata(installed: Path) -> None:
    (installed / "mg_fake_bare").mkdir()
    (installed / "mg_fake_bare" / "__init__.py").write_text("__version__ = '0.7.1'\n")
    target = Target("t", ("mg_fake_bare",), "mg_fake_bare", ">=0.7,<1")
    before = targets.gate(target)
    assert not before.allowed and "distribution 'mg_fake_bare' is not installed" in before.reason
    import mg_fake_bare  # noqa: F401  # the library's own import; memgather never imports it

    try:
        after = targets.gate(target)
    finally:
        sys.modules.pop("mg_fake_bare", None)
    assert after.allowed and after.version == "0.7.1" and after.source == "mg_fake_bare.__version__", after


def test_builtin_registry_is_complete_data() -> None:
    names = {t.family_name for t in targets.BUILTIN}
    assert names == {"accelerate", "deepspeed", "transformers", "torchmetrics", "lightning", "open_clip", "mmengine",
                     "ignite", "monai"}
    for target in targets.BUILTIN:
        assert target.prefixes and target.distribution and target.versions and target.note
    lightning = targets.select(["lightning"])
    assert {p for t in lightning.targets for p in t.prefixes} == {"lightning", "lightning_fabric", "pytorch_lightning"}


@pytest.mark.parametrize(
    "module,expected",
    [("accelerate", "accelerate"), ("accelerate.utils.operations", "accelerate"), ("accelerated", None),
     ("mypkg.eval.metrics", "mypkg.eval"), ("mypkg.train", None), ("moco.builder", "moco")],
)
def test_match_by_module_prefix(module: str, expected: str) -> None:
    chosen = targets.select(["accelerate", "mypkg.eval", "moco"]).match(module)
    assert (chosen.name if chosen else None) == expected


def test_every_caller_but_memgather_itself() -> None:
    every = targets.select(["*"])
    assert every.match("anything.at.all").name == "*"
    assert every.match("memgather.engine.core") is None


def test_default_selection_is_every_builtin() -> None:
    assert targets.select(None).targets == targets.BUILTIN


def test_version_verdict_is_logged_when_the_library_is_imported(installed: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The gate runs from a post-import hook: nothing is imported early, the verdict shows on import."""
    import importlib

    import memgather

    info = installed / "mmengine-0.5.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mmengine\nVersion: 0.5.0\n")
    (installed / "mmengine").mkdir()
    (installed / "mmengine" / "__init__.py").write_text("")
    try:
        with caplog.at_level("INFO", logger="memgather"):
            memgather.patch(["mmengine"])
            assert "mmengine" not in sys.modules
            assert "leaves mmengine" not in caplog.text
            importlib.import_module("mmengine")
        assert "memgather leaves mmengine to torch: mmengine 0.5.0 is outside the tested range >=0.7,<1" in caplog.text
    finally:
        memgather.unpatch()
        sys.modules.pop("mmengine", None)
