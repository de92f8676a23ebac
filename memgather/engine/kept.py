"""A call site's plan, kept for its next call: what cannot change between two calls, proven once.

A loop gathers from one call site call after call with the same group, the same
input shape, dtype and device, and the same settings, into fresh slots (or into
views of one buffer kept across steps, as DeepSpeed's). Most of what
``planner.plan`` proves for such a call rests on those alone: the group's
preconditions and description, its threshold and route, the dtype its backend
takes, the gathered size. So the plan of a CPU call that rebinds fresh slots,
fills them in place, or gathers directly into views of one buffer is kept on its
call site (``Site``), with the facts it rests on (``Kept``), and a later call
from the site takes it where ``reuse`` finds them all unchanged:

- the key: the group's facts (``group_facts.lookup`` gives another object for
  another group, a destroyed default group, or after ``configure()``: new
  settings; they hold the group weakly, so a kept plan keeps no group alive),
  the input's type, shape, dtype and dispatch keys,
  ``async_op``, the call's check / elide / verify, and inference mode;
- what can change between two calls of one key: a torch-function or dispatch
  mode, compiling, a coalescing block, the group dropped from torch's table,
  and every fact of every slot that the kept strategy rests on, read in one call
  (``strategies.rebinds_as_kept``: a plain ``torch.Tensor``, so neither armed nor
  handed out by elision; ownership, storage use counts, memory kind, layout,
  dtype, shape, grad, contiguity, aliasing; ``strategies.direct_as_kept``: the
  same metadata, adjacency in one storage, and the input clear of the region).
  Where the call site's code proves the slots new tensors made like the input
  (``memgather.patching.proof.slots_like_input``, checked by the wrapper), a rebind
  of a contiguous input spares the two reads only code the proof cannot see could make
  wrong (``strategies.made_like_as_kept``).

The slots' version counters are read in that call, and handed on with the plan
(``Taken``) to the writer, which sets them as torch's call leaves them; but for a
parked rebind (plain CPU slots, ``slots.rebind``), whose counters end as torch's with
nothing read or set, and whose calls the wrapper takes straight to the writer
(``core.rewire_kept``, through ``holds``). Anything else, and any fact found changed,
gets the plan made in full, which is kept anew where it qualifies. CUDA calls are
always planned in full: their slots' allocator facts are read there. A site is one
place a call is made from (``Sites``); ``patch()`` and ``unpatch()`` drop every site
(``patcher``), and so every kept plan.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch

from memgather import compat
from memgather.engine import strategies
from memgather.engine.call import Call
from memgather.engine.group_facts import GroupFacts, entry
from memgather.engine.plan import Plan
from memgather.engine.reasons import Strategy

# A per-call check of the slots (strategies): whether choose() answers the outcome a kept plan rests on,
# given as the slots' version counters, read with them (None: it may not).
SlotCheck = Callable[[list, torch.Tensor, torch.Size, Any, int, bool], Optional[List[int]]]
# The plans kept, by strategy, and the check each rests on: REBIND and IN_SLOTS (fresh slots on gloo's
# broadcasts) on choose() answering REBIND, DIRECT on its answering DIRECT (slots that are views of one
# buffer, as DeepSpeed's).
_CHECKS: Dict[Strategy, SlotCheck] = {
    Strategy.REBIND: strategies.rebinds_as_kept,
    Strategy.PARKED_REBIND: strategies.rebinds_as_kept,
    Strategy.IN_SLOTS: strategies.rebinds_as_kept,
    Strategy.DIRECT: strategies.direct_as_kept,
}


class Kept(NamedTuple):
    """A plan made in full, and the facts it rests on that stay fixed from call to call."""

    plan: Plan
    slots_checked: SlotCheck  # what choose() must answer for the slots, read in one call
    facts: GroupFacts  # the group's, as lookup() gave them (they hold the group weakly: a kept plan must not keep it)
    world: int
    rank: int
    shape: torch.Size
    dtype: torch.dtype
    keys: Any  # the input's dispatch keys
    slot_keys: Any  # the first slot's
    # The check reads the slots' version counters: they have some (not inference tensors), to be set
    # back (not a parked rebind's).
    versioned: bool
    rebinds: bool  # the plan rests on choose() answering REBIND (rebinds_as_kept): a rebind, or in_slots
    async_op: Any  # True, False or None
    check: bool
    elide: bool
    verify: bool
    inference: bool  # inference mode when the plan was made
    # A parked rebind with nothing to agree or verify: its calls of the form all_gather(tensor_list, tensor)
    # are taken from the wrapper straight to the writer (``core.rewire_kept``).
    direct_call: bool


class Taken(NamedTuple):
    """A kept plan taken for one call, with what its re-check read on the way."""

    plan: Plan
    versions: List[int]  # the slots' version counters, as read (empty: none to set back, ``core._rewire``)
    untracked: bool  # the input does not require grad: nothing memgather does can record autograd history


# Builds a Taken without the NamedTuple's Python-level __new__ (call.py's Call is built so too).
_new = tuple.__new__


class Site:
    """One call site's kept plan (None: none yet), and its cat-elision verdict.

    ``elision`` is ``memgather.patching.sites``' to hold: the verdict of the call site's code (with
    the instruction offset and globals it was proven for, and the bindings it rests on), so that a gatherer's
    next call reads it here rather than looking it up by its chain of frames.
    """

    __slots__ = ("kept", "elision")

    def __init__(self) -> None:
        self.kept: Optional[Kept] = None
        self.elision: Optional[Tuple[int, Any, Any, Any]] = None


# A code's call sites held at most: the calls of a code that gathers from more places than
# this share one site past them (as if they were one place: a kept plan where they repeat
# one another, full plans where they differ).
_MAX_SITES = 64


class Sites:
    """The call sites of one caller's code, each with its own kept plan, held by the patcher.

    A site is named by where the call is made (``at``: the calling frame's
    ``f_lasti``, its instruction's offset, and past plumbing those of the frames
    it was made for), not by the code alone: a function that gathers two shapes
    from two lines keeps a plan for each, where one holder would plan both calls
    in full, each finding the other's plan kept.
    """

    __slots__ = ("_by_place", "_beyond")

    def __init__(self) -> None:
        self._by_place: Dict[Hashable, Site] = {}
        self._beyond = Site()  # the places past _MAX_SITES

    def at(self, place: Hashable) -> Site:
        """The site made at ``place``, created where there is none yet."""
        site = self._by_place.get(place)
        if site is None:
            if len(self._by_place) >= _MAX_SITES:
                return self._beyond
            site = self._by_place[place] = Site()  # two threads may both create one: one plan is lost, no more
        return site


def reuse(site: Site, call: Call, made_like: bool = False) -> Optional[Taken]:
    """The site's kept plan, where every fact it rests on holds for ``call``; else None.

    ``call`` came through the wrapper (the only caller with a site), which found no compilation
    under way. ``made_like``: the site's code proves the slots new tensors made like the input
    (``memgather.patching.proof.slots_like_input``); for a rebind of a contiguous input, each
    slot is then read for all but two facts (``strategies.made_like_as_kept``).
    """
    kept = site.kept
    if kept is None:
        return None
    tensor = call.tensor
    versions = holds(
        kept, call.tensor_list, tensor, call.group, call.async_op, call.check, call.elide, call.verify, made_like
    )
    if versions is None:
        return None
    return _new(Taken, (kept.plan, versions, not tensor.requires_grad))


def holds(
    kept: Kept,
    tensor_list: Any,
    tensor: Any,
    group: Any,
    async_op: Any,
    check: bool,
    elide: bool,
    verify: bool,
    made_like: bool,
) -> Optional[List[int]]:
    """Whether every fact ``kept`` rests on holds for a call of these arguments and settings (``reuse``):
    the slots' version counters its check read (empty: none to set back, ``core._rewire``), or None."""
    if not (
        type(tensor) is torch.Tensor
        and async_op is kept.async_op
        and check is kept.check
        and elide is kept.elide
        and verify is kept.verify
        and type(tensor_list) is list
        and len(tensor_list) == kept.world
    ):
        return None
    # Before any read of the tensors: a user's mode would see memgather's reads (and may refuse them).
    if compat.function_mode_active() or compat.dispatch_mode_active():
        return None
    if not (tensor.dtype is kept.dtype and tensor.shape == kept.shape):
        return None
    if group is None:
        pg = compat.default_group()
    elif compat.unregistered_group(group):
        return None
    else:
        pg = group
    facts = kept.facts
    # (Not compiling: the wrapper, the only caller with a site, asked on its way here.) The group's
    # facts are what lookup() would give: the same group, its entry not dropped by a configure().
    # The keys are equal only where the input is on the CPU, as when the plan was kept: its entry's.
    if (
        compat.functorch_active()
        or compat.forward_ad_active()
        or torch.is_inference_mode_enabled() is not kept.inference
        or not compat.dispatch_keys(tensor) == kept.keys  # type: ignore[misc]  # present: kept plans need it
        or facts.group() is not pg
        or entry((id(pg), "cpu")) is not facts
        or compat.is_coalescing(group)
    ):
        return None
    contiguous = tensor.is_contiguous()
    route = kept.plan.route
    if not contiguous and route is not None and route.contiguous_input_only:
        return None  # the route reads the input as raw memory (legacy NCCL's): planned in full
    if made_like and contiguous and kept.rebinds:
        return strategies.made_like_as_kept(tensor_list, tensor, kept.shape, kept.slot_keys, kept.versioned)
    return kept.slots_checked(tensor_list, tensor, kept.shape, kept.slot_keys, kept.rank, kept.versioned)


def keep(site: Site, call: Call, plan: Plan, facts: GroupFacts) -> None:
    """Keep ``plan``, just made in full for ``call``, on ``site`` where its facts qualify it.

    ``facts``: the group's, looked up before ``plan`` was made (``lookup`` gives a later call
    other ones after a ``configure()``: never the older plan).
    """
    tensor, tensor_list = call.tensor, call.tensor_list
    checked = _CHECKS.get(plan.strategy)
    if (
        checked is None
        or plan.info is None
        or plan.watched
        or compat.dispatch_keys is None
        or not compat.can_prove_exclusive()
        or type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or type(tensor_list) is not list
        or not tensor_list
        or not (call.async_op is True or call.async_op is False or call.async_op is None)
        or compat.function_mode_active()
        or compat.dispatch_mode_active()
        # Elided, DIRECT is kept only where its slots did not tile their storage (else ARMED_DIRECT),
        # which a later call's slots may: planned in full.
        or (plan.strategy is Strategy.DIRECT and call.elide)
    ):
        site.kept = None
        return
    keys = compat.dispatch_keys(tensor)
    slot_keys = compat.dispatch_keys(tensor_list[0])
    versioned = not tensor_list[0].is_inference() and not plan.leaves_counters
    if checked(tensor_list, tensor, tensor.shape, slot_keys, plan.info.rank, versioned) is None:
        site.kept = None  # choose() answered otherwise (IN_SLOTS by fill_in_slots, DIRECT armed...): not kept
        return
    site.kept = Kept(
        plan,
        checked,
        facts,
        len(tensor_list),
        plan.info.rank,
        tensor.shape,
        tensor.dtype,
        keys,
        slot_keys,
        versioned,
        checked is strategies.rebinds_as_kept,
        call.async_op,
        call.check,
        call.elide,
        call.verify,
        torch.is_inference_mode_enabled(),
        plan.strategy is Strategy.PARKED_REBIND and not plan.agree and not call.verify,
    )
