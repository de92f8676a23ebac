"""A call's plan, made in one place: strategy, route, agreement, or the reason to leave it to torch.

``plan`` is the only entry (steps 1 to 3 of docs/calls.md): first the cheap facts
that send a call to torch at once (a small call on a group seen before, a call
on ProcessGroupNCCL2 with no cat to elide), then the preconditions every rank
shares, the route (``routes``) and what this rank's slots allow on it
(``strategies``). The plan it returns is final unless it says the ranks must
agree: then ``agreement.settle`` alone may turn it into another. What depends
only on the group and the device type (the threshold, the routes) is worked
out once and kept (``group_facts``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

from memgather import compat, config
from memgather.engine import elision, group_facts, groups, kept, routes, slots
from memgather.engine.call import Call
from memgather.engine.group_facts import GroupFacts, lookup
from memgather.engine.plan import Plan, turned_away
from memgather.engine.reasons import Reason, Strategy
from memgather.engine.strategies import Outcome, choose, even, fill_in_slots, stage

_BELOW_THRESHOLD = turned_away(Reason.BELOW_THRESHOLD)


def configure(settings: config.Settings) -> None:
    """Take the thresholds of ``settings`` (``core.configure`` passes them on)."""
    group_facts.configure(settings)


def plan(call: Call, site: Optional[kept.Site] = None) -> Plan:
    """The call's plan: its strategy and route, whether the ranks agree first, or why torch takes it.

    ``site``: the call site's holder of a kept plan (``memgather.engine.kept``), where the call
    came through the wrapper: a plan made in full here is kept on it where it qualifies (its
    next calls take it, ``kept.reuse``, before they come here).

    The first lines recognise what certainly goes to torch from cheap facts.
    Small calls are the most frequent kind and the ones where memgather's own
    time shows (on gloo each microsecond of Python costs about two on the wall
    clock of a 4 KiB gather; on NCCL small calls save next to nothing: see
    routes, "NCCL threshold"), and calls on ProcessGroupNCCL2 whose cat is not
    elided are never rewired (torch fills the slots at the floor itself). That
    takes a group seen before and a plain input; anything else (a group not
    seen before, a subclass, a malformed list, another backend) is planned in
    full, and such a call too ends with the original all_gather.
    """
    tensor = call.tensor
    if type(tensor) is not torch.Tensor:
        return _plan(call)
    if compat.function_mode_active():
        # memgather's own reads of the input and the slots: no user's mode is to see them.
        with torch._C.DisableTorchFunction():
            known, gathered = _group_and_size(call, tensor)
    else:
        known, gathered = _group_and_size(call, tensor)
    if known is None:
        return _first_on_group(site, call, tensor)
    if call.check:
        return _kept(site, call, _plan(call), known)  # every call of check mode is planned: its ranks agree
    if known.unelided is not None and not call.elide:
        return turned_away(known.unelided)
    if gathered is not None and gathered < known.limit:
        return _BELOW_THRESHOLD
    return _kept(site, call, _plan(call, known, gathered), known)


def _kept(site: Optional[kept.Site], call: Call, made: Plan, known: GroupFacts) -> Plan:
    """``made``, kept on ``site`` for the site's next calls where it qualifies.

    ``known``: the group's facts, looked up before ``made`` was planned. A ``configure()`` in
    between gives the next call other facts, which then finds no plan kept: never one made under
    settings older than the facts it is kept with.
    """
    if site is not None:
        kept.keep(site, call, made, known)
    return made


def _first_on_group(site: Optional[kept.Site], call: Call, tensor: torch.Tensor) -> Plan:
    """The plan of a call on a group not described yet: made in full, where the group is described.

    Kept with the facts worked out then, where no ``configure()`` came between the planning and
    their lookup here (the thresholds read before and after are one object): else the facts
    found would be newer than the plan.
    """
    thresholds = group_facts.thresholds()
    made = _plan(call)
    if site is not None and not compat.function_mode_active():  # (keep() keeps nothing under a mode)
        known = lookup(call.group, tensor, None)
        if known is not None and group_facts.thresholds() is thresholds:
            kept.keep(site, call, made, known)
    return made


def _group_and_size(call: Call, tensor: torch.Tensor) -> Tuple[Optional[GroupFacts], Optional[int]]:
    """What the call's group takes on the input's device type (None: the group is not described
    yet; it is once a call on it was planned in full), and the slots' bytes."""
    known = lookup(call.group, tensor, None)
    if known is None:
        return None, None
    return known, _gathered_bytes(call.tensor_list, known.info.world)


def _plan(call: Call, known: Optional[GroupFacts] = None, gathered: Optional[int] = None) -> Plan:
    """The plan in full; ``known`` and ``gathered``: what the first lines found, if they found the group."""
    tensor_list, tensor, group, elide = call.tensor_list, call.tensor, call.group, call.elide
    reason = _precondition(tensor_list, tensor, group, known is not None)
    if reason is Reason.TORCH_FUNCTION and compat.torch_function_mode_only(tensor):
        return _under_function_mode(call)
    if reason is not None:
        return turned_away(reason)
    async_op = call.async_op
    if not (async_op is False or async_op is True or async_op is None) and compat.async_op_refused(async_op):
        # torch raises for it, where torch raises (setting up its call, or after its gather on old
        # releases): memgather must not have moved a slot first. Any other value goes by its truth.
        return turned_away(Reason.BAD_ARGUMENTS)
    # Slots armed or given by elision are memgather's own to look at: its checks must not set off their hooks.
    with compat.subclass_hooks_off():
        if known is None:
            known = lookup(group, tensor, groups.describe(group))
            assert known is not None  # given the group's description, it is worked out
            gathered = _gathered_bytes(tensor_list, known.info.world)
        info = known.info
        # Under the threshold no route is taken, so no rank agrees on one: decided before anything else.
        below = gathered is not None and gathered < known.limit
        # None for a malformed list, or where no route is known to be safe. The route every rank must
        # take is chosen from what they all share: elision, the size, and slots even with the input.
        if below or gathered is None:
            route = None
        elif elide and known.elided is not None and _plain_input(tensor) and even(tensor_list, tensor):
            route = known.elided
        else:
            route = known.single if async_op else known.synchronous
        refused = route is not None and known.dtypes is not None and tensor.dtype not in known.dtypes
        if refused:
            route = None  # torch raises for it before any rank meets another: nothing to agree on
        # A dispatch mode would see memgather's own operations (its checks among them), and one that
        # keeps what it sees would hold memgather's tensors: torch's call is what the mode expects.
        # Settled like a plan, in the exchange, so that ranks without the mode fall back too.
        watched = compat.dispatch_mode_active()
        outcome: Outcome
        if watched:
            outcome = Reason.DISPATCH_MODE
        elif below:
            outcome = Reason.BELOW_THRESHOLD
        elif refused:
            outcome = Reason.UNSUPPORTED_DTYPE
        else:
            outcome = _strategy(route, tensor_list, tensor, info, gathered, elide)
        if route is not None and route.every_rank and type(outcome) is Reason:
            outcome = stage(outcome, tensor_list, tensor)  # no rank may take torch's call alone
    agree = gathered is not None and (call.check or (route is not None and route.needs_agreement))
    if isinstance(outcome, Reason):
        return Plan(Strategy.FALLBACK, outcome, route, agree, info, gathered, watched)
    return Plan(outcome, None, route, agree, info, gathered, watched)


def _strategy(
    route: Optional[routes.Route],
    tensor_list: Any,
    tensor: torch.Tensor,
    info: groups.GroupInfo,
    gathered: Optional[int],
    elide: bool,
) -> Outcome:
    """What this rank's slots and input allow on ``route``."""
    if gathered is not None and route is None:
        return Reason.NCCL2 if _on_nccl2(info, tensor) else Reason.BACKEND
    if route is not None and route.contiguous_input_only and not tensor.is_contiguous():
        return Reason.INPUT_NOT_CONTIGUOUS
    outcome = choose(tensor_list, tensor, info.world, info.rank)  # a malformed call gets its precise reason here
    if route is None or type(outcome) is Reason and not route.in_place:
        return outcome
    if type(outcome) is Reason:
        return fill_in_slots(tensor_list, tensor, info.rank, outcome)
    if outcome is Strategy.DIRECT:
        # Slots that alone tile one buffer (those of an earlier rebind, gathered into again)
        # are that buffer's views already: armed like a rebind's, with no new buffer.
        return Strategy.ARMED_DIRECT if elide and slots.tile_their_storage(tensor_list) else outcome
    if route.in_place and not elide and not elision.any_given(tensor_list):
        return Strategy.IN_SLOTS  # nothing to concatenate afterwards: fill the slots where they lie
    # Plain CPU slots are released without a step of their version counters (slots.rebind).
    return Strategy.PARKED_REBIND if slots.parkable(tensor_list) else outcome


def _under_function_mode(call: Call) -> Plan:
    """A ``TorchFunctionMode`` of this rank's own is not a fact every rank shares: where the ranks
    must take one route alike, it must not send this rank to torch's call alone. The call is planned
    as if the mode were not there; then, on a route every rank takes (ProcessGroupNCCL2), it is
    staged under the mode (which sees memgather's own calls); elsewhere the mode gets torch's call,
    and where the ranks agree first (check mode, an agreed route) that fallback is settled in the
    exchange (run outside the mode), so that the others fall back with it."""
    with torch._C.DisableTorchFunction():
        planned = _plan(call)
    route = planned.route
    if route is not None and route.every_rank:
        return planned._replace(strategy=Strategy.STAGED) if planned.rewires else planned
    if planned.gathered is not None:
        # Kept with its route: where the ranks agree first (check mode, an agreed route), this
        # rank's fallback is settled in the exchange, outside the mode; elsewhere torch's call
        # meets the others' single call on the wire.
        return planned._replace(strategy=Strategy.FALLBACK, reason=Reason.TORCH_FUNCTION, watched=True)
    return turned_away(Reason.TORCH_FUNCTION)


def small_single(out: torch.Tensor, tensor: torch.Tensor, group: Any) -> Optional[routes.Route]:
    """The single-tensor route gather() takes into ``out`` at once, if any: a small gather on a
    gloo or legacy NCCL group, where all_gather's preconditions hold (gather() checked the group)."""
    if type(tensor) is not torch.Tensor:
        return None
    # Before the group is described: a group torch no longer lists cannot be. Coalescing, graph
    # capture, a transform...: as all_gather.
    if _precondition([], tensor, group) is not None:
        return None
    known = lookup(group, tensor, groups.describe(group))
    assert known is not None  # given the group's description, it is worked out
    if not out.numel() * out.element_size() < known.limit:
        return None
    route = known.single
    if route is not None and route.contiguous_input_only and not tensor.is_contiguous():
        return None  # NCCL reads the input as raw memory: torch's list call takes any
    return route


def _on_nccl2(info: groups.GroupInfo, tensor: torch.Tensor) -> bool:
    """A CUDA tensor on a group whose NCCL backend is ProcessGroupNCCL2 (see routes, "NCCL threshold")."""
    return info.nccl == "nccl2" and tensor.is_cuda


def _plain_input(tensor: torch.Tensor) -> bool:
    """An input every rank of a working program gathers alike: a dense, non-empty tensor (a subclass
    that does not override ``__torch_function__``, such as ``nn.Parameter``, included)."""
    return (
        tensor.layout is torch.strided
        and tensor.numel() > 0
        and not (tensor.is_quantized or tensor.is_conj() or tensor.is_neg())
    )


def _precondition(tensor_list: Any, tensor: Any, group: Any, described: bool = False) -> Optional[Reason]:
    """Reasons to stay out that hold alike on every rank of the group.

    ``described``: the group was described before, which only a call that passed these checks
    does; what they tell of the group object itself (a group, this rank in it) holds still.
    """
    if not isinstance(tensor, torch.Tensor):
        return Reason.NOT_A_TENSOR
    if has_torch_function((tensor,)) and not compat.only_device_modes(tensor):
        return Reason.TORCH_FUNCTION
    if tensor.is_meta:
        # No data: nothing to lay out, and no exchange for check mode either (its rows would be meta
        # tensors too). torch's call does with it whatever it does.
        return Reason.BACKEND
    if compat.is_compiling():
        return Reason.COMPILING
    if tensor.is_cuda and compat.graph_capturing():
        # Check and verify modes read results on the host, a rebind allocates (from the graph's
        # private pool, for every replay to reuse) and frees memory from before capture: torch's
        # own call is what capture records safely. Every rank captures the same program.
        return Reason.GRAPH_CAPTURE
    if compat.functorch_active() or compat.functorch_wrapped(tensor, tensor_list if type(tensor_list) is list else ()):
        return Reason.FUNCTORCH
    if compat.forward_ad_active():
        return Reason.FORWARD_AD
    if compat.unregistered_group(group):
        # Described before, perhaps: what was learned of it holds, but its ranks can no longer be
        # named. torch's call runs on the object, with a default group or without one.
        return Reason.UNREGISTERED_GROUP
    if not dist.is_initialized():
        return Reason.NOT_INITIALIZED
    if not described:
        if compat.not_a_group(group):
            return Reason.BAD_ARGUMENTS  # torch fails on it in its own way
        if compat.rank_not_in_group(group):
            return Reason.NOT_IN_GROUP
    if compat.is_coalescing(group):
        return Reason.COALESCING
    if compat.single_tensor_primitive().function is None:
        return Reason.NO_PRIMITIVE
    return None


def _gathered_bytes(tensor_list: Any, world: int) -> Optional[int]:
    """Total bytes of the slots, or None unless they are a list of ``world`` tensors.

    In any program that works under torch this is the same on every rank, so
    decisions made from it cannot split the ranks.
    """
    if type(tensor_list) is not list or len(tensor_list) != world:
        return None
    total = 0
    for slot in tensor_list:
        if type(slot) is torch.Tensor:
            total += slot.numel() * slot.element_size()
        elif isinstance(slot, torch.Tensor):
            total += compat.nbytes(slot)  # a subclass's hook must not see memgather's reads
        else:
            return None
    return total
