"""A call site's plan, kept for its next call: what cannot change between two calls, proven once.

A loop gathers from one call site call after call with the same group, the same
input shape, dtype and device, and the same settings, into fresh slots. Most
of what ``planner.plan`` proves for such a call rests on those alone: the
group's preconditions and description, its threshold and route, the dtype its
backend takes, the gathered size. So the plan of a call that rebinds fresh CPU
slots is kept on its call site (``Site``), with the facts it rests on
(``Kept``), and a later call from the site takes it where ``reuse`` finds them
all unchanged:

- the key: the group's facts (``group_facts.lookup`` gives another object for
  another group, a destroyed default group, or after ``configure()``: new
  settings; they hold the group weakly, so a kept plan keeps no group alive),
  the input's type, shape, dtype and dispatch keys,
  ``async_op``, the call's check / elide / verify, and inference mode;
- what can change between two calls of one key: a torch-function or dispatch
  mode, compiling, a coalescing block, the group dropped from torch's table,
  and every fact of every slot that a rebind rests on (``strategies.rebinds_as_kept``:
  a plain ``torch.Tensor``, so neither armed nor handed out by elision; ownership,
  storage use counts, memory kind, layout, dtype, shape, grad, contiguity, aliasing).

Anything else, and any fact found changed, gets the plan made in full, which
is kept anew where it qualifies. CUDA calls are always planned in full: their
slots' allocator facts are read there. ``patch()`` and ``unpatch()`` drop every
site (``patcher``), and so every kept plan.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from memgather import compat
from memgather.engine import strategies
from memgather.engine.call import Call
from memgather.engine.group_facts import GroupFacts, lookup
from memgather.engine.plan import Plan
from memgather.engine.reasons import Strategy

# The outcomes a kept plan may have: each rests on choose() answering REBIND for fresh slots.
_KEPT_STRATEGIES = frozenset((Strategy.REBIND, Strategy.IN_SLOTS))


class Kept(NamedTuple):
    """A plan made in full, and the facts it rests on that stay fixed from call to call."""

    plan: Plan
    facts: GroupFacts  # the group's, as lookup() gave them (they hold the group weakly: a kept plan must not keep it)
    world: int
    shape: torch.Size
    dtype: torch.dtype
    keys: Any  # the input's dispatch keys
    slot_keys: Any  # the first slot's
    async_op: Any  # True, False or None
    check: bool
    elide: bool
    verify: bool
    inference: bool  # inference mode when the plan was made


class Site:
    """One call site's kept plan (None: none yet). One object per call site, held by the patcher."""

    __slots__ = ("kept",)

    def __init__(self) -> None:
        self.kept: Optional[Kept] = None


def reuse(site: Site, call: Call) -> Optional[Plan]:
    """The site's kept plan, where every fact it rests on holds for ``call``; else None."""
    kept = site.kept
    if kept is None:
        return None
    tensor = call.tensor
    if not (
        type(tensor) is torch.Tensor
        and call.async_op is kept.async_op
        and call.check is kept.check
        and call.elide is kept.elide
        and call.verify is kept.verify
        and tensor.dtype is kept.dtype
        and tensor.shape == kept.shape
        and type(call.tensor_list) is list
        and len(call.tensor_list) == kept.world
    ):
        return None
    if (
        compat.function_mode_active()
        or compat.dispatch_mode_active()
        or compat.is_compiling()
        or torch.is_inference_mode_enabled() is not kept.inference
        or compat.dispatch_keys(tensor) != kept.keys  # type: ignore[misc]  # present: kept plans need it
        or lookup(call.group, tensor, None) is not kept.facts
        or compat.unregistered_group(call.group)
        or compat.is_coalescing(call.group)
    ):
        return None
    if not strategies.rebinds_as_kept(call.tensor_list, tensor, kept.shape, kept.slot_keys):
        return None
    return kept.plan


def keep(site: Site, call: Call, plan: Plan) -> None:
    """Keep ``plan``, just made in full for ``call``, on ``site`` where its facts qualify it."""
    tensor, tensor_list = call.tensor, call.tensor_list
    if (
        plan.strategy not in _KEPT_STRATEGIES
        or plan.watched
        or compat.dispatch_keys is None
        or not compat.can_prove_exclusive()
        or type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or type(tensor_list) is not list
        or len(tensor_list) < 2
        or not (call.async_op is True or call.async_op is False or call.async_op is None)
        or compat.function_mode_active()
        or compat.dispatch_mode_active()
    ):
        site.kept = None
        return
    facts = lookup(call.group, tensor, None)
    keys = compat.dispatch_keys(tensor)
    slot_keys = compat.dispatch_keys(tensor_list[0])
    if facts is None or not strategies.rebinds_as_kept(tensor_list, tensor, tensor.shape, slot_keys):
        site.kept = None  # choose() said REBIND by another way (IN_SLOTS by fill_in_slots): not kept
        return
    site.kept = Kept(
        plan,
        facts,
        len(tensor_list),
        tensor.shape,
        tensor.dtype,
        keys,
        slot_keys,
        call.async_op,
        call.check,
        call.elide,
        call.verify,
        torch.is_inference_mode_enabled(),
    )
