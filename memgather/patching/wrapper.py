"""The type of memgather's wrapper around torch's all_gather.

A module of its own: the patcher makes the wrapper, and the proofs (``sites``) read
through it to the function it stands for, without importing the patcher.
"""

from __future__ import annotations

import wrapt


class MemgatherWrapper(wrapt.FunctionWrapper):
    """memgather's wrapper; its type is the "already patched" marker (torch's
    own functions already carry ``__wrapped__``)."""
