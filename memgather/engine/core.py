"""memgather's all-gather: the per-call path, top to bottom.

    all_gather(tensor_list, tensor, ...)      memgather's own entry; the wrapper binds a caller's call
      (rewire_kept                            a loop's call whose call site keeps a parked rebind: its
                                              facts checked (kept.holds), straight to the writer)
      -> call.bind                            the arguments, bound to torch's signature once
      -> kept.reuse                           a call site's kept plan, where every fact it rests on holds
      or planner.plan                         else the plan in full: strategy, route, agreement, or the
                                              reason to leave (kept on the call site where it qualifies)
      -> agreement.poll / agreement.settle    where the plan says so: the ranks' one small exchange,
                                              and the only step that may turn the plan into another
      -> _WRITERS[plan.strategy]              carried out: lay out the output (slots), move the bytes
                                              (routes), count it (counters); an async call's work
                                              wrapped (works.SlotsWork) to answer with the slots
      or to_torch                             the original torch.distributed.all_gather, unchanged

Whatever memgather cannot prove safe goes to torch as the caller wrote it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from memgather import compat, config
from memgather.engine import (
    agreement,
    counters,
    elision,
    kept,
    pages,
    planner,
    routes,
    slots,
    staged,
    uneven,
    verification,
    works,
)
from memgather.engine.call import Call, bind
from memgather.engine.plan import Plan
from memgather.engine.reasons import Reason, Strategy

_log = logging.getLogger("memgather")

# Captured before anything can patch it: memgather's fallback and its own
# metadata exchange must never re-enter a wrapper around all_gather.
_original_all_gather = dist.distributed_c10d.all_gather

# The name of the range a profiler shows around each call memgather handles.
PROFILER_RANGE = "memgather::all_gather"

_settings = config.Settings()


def configure(settings: Optional[config.Settings] = None) -> None:
    """Take ``settings`` (default: the environment, read now) as the defaults of every later call.

    Read from the environment once at import; ``patch()`` / ``unpatch()`` hand over the settings
    they run under, so that what ``patch()`` was given reaches direct calls too. The per-call
    path itself reads no environment variable.
    """
    global _settings
    _settings = config.load() if settings is None else settings
    planner.configure(_settings)


def settings() -> config.Settings:
    """The settings later calls run under."""
    return _settings


configure()


def original_all_gather() -> Any:
    """The ``torch.distributed.all_gather`` memgather falls back to."""
    return _original_all_gather


def all_gather(
    tensor_list: List[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    check: Optional[bool] = None,
    elide: Optional[bool] = None,
    verify: Optional[bool] = None,
) -> Any:
    """Drop-in for ``torch.distributed.all_gather``, gathering into one flat buffer.

    Same arguments, results and return value as torch's ``all_gather``. When
    the slots in ``tensor_list`` are even (each shaped, typed and placed like
    ``tensor``) and memgather can prove it safe, they end up as adjacent views
    of one buffer (the tensor objects are kept; only their storage changes),
    filled by a single collective. Otherwise the original runs unchanged.

    ``check`` (default: ``MEMGATHER_CHECK``) adds one small collective that
    raises ``UnevenShapesError`` on every rank when the ranks' inputs differ
    while the slots are even. ``elide`` (default: ``MEMGATHER_ELIDE``, else
    off) lets a following ``torch.cat(tensor_list)`` / ``torch.stack`` return
    the gathered buffer itself instead of a copy: only for code that drops
    the list after concatenating it (see ``memgather.engine.elision``). ``verify``
    (default: ``MEMGATHER_VERIFY``) runs the original again for every rewired
    call and raises ``VerifyError`` on every rank if the results differ (see
    ``memgather.engine.verification``: for test runs).
    """
    defaults = _settings
    return handle(
        Call(
            tensor_list,
            tensor,
            group,
            async_op,
            (tensor_list, tensor),
            {"group": group, "async_op": async_op},
            defaults.check if check is None else check,
            bool(defaults.elide) if elide is None else elide,
            defaults.verify if verify is None else verify,
        )
    )


def handle(call: Call, site: Optional[kept.Site] = None, made_like: bool = False, reuse: bool = True) -> Any:
    """Carry out one bound call: plan it, agree where the plan says so, execute the plan.

    ``site``: the call site's holder of a kept plan (``memgather.engine.kept``), where the
    call came through the wrapper. Its plan is taken where every fact it rests on holds, with
    the slots' version counters its re-check read; else the call is planned in full, and the
    plan kept on the site where it qualifies. ``made_like``: the site's code proves the slots
    new tensors made like the input (``kept.reuse``). ``reuse=False``: the site's kept plan was found
    not to hold already (``rewire_kept``): planned in full.
    """
    elision.disarm_reused(call.tensor_list)  # slots armed by an earlier gather are plain again first
    taken = kept.reuse(site, call, made_like) if site is not None and reuse else None
    if taken is None:
        plan = planner.plan(call, site)
        if plan.info is None:  # turned away before its group and slots were looked at: most calls, small ones
            return to_torch(plan.reason, call.args, call.kwargs)
    else:
        plan = taken.plan
        if not plan.agree and not compat.profiler_enabled():  # a loop's calls: straight to the writer
            return _rewire(plan, call, taken.versions, taken.untracked)
    if compat.profiler_enabled():
        # One range in a profile for each call memgather planned: its collectives, or
        # torch's call where it falls back, show inside it.
        with torch.autograd.profiler.record_function(PROFILER_RANGE):
            return _agree_and_execute(plan, call, taken)
    return _agree_and_execute(plan, call, taken)


# What ``rewire_kept`` answers for a call it does not carry out.
NOT_TAKEN = object()


def rewire_kept(site: kept.Site, args: Tuple[Any, Any], check: bool, elide: bool, verify: bool, made_like: bool) -> Any:
    """``all_gather(tensor_list, tensor)`` (``args``, as the caller passed them) from ``site``, carried
    out by its kept parked rebind where every fact the plan rests on holds (``kept.holds``), else
    planned in full; ``NOT_TAKEN`` where the site keeps no such plan (the wrapper then binds the call
    and hands it to ``handle``).

    A loop's call, from the wrapper straight to the writer: a plan kept with nothing to agree or
    verify (``Kept.direct_call``), slots that ``holds`` read as plain tensors (neither armed nor
    given by elision), no profiler range to open, and counters that the parking leaves as torch's
    call does (nothing to set back).
    """
    kept_plan = site.kept
    if kept_plan is None or not kept_plan.direct_call or compat.profiler_enabled():
        return NOT_TAKEN
    tensor_list, tensor = args
    if kept.holds(kept_plan, tensor_list, tensor, None, False, check, elide, verify, made_like) is None:
        call = bind(args, {}, check, elide, verify)
        assert call is not None  # two positional arguments always bind
        return handle(call, site, made_like, reuse=False)
    plan = kept_plan.plan
    route = plan.route
    assert route is not None  # a plan that rewires has one
    _count(plan, route)
    if not tensor.requires_grad or not torch.is_grad_enabled():
        return _rebind(route, tensor_list, tensor, None, False, elide, True)[0]
    return _unrecorded(_rebind, route, tensor_list, tensor, None, False, elide, True)[0]


def _agree_and_execute(plan: Plan, call: Call, taken: Optional[kept.Taken]) -> Any:
    if plan.agree:
        gloo_route = _settings.gloo_route
        verdict = agreement.poll(_original_all_gather, call, plan, gloo_route)
        plan = agreement.settle(plan, verdict, gloo_route)
    if not plan.rewires:
        return to_torch(plan.reason, call.args, call.kwargs)
    if taken is None:
        return _rewire(plan, call, [] if plan.leaves_counters else slots.versions(call.tensor_list))
    return _rewire(plan, call, taken.versions, taken.untracked)


def gather(tensor: torch.Tensor, group: Any = None, *, check: Optional[bool] = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order.

    A 0-d input gives shape ``(world,)``. All ranks must pass the same shape
    and dtype. Allocates only the result.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"memgather.gather expects a torch.Tensor, got {type(tensor).__name__}")
    if dist.is_initialized() and compat.rank_not_in_group(group):
        raise ValueError("memgather.gather: this rank is not a member of the given process group")
    world = dist.get_world_size(group)
    out = torch.empty(slots.flat_shape(tensor.shape, world), dtype=tensor.dtype, device=tensor.device)
    route = None if (_settings.check if check is None else check) else planner.small_single(out, tensor, group)
    if route is not None:
        # Below the threshold torch's single-tensor call is the cheapest way, and there
        # are no caller's slots to honour: the same call the hand-fixed code makes.
        counters.record(Strategy.INTO_RESULT.value, route=route.name)
        # Without grad, as in _rewire: an input that requires grad must not give the result
        # a history (torch.cat of torch's list gives none), nor trip autograd's in-place checks.
        with torch.no_grad():
            routes.run(route, out, tensor, group, False)
    else:
        pages.advise(out)
        all_gather(slots.views(out, world, tensor.shape), tensor, group, check=check)
    compat.set_version(out, 0)  # a new tensor, as torch.cat's result is: its writes were memgather's own
    return out


def gather_uneven(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order, where ranks' dim 0 may differ.

    The dims after the first, the dtype and the device type must be the same on every rank
    (else ``UnevenLayoutError`` on every rank); a rank may have no rows, and a 0-d input
    counts as one row. Returns a new tensor of the summed rows, as ``torch.cat`` of the ranks'
    tensors would be: contiguous, a plain tensor, never requiring grad. Each rank's rows are
    written once into it, without padding to the largest rank (``memgather.engine.uneven``).
    Every rank of the group must call it; it is not affected by ``patch()`` or its targets.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"memgather.gather_uneven expects a torch.Tensor, got {type(tensor).__name__}")
    if dist.is_initialized() and compat.rank_not_in_group(group):
        raise ValueError("memgather.gather_uneven: this rank is not a member of the given process group")
    if type(tensor) is not torch.Tensor:
        tensor = tensor.as_subclass(torch.Tensor)  # the rows, as torch.cat of a subclass's would hold them
    out = uneven.gather(tensor, group, _original_all_gather, _settings.gloo_route)
    compat.set_version(out, 0)  # a new tensor, as torch.cat's result is: its writes were memgather's own
    return out


def to_torch(reason: Optional[Reason], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Count a fallback and make the call, as its caller wrote it, with the original all_gather."""
    why = reason._value_ if reason else None  # what .value reads, without its descriptor's cost
    counters.record_fallback(why)
    if elision.may_need_settling():
        # torch writes in place: never into a result handed out
        elision.settle_list(args[0] if args else kwargs.get("tensor_list"))
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("all_gather falls back to torch: %s", why or "unknown")
    return _original_all_gather(*args, **kwargs)


def _rewire(plan: Plan, call: Call, versions: List[int], untracked: bool = False) -> Any:
    """Carry out a plan that rewires: its writer moves the bytes; the slots end as torch leaves them.

    ``versions``: the slots' version counters, read before anything touched them, to be set as torch
    leaves them (``slots.mark_written``); empty where there are none to set: inference tensors have
    none, and a parked rebind leaves them as torch does (``slots.rebind``). ``untracked``:
    the input does not require grad, so none of memgather's operations can record autograd history.
    """
    route, tensor_list = plan.route, call.tensor_list
    assert route is not None  # a plan that rewires has one
    _count(plan, route)
    writer = _WRITERS[plan.strategy]
    if untracked or not torch.is_grad_enabled():
        work, flat = writer(route, call)
    else:
        work, flat = _unrecorded(writer, route, call)
    if work is not None and not isinstance(work, works.SlotsWork):
        work = works.SlotsWork(work, tensor_list)  # its result() and future answer with the slots, as torch's
    if versions:
        slots.mark_written(tensor_list, versions)
    if call.verify:
        # Plain views of the buffer: the slots themselves may be armed for elision by the time they are read.
        written = tensor_list if flat is None else slots.views(flat, len(tensor_list), call.tensor.shape)
        if work is not None:
            work.wait()  # verify mode completes async calls before they return
        verification.verify(_original_all_gather, written, call.tensor, call.group, _COUNTED[plan.strategy])
        counters.record_verified()
    return work


def _unrecorded(write: Callable[..., Any], *args: Any) -> Any:
    """``write(*args)`` with grad mode off: under torch the slots never carry autograd history, so
    memgather's own copies of an input that requires grad must not add any. Set directly rather than
    through ``torch.no_grad()``; asked only where the input requires grad and grad mode is on."""
    torch._C._set_grad_enabled(False)
    try:
        return write(*args)
    finally:
        torch._C._set_grad_enabled(True)


def _count(plan: Plan, route: routes.Route) -> None:
    assert plan.gathered is not None  # a plan that rewires has it
    counters.record(_COUNTED[plan.strategy], route.name, plan.gathered if route.saves_temp else 0)


# A writer moves the bytes of one call by its route. It returns torch's work object (or None),
# and the buffer that now holds the result (None: the slots themselves hold it).
_Writer = Callable[[routes.Route, Call], Tuple[Any, Optional[torch.Tensor]]]


def _write_direct(route: routes.Route, call: Call) -> Tuple[Any, Optional[torch.Tensor]]:
    """The slots already are adjacent views of one region: gathered straight into it."""
    if route.in_place:  # the slots themselves are the views an in-place route fills
        routes.fill(route, call.tensor_list, call.tensor, call.group)  # synchronous, as torch's with async_op=False
        return None, None
    return routes.run(route, slots.region(call.tensor_list), call.tensor, call.group, call.async_op, call.elide), None


def _write_armed_direct(route: routes.Route, call: Call) -> Tuple[Any, Optional[torch.Tensor]]:
    """Direct, into slots that alone tile their buffer: armed for a cat as a rebind's are."""
    region = slots.region(call.tensor_list)
    elision.arm(call.tensor_list, region, call.tensor)
    return routes.run(route, region, call.tensor, call.group, call.async_op), region


def _write_rebind(route: routes.Route, call: Call) -> Tuple[Any, Optional[torch.Tensor]]:
    """The slots' storages released, one flat buffer allocated, the slots made its views."""
    return _rebind(route, call.tensor_list, call.tensor, call.group, call.async_op, call.elide, False)


def _write_parked_rebind(route: routes.Route, call: Call) -> Tuple[Any, Optional[torch.Tensor]]:
    """A rebind of plain CPU slots, each released by parking it (``slots.rebind``)."""
    return _rebind(route, call.tensor_list, call.tensor, call.group, call.async_op, call.elide, True)


def _rebind(
    route: routes.Route,
    tensor_list: List[torch.Tensor],
    tensor: Any,
    group: Any,
    async_op: Any,
    elide: bool,
    parked: bool,
) -> Tuple[Any, torch.Tensor]:
    elision.release(tensor_list)  # slots sharing a handed-out result are rebound: no write reaches it
    flat = slots.rebind(tensor_list, parked)
    if elide:
        elision.arm(tensor_list, flat, tensor)
    return routes.run(route, flat, tensor, group, async_op, elide), flat


def _write_in_slots(route: routes.Route, call: Call) -> Tuple[Any, Optional[torch.Tensor]]:
    """Each rank's part written where its slot lies, by an in-place route."""
    routes.fill(route, call.tensor_list, call.tensor, call.group)  # synchronous, as torch's with async_op=False
    return None, None


def _write_staged(route: routes.Route, call: Call) -> Tuple[Any, Optional[torch.Tensor]]:
    """A temporary, the same single call as every other rank's, a copy into the slots."""
    return staged.run(route, call.tensor_list, call.tensor, call.group, call.async_op), None


# The execution table: one writer per strategy that rewires.
_WRITERS: Dict[Strategy, _Writer] = {
    Strategy.DIRECT: _write_direct,
    Strategy.ARMED_DIRECT: _write_armed_direct,
    Strategy.REBIND: _write_rebind,
    Strategy.PARKED_REBIND: _write_parked_rebind,
    Strategy.IN_SLOTS: _write_in_slots,
    Strategy.STAGED: _write_staged,
}
# What ``memgather.stats()`` counts each under.
_COUNTED: Dict[Strategy, str] = {strategy: strategy.value for strategy in _WRITERS}
_COUNTED[Strategy.ARMED_DIRECT] = Strategy.DIRECT.value
_COUNTED[Strategy.PARKED_REBIND] = Strategy.REBIND.value
