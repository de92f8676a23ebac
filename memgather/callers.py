"""Who called all_gather: the first frame outside wrapt, memgather and torch.distributed.

With wrapt's C extension the wrapper's caller is one frame up; with
``WRAPT_DISABLE_EXTENSIONS=1`` wrapt's own Python frames sit in between, and
``all_gather_object`` calls all_gather from inside torch.distributed. Walking
past all three finds the module that really asked for the gather.
"""

from __future__ import annotations

from types import FrameType
from typing import Optional, Tuple

_PASSED = ("wrapt", "memgather", "torch.distributed")


def passed_through(module: str) -> bool:
    """Frames of these modules are plumbing, not the caller."""
    return any(module == name or module.startswith(name + ".") for name in _PASSED)


def calling_module(frame: Optional[FrameType]) -> Tuple[Optional[str], bool]:
    """The caller's module name, and whether ``frame`` itself was the caller.

    Only a decision made from a frame that was itself the caller may be cached
    by that frame's code object: plumbing code is shared by every caller.
    """
    direct = True
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not passed_through(module):
            return module, direct
        direct = False
        frame = frame.f_back
    return None, False
