"""Which function called: qualified names on real frames, and the name-following used before Python 3.11."""

from __future__ import annotations

import sys

import pytest

from memgather.patching import callers
from tests.sites import names


def test_qualified_names_tell_same_named_functions_apart() -> None:
    frames = names.frames()
    for qualname, frame in frames.items():
        for other in frames:
            assert callers.runs(frame, other) is (other == qualname), (qualname, other)


def test_names_followed_from_globals_find_exactly_the_running_code() -> None:
    """What runs() uses before Python 3.11, where code objects carry only their bare name."""
    frames = names.frames()
    for qualname, frame in frames.items():
        if callers.HAS_QUALNAME:
            assert frame.f_code.co_qualname == qualname  # the keys are what 3.11+ records
        for other in frames:
            found = callers.resolve(frame.f_globals, other)
            assert any(code is frame.f_code for code in found) is (other == qualname), (qualname, other)


def test_a_wrapper_without_wrapped_hides_its_function_from_the_names() -> None:
    """The limit before Python 3.11: such a function is not recognised (so it gets no default elision)."""
    frame = names.hidden()
    assert not any(code is frame.f_code for code in callers.resolve(frame.f_globals, "hidden"))
    assert callers.runs(frame, "hidden") is callers.HAS_QUALNAME


@pytest.mark.parametrize("qualname", ["", "missing", "one.<locals>", "Holder.missing", "outer.<locals>.missing.x"])
def test_names_that_lead_nowhere_find_nothing(qualname: str) -> None:
    assert callers.resolve(vars(names), qualname) == ()


def test_calling_frame_is_the_first_outside_the_plumbing() -> None:
    here = sys._getframe()
    assert callers.calling_frame(here) == (here, True)
    assert callers.module_of(here) == __name__
