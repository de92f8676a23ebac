"""Which frame of the stack is the caller's: the first one outside the plumbing.

Plumbing is wrapt (a wrapper's own Python frames, with its C extension off),
memgather itself and torch.distributed (``all_gather_object`` calls
``all_gather`` from inside it), and torch's autograd Function machinery. This
is the bottom of the walk ``memgather.patching.callers`` makes to decide
whether a call is a target's, and what verify mode names in its errors.
"""

from __future__ import annotations

from functools import lru_cache
from types import FrameType
from typing import Optional, Tuple

_PASSED = ("wrapt", "memgather", "torch.distributed", "torch.autograd.function")


@lru_cache(maxsize=4096)
def passed_through(module: str) -> bool:
    """Frames of these modules are plumbing, not the caller (cached: a walk asks it of every frame)."""
    return under(module, _PASSED)


def under(module: str, names: Tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``names`` or inside one of them."""
    return any(module == name or module.startswith(name + ".") for name in names)


def module_of(frame: FrameType) -> str:
    """The name of the module whose code ``frame`` runs ("" when it has none)."""
    return frame.f_globals.get("__name__", "")


def calling_frame(frame: Optional[FrameType]) -> Tuple[Optional[FrameType], bool]:
    """The first frame outside the plumbing, and whether ``frame`` itself was it.

    Verify mode names this frame in its errors; deciding whether to rewire goes on past
    Functions' forwards (``memgather.patching.callers.calling_frames``).
    """
    direct = True
    while frame is not None:
        if not passed_through(module_of(frame)):
            return frame, direct
        direct = False
        frame = frame.f_back
    return None, False
