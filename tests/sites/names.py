"""Functions that share a bare name in different places; each returns its own frame (tests/test_callers.py).

Imports nothing heavy, so the name matching can be tried on any Python.
"""

import functools
import sys
from types import FrameType
from typing import Any, Callable, Dict


def _frame() -> FrameType:
    return sys._getframe(1)


def one() -> FrameType:
    return _frame()


def outer() -> FrameType:
    def one() -> FrameType:
        return _frame()

    return one()


def other_outer() -> FrameType:
    def one() -> FrameType:
        return _frame()

    return one()


def _decorate(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)  # sets __wrapped__: the original can be followed
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


def _opaque(function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:  # no __wrapped__: the original cannot be followed
        return function(*args, **kwargs)

    return wrapper


@_decorate
def decorated() -> FrameType:
    def one() -> FrameType:
        return _frame()

    return one()


@_opaque
def hidden() -> FrameType:
    return _frame()


class Holder:
    def one(self) -> FrameType:
        return _frame()

    @staticmethod
    def static() -> FrameType:
        return _frame()

    @classmethod
    def klass(cls) -> FrameType:
        return _frame()


def factory() -> FrameType:
    class Local:
        def one(self) -> FrameType:
            return _frame()

    return Local().one()


def frames() -> Dict[str, FrameType]:
    """Each function's frame, keyed by the qualified name Python 3.11+ gives its code."""
    return {
        "one": one(),
        "outer.<locals>.one": outer(),
        "other_outer.<locals>.one": other_outer(),
        "decorated.<locals>.one": decorated(),
        "Holder.one": Holder().one(),
        "Holder.static": Holder.static(),
        "Holder.klass": Holder.klass(),
        "factory.<locals>.Local.one": factory(),
    }
