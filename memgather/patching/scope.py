"""The explicit opt-out: ``memgather.disabled()``.

A ContextVar, so the opt-out is confined to the thread or asyncio task that
entered it, and nests.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

_depth: ContextVar[int] = ContextVar("memgather_disabled_depth", default=0)


@contextmanager
def disabled() -> Iterator[None]:
    """Leave every all_gather in this block (or decorated function) to torch.

    Usable as ``with memgather.disabled():`` and as ``@memgather.disabled()``;
    affects only the current thread / asyncio task, and nests.
    """
    token = _depth.set(_depth.get() + 1)
    try:
        yield
    finally:
        _depth.reset(token)


def is_disabled() -> bool:
    """Whether the current context is inside ``disabled()``."""
    return _depth.get() > 0
