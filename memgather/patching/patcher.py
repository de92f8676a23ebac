"""``patch()`` / ``unpatch()``: memgather's wrapper around torch's all_gather.

The wrapper is installed on ``torch.distributed.all_gather``,
``torch.distributed.distributed_c10d.all_gather`` (which ``all_gather_object``
calls) and on ``all_gather`` names that already-imported target modules took
with ``from torch.distributed import all_gather``. Per call it asks three
cheap questions (patched? opted out? compiling?) and one cached one (is the
caller a selected target whose version gate passed?), then hands the call to
``memgather.engine.core`` or to the function it wraps.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, replace
from types import CodeType, ModuleType
from typing import Any, Dict, Hashable, Iterable, List, Optional, Tuple

import torch.distributed as dist
import wrapt

from memgather import compat, config
from memgather.engine import core, elision, kept, objects, report
from memgather.engine.call import bind
from memgather.engine.reasons import Reason
from memgather.patching import callers, helpers, library_helpers, scope, sites
from memgather.patching import targets as registry
from memgather.patching.wrapper import MemgatherWrapper

_log = logging.getLogger("memgather")

_MAX_DECISIONS = 4096  # code objects remembered; cleared past this (exec'd code, lambdas)


@dataclass(frozen=True)
class _Active:
    """What the current ``patch()`` asked for."""

    selection: registry.Selection
    check: bool
    force: bool
    elide: Optional[bool]  # None: where the call site's code is proven to drop the list (sites)
    verify: bool


_lock = threading.RLock()
_active: Optional[_Active] = None
_wrapper: Optional[MemgatherWrapper] = None
# torch's object collectives (name -> memgather's wrapper of torch's function, made once).
_object_wrappers: Dict[str, MemgatherWrapper] = {}
_installed: List[Tuple[Any, str, Any]] = []  # (owner, attribute, value it replaced)
# Keyed by id(code), holding the code object so the id cannot be reused: code
# objects compare by value, and two modules' identical functions are "equal".
# elide? is None where the call site's own code decides (sites.verdict and sites.dropped, per call site). The
# sites hold the plan kept at each place the code gathers from, for its next call there
# (memgather.engine.kept).
_Decision = Tuple[CodeType, bool, Optional[bool], kept.Sites]
_decisions: Dict[int, _Decision] = {}  # id -> (code, rewire?, elide?, sites): the calling frame is the gatherer
# Decisions for calls whose caller is found past plumbing: keyed by the ids of the code
# objects the walk found, holding them for the same reason.
_chains: Dict[Tuple[int, ...], Tuple[Tuple[CodeType, ...], _Decision]] = {}
# What the first patch() replaced: the environment it exported over, and the engine's settings.
_exported: Optional[Tuple[config.Exported, config.Settings]] = None
_hooked: set = set()
_announced: set = set()


def patch(
    targets: Optional[Iterable[str]] = None,
    *,
    check: Optional[bool] = None,
    force: Optional[bool] = None,
    elide: Optional[bool] = None,
    verify: Optional[bool] = None,
) -> bool:
    """Rewire ``torch.distributed.all_gather`` for the selected callers.

    ``targets``: built-in target names, module prefixes of your own, or
    ``"*"`` for every caller (default: ``MEMGATHER_TARGETS``, else every
    built-in target). ``check``: cross-rank shape check on every rewired call
    (default ``MEMGATHER_CHECK``). ``force``: rewire targets whose installed
    version is outside the tested range (default ``MEMGATHER_FORCE``).
    ``elide``: let ``torch.cat`` of the gathered list return the gathered
    buffer (default ``MEMGATHER_ELIDE``; unset: at call sites whose code is
    proven to drop the list after one cat, see docs/elision.md). ``verify``: also run the original
    all_gather for every rewired call and raise ``VerifyError`` where the
    results differ, for test runs (default ``MEMGATHER_VERIFY``). Idempotent and thread-safe; calling
    it again replaces the settings: what an earlier call was given ends there, and
    an argument left out is read from the environment as the user set it. Also
    exports the settings to the environment, so spawned children re-patch as
    this process did; ``unpatch()`` takes them back out. Returns False, doing
    nothing, when ``MEMGATHER=0``.
    """
    global _active, _exported
    # The user's environment, not what an earlier patch() exported: its arguments end with it.
    exported = _exported
    settings = config.load(None if exported is None else exported[0].users_environment())
    _configure_logging(settings.log_level)
    if settings.enabled is False:
        _log.info("MEMGATHER=0: patch() does nothing")
        return False
    selection = registry.select(targets if targets is not None else settings.targets)
    active = _Active(
        selection,
        settings.check if check is None else check,
        settings.force if force is None else force,
        settings.elide if elide is None else elide,
        settings.verify if verify is None else verify,
    )
    with _lock:
        if _exported is not exported:
            # Another thread's patch() exported since this one read the environment: read it again,
            # holding the lock (reentrant), so that its export is not taken for the user's setting.
            return patch(targets, check=check, force=force, elide=elide, verify=verify)
        # The engine first, before anything is installed: one another thread is still importing
        # (its configure() not defined yet) fails here, and leaves torch as it was.
        before = core.settings()
        # Direct calls (memgather.all_gather) and the thresholds follow what this patch() was given.
        core.configure(
            replace(
                settings,
                enabled=True,
                targets=selection.names,
                check=active.check,
                force=active.force,
                elide=active.elide,
                verify=active.verify,
            )
        )
        _install()
        _rebind_imported(selection)
        _decisions.clear()
        _chains.clear()
        sites.forget()
        _active = active
        # Spawned children read the environment at start-up, and so re-patch as this process did.
        written = config.export(
            True,
            selection.names,
            active.check,
            active.force,
            active.elide,
            active.verify,
            over=None if _exported is None else _exported[0],
        )
        _exported = (written, before if _exported is None else _exported[1])
        _hook_targets(selection)
        # An earlier patch()'s selection ends here, as its other settings do; what both select stays.
        helpers.install(lambda module: _helper_selected(module, active), active.elide)
        report.install(settings.report)
    _log.info("memgather patched all_gather for %s", ", ".join(selection.names) or "no targets")
    return True


def unpatch() -> bool:
    """Undo ``patch()``: restore every name it replaced. Returns whether it was patched.

    Where another wrapper was installed on top of memgather's, memgather's is
    disabled in place instead (removing it would remove the other one too).
    """
    global _active, _wrapper, _exported
    with _lock:
        if _active is None:
            return False
        _active = None
        helpers.uninstall()
        _decisions.clear()
        _chains.clear()
        sites.forget()
        kept = [entry for entry in _installed if not _restore(*entry)]
        _installed[:] = kept
        if kept:
            places = ", ".join(f"{_owner_name(owner)}.{name}" for owner, name, _ in kept)
            _log.warning(
                "another wrapper sits above memgather's on %s: memgather's is disabled there, not removed", places
            )
        else:
            _wrapper = None
        if _exported is not None:
            environment, before = _exported
            config.restore(environment)
            core.configure(before)  # the settings calls ran under before the first patch()
            _exported = None
    return True


def is_patched() -> bool:
    """Whether memgather is currently rewiring calls."""
    return _active is not None


def _on_call(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    flight = helpers.in_flight()
    if flight is not None:  # a taken-over helper's code runs on this thread: is this its size exchange?
        exchange = flight.site(sys._getframe(1))
        if exchange is not None:
            return flight.exchanged(exchange, wrapped, args, kwargs)
    active = _active
    if active is not None and not scope.is_disabled() and not compat.is_compiling():
        frame = sys._getframe(1)
        code = frame.f_code
        known = _decisions.get(id(code))
        place: Hashable
        if known is not None and known[0] is code:
            gatherer, place = True, frame.f_lasti  # decided by this frame alone: it gathers itself
        else:
            (known, place), gatherer = _decide(frame, active), False
        if known[1]:
            site = known[3].at(place)
            elide, made_like = known[2], False
            if gatherer:
                # The site's code, proven once: whether it hands the list to one cat first (where the
                # code decides elision), and whether it makes the slots like the input, which spares
                # a kept plan two of its reads of each slot (proof.slots_like_input).
                found = sites.verdict(frame, True, site)
                # (Where a tracer may run code between the slots' making and the gather: read in full.)
                made_like = found.like_input and not compat.code_between_statements()
            if elide is None:
                found = found if gatherer else sites.verdict(frame, False, site)
                elide = sites.dropped(found, *_list_and_tensor(args, kwargs))
                if elide and found.returned:
                    return _armed_for_the_caller(frame, site, args, kwargs, active, made_like)
            return _carry_out(site, args, kwargs, active, elide, made_like)
    if elision.watching():  # torch writes into the slots in place: never into a result elision handed out
        elision.settle_list(args[0] if args else kwargs.get("tensor_list"))
    return wrapped(*args, **kwargs)


def _armed_for_the_caller(frame: Any, site: Any, args: Any, kwargs: Any, active: _Active, made_like: bool) -> Any:
    """A gather whose function returns its list: armed only where the code it returns the list to is
    proven to concatenate it at once (``sites.received``), so that no armed slot reaches code that
    does not concatenate."""
    gathering = sites.gathering_frame(frame)
    elide = (
        gathering is not None and gathering.f_back is not None and sites.received(gathering.f_back, gathering).proven
    )
    return _carry_out(site, args, kwargs, active, elide, made_like)


def _carry_out(site: Any, args: Any, kwargs: Any, active: _Active, elide: bool, made_like: bool) -> Any:
    """The call from ``site``, rewired: by its kept plan where one holds, else planned in full."""
    if site.kept is not None and len(args) == 2 and not kwargs:  # a loop's call, as most are written
        done = core.rewire_kept(site, args, active.check, elide, active.verify, made_like)
        if done is not core.NOT_TAKEN:
            return done
    call = bind(args, kwargs, active.check, elide, active.verify)
    if call is None:  # arguments torch's signature does not take: torch's own TypeError
        return core.to_torch(Reason.BAD_ARGUMENTS, args, kwargs)
    return core.handle(call, site, made_like)


def _list_and_tensor(args: Any, kwargs: Any) -> Tuple[Any, Any]:
    """The call's ``tensor_list`` and ``tensor``, however passed (None where absent)."""
    tensor_list = args[0] if args else kwargs.get("tensor_list")
    return tensor_list, args[1] if len(args) > 1 else kwargs.get("tensor")


def _decide(frame: Any, active: _Active) -> Tuple[_Decision, Hashable]:
    """The decision for a call from ``frame``, and the place it was made from (``kept.Sites``)."""
    found, cacheable = callers.calling_frames(frame)
    if cacheable:
        decision = _decide_for(frame.f_code, found, active)
        _remember(_decisions, id(frame.f_code), decision)
        return decision, frame.f_lasti
    # Plumbing or a Function's forward serves every caller: the walk must be made each
    # call, but what it finds (the same code objects) is decided once.
    chain = tuple(caller.f_code for caller in found)
    key = tuple(map(id, chain))
    known = _chains.get(key)
    if known is None or not all(a is b for a, b in zip(known[0], chain)):
        known = (chain, _decide_for(frame.f_code, found, active))
        _remember(_chains, key, known)
    # The place only where a call is rewired (a kept plan's): not on the path of a call left to torch.
    place = (frame.f_lasti, *(caller.f_lasti for caller in found)) if known[1][1] else None
    return known[1], place


def _decide_for(code: CodeType, found: List[Any], active: _Active) -> _Decision:
    """Whether to rewire a call made on behalf of ``found`` (innermost first), and to elide
    (None: the call site's code decides, ``sites.dropped``)."""
    report.remember_rank()
    for caller in found:  # the code that called, then (past a Function's forward) the code that applied it
        module = callers.module_of(caller)
        target = active.selection.match(module) if module else None
        if target is None:
            continue
        verdict = registry.gate(target, active.force)
        _announce(target, verdict)
        act = verdict.allowed
        return code, act, (active.elide if act else False), kept.Sites()
    return code, False, False, kept.Sites()


def _remember(cache: Dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _MAX_DECISIONS:
        cache.clear()
    cache[key] = value


def _announce(target: registry.Target, verdict: registry.Verdict) -> None:
    """Log each target's gate verdict once per process."""
    if target.name in _announced:
        return
    _announced.add(target.name)
    if verdict.allowed:
        _log.info("memgather rewires calls from %s (%s)", target.name, verdict.reason)
    else:
        _log.warning("memgather leaves %s to torch: %s (force=True overrides)", target.name, verdict.reason)


def _install() -> None:
    """Put the wrapper on torch.distributed and distributed_c10d (once)."""
    global _wrapper
    c10d = dist.distributed_c10d
    if _wrapper is None:
        _wrapper = MemgatherWrapper(c10d.all_gather, _on_call)
    for owner in (dist, c10d):
        current = owner.all_gather
        if _wraps_ours(current):
            continue  # ours, or someone else's wrapper around ours: re-enabling is enough
        if current is not _wrapper.__wrapped__:
            _log.warning(
                "%s.all_gather was replaced by someone else; memgather wraps what is there", _owner_name(owner)
            )
        _set(owner, "all_gather", _wrapper)
    for name, function in OBJECT_COLLECTIVES.items():
        wrapper = _object_wrappers.get(name)
        if wrapper is None:
            wrapper = _object_wrappers[name] = MemgatherWrapper(getattr(c10d, name), _on_object_call(function))
        for owner in (dist, c10d):
            if not _is_one_of_ours(getattr(owner, name), wrapper):
                _set(owner, name, wrapper)


# torch's object collectives and memgather's way of making each.
OBJECT_COLLECTIVES = {
    "all_gather_object": objects.all_gather_object,
    "gather_object": objects.gather_object,
    "broadcast_object_list": objects.broadcast_object_list,
}


def _on_object_call(function: Any) -> Any:
    """The wrapper's handler for one of torch's object collectives: ``function`` (memgather's way)
    for a call from a selected target, torch's own for every other caller."""

    def handler(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        active = _active
        if active is not None and not scope.is_disabled():
            frame = sys._getframe(1)
            known = _decisions.get(id(frame.f_code))
            decision = known if known is not None and known[0] is frame.f_code else _decide(frame, active)[0]
            if decision[1]:
                return function(*args, **kwargs)
        return wrapped(*args, **kwargs)

    return handler


def _is_one_of_ours(function: Any, wrapper: Any) -> bool:
    """Whether ``function`` is ``wrapper`` or wraps it (follows ``__wrapped__``)."""
    for _ in range(32):
        if function is wrapper:
            return True
        function = getattr(function, "__wrapped__", None)
        if function is None:
            return False
    return False


def _wraps_ours(function: Any) -> bool:
    """Whether ``function`` is memgather's wrapper or wraps it (follows ``__wrapped__``)."""
    return _is_one_of_ours(function, _wrapper)


def _rebind_imported(selection: registry.Selection) -> None:
    """Replace ``all_gather`` (and object collective) names that selected modules imported before patching."""
    assert _wrapper is not None
    ours = {id(wrapper.__wrapped__): wrapper for wrapper in (_wrapper, *_object_wrappers.values())}
    modules: Dict[str, Optional[ModuleType]] = dict(sys.modules)  # an entry may be None (a blocked import)
    for name, module in modules.items():
        if module is None or not _selected_module(name, selection):
            continue
        for attribute, value in list(vars(module).items()):
            wrapper = ours.get(id(value))
            if wrapper is not None and value is wrapper.__wrapped__:
                _set(module, attribute, wrapper)


def _selected_module(name: str, selection: registry.Selection) -> bool:
    if name.startswith("torch.") or name == "torch":
        return False
    return selection.match(name) is not None


def _helper_selected(module: str, active: _Active) -> bool:
    """Whether a library helper in ``module`` is one to take over: its target selected, its gate passed."""
    target = active.selection.match(module) if _selected_module(module, active.selection) else None
    return target is not None and registry.gate(target, active.force).allowed


for _helper in library_helpers.HELPERS:
    helpers.register(_helper)


def _set(owner: Any, attribute: str, value: Any) -> None:
    _installed.append((owner, attribute, getattr(owner, attribute)))
    setattr(owner, attribute, value)


def _restore(owner: Any, attribute: str, previous: Any) -> bool:
    current = getattr(owner, attribute, None)
    if current is not _wrapper and not any(current is wrapper for wrapper in _object_wrappers.values()):
        return False
    setattr(owner, attribute, previous)
    return True


def _owner_name(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, ModuleType) else repr(owner)


def _hook_targets(selection: registry.Selection) -> None:
    """Log each gated target's verdict when its library is imported, never importing it."""
    for target in selection.targets:
        if target.distribution is None:
            continue
        for prefix in target.prefixes:
            if prefix not in _hooked:
                _hooked.add(prefix)
                wrapt.register_post_import_hook(_on_target_import(target), prefix)


def _on_target_import(target: registry.Target) -> Any:
    def hook(module: ModuleType) -> None:
        try:  # a hook must never break the user's import
            active = _active
            if active is not None and target in active.selection.targets:
                _announce(target, registry.gate(target, active.force))
        except Exception:  # noqa: BLE001 - a hook must never break the user's import
            _log.exception("memgather: checking %s's version failed; it is left to torch", target.name)

    return hook


def _configure_logging(level: Optional[int]) -> None:
    if level is None:
        return
    logger = logging.getLogger("memgather")
    logger.setLevel(level)
    if not any(getattr(h, "_memgather", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[memgather] %(levelname)s %(message)s"))
        handler._memgather = True  # type: ignore[attr-defined]  # memgather's mark on its own handler
        logger.addHandler(handler)
