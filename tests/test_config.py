"""Environment variables to settings: values accepted, and errors that name the variable."""

from __future__ import annotations

import pytest

from memgather import config


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("ON", True), (" yes ", True),
                                            ("0", False), ("false", False), ("off", False), ("", False)])
def test_check_values(value: str, expected: bool) -> None:
    assert config.load({"MEMGATHER_CHECK": value}).check is expected


def test_unset_means_defaults() -> None:
    assert config.load({}) == config.Settings()


def test_bad_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"MEMGATHER_CHECK='maybe' is not a boolean"):
        config.load({"MEMGATHER_CHECK": "maybe"})


def test_every_variable_parses() -> None:
    settings = config.load({
        "MEMGATHER": "1", "MEMGATHER_TARGETS": "accelerate, moco,", "MEMGATHER_CHECK": "yes", "MEMGATHER_FORCE": "1",
        "MEMGATHER_VERIFY": "on", "MEMGATHER_ELIDE": "0", "MEMGATHER_GLOO_MIN_BYTES": "0", "MEMGATHER_HUGE_PAGES": "off",
        "MEMGATHER_NCCL_MIN_BYTES": "4096", "MEMGATHER_LOG": "debug", "MEMGATHER_REPORT": "all",
        "MEMGATHER_GLOO_ROUTE": " Ring ",
    })
    assert settings == config.Settings(
        enabled=True, targets=("accelerate", "moco"), check=True, force=True, verify=True, elide=False,
        gloo_min_bytes=0, nccl_min_bytes=4096, huge_pages=False, log_level=10, report="all", gloo_route="ring")


@pytest.mark.parametrize("name,value,message", [
    ("MEMGATHER", "maybe", "MEMGATHER='maybe' is not a boolean"),
    ("MEMGATHER_GLOO_MIN_BYTES", "2MiB", "MEMGATHER_GLOO_MIN_BYTES='2MiB' is not a number of bytes"),
    ("MEMGATHER_NCCL_MIN_BYTES", "-1", "MEMGATHER_NCCL_MIN_BYTES='-1' is not a number of bytes"),
    ("MEMGATHER_REPORT", "loud", "MEMGATHER_REPORT='loud': use 1 (rank 0), all (every rank) or 0"),
    ("MEMGATHER_LOG", "LOUD", "MEMGATHER_LOG='LOUD' is not a logging level"),
    ("MEMGATHER_GLOO_ROUTE", "tree", "MEMGATHER_GLOO_ROUTE='tree': use auto, broadcast or ring"),
])
def test_bad_values_name_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        config.load({name: value})
    assert message in str(error.value)
