"""memgather's all-gather: the per-call path, top to bottom.

``all_gather`` takes the decision for the call (``planner``: strategy, route
or the reason to stay out), agrees with the other ranks where the route needs
it (``agreement``), lays out the output (``slots``), moves the bytes
(``routes``) and counts what it did (``counters``). Whatever it cannot prove
safe goes to the original ``torch.distributed.all_gather`` unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from memgather import compat, config
from memgather.engine import agreement, counters, elision, pages, planner, routes, slots, staged, verification
from memgather.engine.strategies import DIRECT, REBIND, STAGED, Plan, Reason, Strategy, fallback

_log = logging.getLogger("memgather")

# Captured before anything can patch it: memgather's fallback and its own
# metadata exchange must never re-enter a wrapper around all_gather.
_original_all_gather = dist.distributed_c10d.all_gather

# The name of the range a profiler shows around each call memgather handles.
PROFILER_RANGE = "memgather::all_gather"

_settings = config.Settings()


def configure(settings: Optional[config.Settings] = None) -> None:
    """Take ``settings`` (default: the environment, read now) as the defaults of every later call.

    Read once at import and again by every ``patch()`` / ``unpatch()``, so that
    what ``patch()`` was given reaches direct calls too; the per-call path
    itself reads no environment variable.
    """
    global _settings
    _settings = config.load() if settings is None else settings
    planner.configure(_settings)


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
    call = ((tensor_list, tensor), {"group": group, "async_op": async_op})
    return _handle(call, tensor_list, tensor, group, async_op, check, elide, verify)


def handle(args: Tuple[Any, ...], kwargs: Dict[str, Any], check: bool, elide: bool, verify: bool) -> Any:
    """``all_gather`` for a call as the wrapper received it, whose arguments bind to torch's
    signature, and which ``torch_at_once`` did not send to torch: where it falls back, torch gets
    the caller's own call, positional arguments and keywords as they were (torch's exception
    logging reads them)."""
    count = len(args)
    tensor_list = args[0] if count else kwargs["tensor_list"]
    tensor = args[1] if count > 1 else kwargs["tensor"]
    group = args[2] if count > 2 else kwargs.get("group")
    async_op = args[3] if count > 3 else kwargs.get("async_op", False)
    return _handle((args, kwargs), tensor_list, tensor, group, async_op, check, elide, verify, asked=True)


# A call as torch's all_gather is to receive it where memgather falls back: (args, kwargs).
_Call = Tuple[Tuple[Any, ...], Dict[str, Any]]


def _handle(call: _Call, tensor_list: Any, tensor: Any, group: Any, async_op: bool, check: Optional[bool],
            elide: Optional[bool], verify: Optional[bool], asked: bool = False) -> Any:
    """``asked``: ``quick_reason`` was asked already (by ``torch_at_once``), and found none."""
    check = _settings.check if check is None else check
    elide = bool(_settings.elide) if elide is None else elide
    if not check and not asked:
        reason = planner.quick_reason(tensor_list, tensor, group, elide)
        if reason is not None:
            return to_torch(reason, *call)
    verify = _settings.verify if verify is None else verify
    if not compat.profiler_enabled():
        return _all_gather(call, tensor_list, tensor, group, async_op, check, elide, verify)
    # One range in a profile for the user's call: memgather's collectives show inside it.
    with torch.autograd.profiler.record_function(PROFILER_RANGE):
        return _all_gather(call, tensor_list, tensor, group, async_op, check, elide, verify)


def _all_gather(
    call: _Call, tensor_list: Any, tensor: Any, group: Any, async_op: bool, check: bool, elide: bool, verify: bool
) -> Any:
    decision = planner.decide(tensor_list, tensor, group, async_op, elide)
    chosen, route = decision.plan, decision.route
    if decision.needs_agreement(check):
        assert decision.info is not None  # a decision with a gathered size described the group
        # The exchange is memgather's own: no subclass hook, and no dispatch mode, sees it.
        with compat.subclass_hooks_off(), compat.outside_modes() if decision.watched else contextlib.nullcontext():
            chosen, route = _agree(chosen, tensor_list, tensor, group, decision.info.world, check, route)
    if not chosen.rewires:
        return to_torch(chosen.reason, *call)
    assert route is not None and decision.gathered is not None  # a plan that rewires had both
    return _rewire(chosen, route, tensor_list, tensor, group, async_op, decision.gathered, elide, verify)


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


def _agree(chosen: Plan, tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any, world: int, check: bool,
           route: Optional[routes.Route]) -> Tuple[Plan, Optional[routes.Route]]:
    """The plan every rank follows, and the route, settled from what every rank read alike."""
    even = all(s.shape == tensor.shape and s.dtype == tensor.dtype for s in tensor_list)
    code = _route_code(route)
    verdict = agreement.agree(_original_all_gather, group, tensor, chosen.rewires, even, world, check, code)
    if route is not None:
        route = routes.settle(route, _settings.gloo_route, verdict.spans_hosts, tensor.dtype)
    if verdict.reason is None or not chosen.rewires:
        return chosen, route
    return fallback(verdict.reason), route


def _route_code(route: Optional[routes.Route]) -> int:
    """What this rank would act on, as the agreement row carries it (> 0).

    Ranks that would meet on two wire protocols all take none: an in-place route
    set differently (MEMGATHER_GLOO_ROUTE), or an in-place route on one rank and
    the single call on another (a call made with async_op=True on one rank only,
    with check on: both ranks then agree first).
    """
    if route is None or not route.in_place:
        return len(config.GLOO_ROUTES) + 1
    return config.GLOO_ROUTES.index(_settings.gloo_route) + 1


# torch.distributed.all_gather's parameters, in order.
_PARAMETERS = ("tensor_list", "tensor", "group", "async_op")


def torch_at_once(args: Tuple[Any, ...], kwargs: Dict[str, Any], check: bool, elide: bool) -> Optional[Reason]:
    """Why a call, as its caller wrote it, certainly goes to torch; None where it takes ``all_gather``.

    For the wrapper: arguments torch's signature does not take get torch's own
    TypeError (``all_gather`` has keywords of its own, and would word it
    otherwise); without ``check``, ``planner.quick_reason`` is asked too, so that a
    call going to torch anyway does not pay for building ``all_gather``'s keywords.
    """
    count = len(args)
    if count > 4 or count + len(kwargs) < 2 or (kwargs and not _binds(count, kwargs)):
        return Reason.BAD_ARGUMENTS
    if check:
        return None
    return planner.quick_reason(args[0] if count else kwargs.get("tensor_list"),
                                args[1] if count > 1 else kwargs.get("tensor"),
                                args[2] if count > 2 else kwargs.get("group"), elide)


def _binds(count: int, kwargs: Dict[str, Any]) -> bool:
    """Keywords that name parameters not already given by position, the two required ones given."""
    return (all(name in _PARAMETERS[count:] for name in kwargs)
            and all(name in kwargs for name in _PARAMETERS[count:2]))


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



def _rewire(
    chosen: Plan,
    route: routes.Route,
    tensor_list: List[torch.Tensor],
    tensor: torch.Tensor,
    group: Any,
    async_op: bool,
    gathered: int,
    elide: bool,
    verify: bool,
) -> Any:
    counters.record(chosen.strategy.value, route=route.name, saved=gathered if route.saves_temp else 0)
    before = slots.versions(tensor_list)
    # Under torch the slots never carry autograd history: memgather's own copies must not add any.
    # (Set directly: torch.no_grad() as a context costs more than the rest of a small call's Python.)
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        work, flat = _write(chosen, route, tensor_list, tensor, group, async_op, elide)
    finally:
        torch._C._set_grad_enabled(grad)
    slots.mark_written(tensor_list, before)
    if verify:
        # Plain views of the buffer: the slots themselves may be armed for elision by the time they are read.
        written = tensor_list if flat is None else slots.views(flat, len(tensor_list), tensor.shape)
        _verify(work, written, tensor, group, chosen)
    return work


def _write(
    chosen: Plan, route: routes.Route, tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any,
    async_op: bool, elide: bool,
) -> Tuple[Any, Optional[torch.Tensor]]:
    """Move the bytes; returns torch's work object (or None), and the buffer that now holds the result
    (None: the slots themselves hold it)."""
    if chosen is DIRECT and elide and slots.tile_their_storage(tensor_list):
        # Slots that alone tile one buffer (those of an earlier rebind, gathered into again)
        # are that buffer's views already: armed like a rebind's, with no new buffer.
        region = slots.region(tensor_list)
        elision.arm(tensor_list, region)
        return routes.run(route, region, tensor, group, async_op), region
    if chosen is STAGED:
        return staged.run(route, tensor_list, tensor, group, async_op), None
    if route.in_place and chosen is not REBIND:
        # Direct slots already are the views an in-place route fills, and in_slots ones are
        # filled where they lie: either way the slots themselves are the destinations.
        routes.fill(route, tensor_list, tensor, group)  # synchronous, as torch's with async_op=False
        return None, None
    if chosen is DIRECT:
        return routes.run(route, slots.region(tensor_list), tensor, group, async_op), None
    elision.release(tensor_list)  # slots sharing a handed-out result are rebound: no write reaches it
    flat = slots.rebind(tensor_list)
    if elide:
        elision.arm(tensor_list, flat)
    return routes.run(route, flat, tensor, group, async_op), flat


def _verify(work: Any, gathered: List[torch.Tensor], tensor: torch.Tensor, group: Any, chosen: Plan) -> None:
    if work is not None:
        work.wait()  # verify mode completes async calls before they return
    verification.verify(_original_all_gather, gathered, tensor, group, chosen.strategy.value)
    counters.record_verified()
