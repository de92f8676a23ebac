"""One ``all_gather`` call, its arguments bound to torch's signature once.

Everything after ``bind`` reads the call's fields; where memgather leaves the
call to torch, torch receives the caller's own ``args`` and ``kwargs``, as the
caller wrote them (torch's exception logging reads them).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

# torch.distributed.all_gather's parameters, in order.
PARAMETERS = ("tensor_list", "tensor", "group", "async_op")


class Call(NamedTuple):
    """A call's arguments, and the settings it runs under."""

    tensor_list: Any
    tensor: Any
    group: Any
    async_op: Any
    args: Tuple[Any, ...]  # the caller's own positional arguments
    kwargs: Dict[str, Any]  # and keywords
    check: bool
    elide: bool
    verify: bool


# Builds a Call from one tuple of its fields, in order, without the NamedTuple's Python-level
# __new__: every call through the wrapper is bound, small ones (the most frequent) included.
_new = tuple.__new__


def bind(args: Tuple[Any, ...], kwargs: Dict[str, Any], check: bool, elide: bool, verify: bool) -> Optional[Call]:
    """The call, or None where torch's signature does not take its arguments (torch then raises
    its own TypeError, which memgather's keywords would word otherwise)."""
    count = len(args)
    if count == 2 and not kwargs:  # all_gather(tensor_list, tensor), as most callers write it
        return _new(Call, (args[0], args[1], None, False, args, kwargs, check, elide, verify))
    if count > 4 or count + len(kwargs) < 2 or (kwargs and not _binds(count, kwargs)):
        return None
    fields = (
        args[0] if count else kwargs["tensor_list"],
        args[1] if count > 1 else kwargs["tensor"],
        args[2] if count > 2 else kwargs.get("group"),
        args[3] if count > 3 else kwargs.get("async_op", False),
        args,
        kwargs,
        check,
        elide,
        verify,
    )
    return _new(Call, fields)


def _binds(count: int, kwargs: Dict[str, Any]) -> bool:
    """Keywords that name parameters not already given by position, the two required ones given."""
    return all(name in PARAMETERS[count:] for name in kwargs) and all(name in kwargs for name in PARAMETERS[count:2])
