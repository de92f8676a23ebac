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
