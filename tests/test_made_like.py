"""The kept plan's proof that a call's slots are new tensors made like its input (``proof.slots_like_input``).

Where a call site's code makes the list it gathers into, in the call or in the statement
just before, of ``torch.empty_like(t)`` / ``zeros_like`` / ``ones_like`` of the very input
``t``, a kept plan spares two of its reads of each slot (``strategies.made_like_as_kept``).
The proof is read statically here, one accepted and one refused form per rule; then on
torch's fake backend, the kept plan's path is watched (which check ran) and the slots'
version counters compared with torch's; then on 2 gloo ranks, every call of each site must
observe exactly what torch gives it.
"""

from __future__ import annotations

import ast
import textwrap
from typing import Any, Optional

import pytest

from memgather import compat
from memgather.patching import proof
from tests.conftest import EAGER, run_on_fake, unwrap

needs_rebind = pytest.mark.skipif(not compat.can_prove_exclusive(), reason="no storage use count: no plan is kept")


def _resolve(expression: ast.expr) -> Optional[str]:
    """``torch.x`` names torch's ``x``; ``dist.x`` torch.distributed's (as a live frame's globals would)."""
    if isinstance(expression, ast.Name) and expression.id == "range":
        return "range"
    if isinstance(expression, ast.Attribute) and isinstance(expression.value, ast.Name):
        module = {"torch": "torch", "dist": "torch.distributed"}.get(expression.value.id)
        return f"{module}.{expression.attr}" if module else None
    return None


def _why_not(source: str) -> str:
    """``proof.slots_like_input`` on the one all_gather call of the one function in ``source``."""
    function = ast.parse(textwrap.dedent(source)).body[0]
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and proof.last_name(n.func) == "all_gather"]
    assert len(calls) == 1
    return proof.slots_like_input(function, calls[0], _resolve)


ACCEPTED = {
    "display in the call": """
        def f(t):
            dist.all_gather([torch.empty_like(t), torch.empty_like(t)], t)
    """,
    "comprehension in the call": """
        def f(t, n):
            dist.all_gather([torch.zeros_like(t) for _ in range(n)], t)
    """,
    "bound just before (MoCo's)": """
        def f(tensor):
            tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(tensors_gather, tensor, async_op=False)
            return torch.cat(tensors_gather, dim=0)
    """,
    "the work waited for at once": """
        def f(t):
            out = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(out, t, async_op=True).wait()
            return out
    """,
    "names and constants as the other arguments": """
        def f(t, group):
            dist.all_gather([torch.empty_like(t) for _ in range(2)], t, group, False)
    """,
    "keywords, annotated": """
        def f(t):
            out: list = [torch.empty_like(t) for _ in range(2)]
            work = dist.all_gather(tensor_list=out, tensor=t, async_op=True)
            work.wait()
            return out
    """,
    "a local bound in the function": """
        def f(x):
            t = x * 2
            out = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(out, t)
            return out
    """,
    "inside a loop's body": """
        def f(ts):
            for t in ts:
                out = [torch.empty_like(t) for _ in range(2)]
                dist.all_gather(out, t)
    """,
}

REFUSED = {
    "a gather in a while test (run again without the statement before it)": (
        """
        def f(t, later):
            out = [torch.empty_like(t) for _ in range(2)]
            while dist.all_gather(out, t) is None and later:
                t = later.pop()
    """,
        "larger expression",
    ),
    "an argument that runs code after the slots are made": (
        """
        def f(t, hook):
            out = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(out, t, async_op=hook(t))
    """,
        "neither a name nor a constant",
    ),
    "an attribute argument (a property may run code)": (
        """
        def f(self, t):
            dist.all_gather([torch.empty_like(t) for _ in range(2)], t, group=self.group)
    """,
        "neither a name nor a constant",
    ),
    "a callee looked up through an object (a property may run code)": (
        """
        def f(t, comm):
            out = [torch.empty_like(t) for _ in range(2)]
            comm.all_gather(out, t)
    """,
        "not torch.distributed.all_gather",
    ),
    "a callee that is not torch's all_gather": (
        """
        def f(t):
            out = [torch.empty_like(t) for _ in range(2)]
            mine.all_gather(out, t)
    """,
        "not torch.distributed.all_gather",
    ),
    "a comprehension over something other than a range": (
        """
        def f(t, steps):
            out = [torch.empty_like(t) for _ in steps]
            dist.all_gather(out, t)
    """,
        "other than a range",
    ),
    "the gather inside a larger expression": (
        """
        def f(t, g):
            out = [torch.empty_like(t) for _ in range(2)]
            x = g(t) + dist.all_gather(out, t)
    """,
        "larger expression",
    ),
    "keywords unpacked": (
        """
        def f(t, options):
            dist.all_gather([torch.empty_like(t) for _ in range(2)], t, **options)
    """,
        "unpacked",
    ),
    "a statement between": (
        """
        def f(t):
            out = [torch.empty_like(t) for _ in range(2)]
            n = 1
            dist.all_gather(out, t)
    """,
        "not bound by the statement just before",
    ),
    "made in a with block, gathered after it": (
        """
        def f(t):
            with torch.no_grad():
                out = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(out, t)
    """,
        "not bound by the statement just before",
    ),
    "a keyword to the factory": (
        """
        def f(t):
            dist.all_gather([torch.empty_like(t, dtype=torch.float64) for _ in range(2)], t)
    """,
        "not every slot",
    ),
    "another tensor": (
        """
        def f(t, u):
            dist.all_gather([torch.empty_like(u) for _ in range(2)], t)
    """,
        "not every slot",
    ),
    "another factory": (
        """
        def f(t):
            dist.all_gather([torch.empty(t.shape) for _ in range(2)], t)
    """,
        "not every slot",
    ),
    "a method": (
        """
        def f(t):
            dist.all_gather([t.new_empty(t.shape) for _ in range(2)], t)
    """,
        "not every slot",
    ),
    "the comprehension binds the name": (
        """
        def f(t, ts):
            dist.all_gather([torch.empty_like(t) for t in ts], t)
    """,
        "binds t",
    ),
    "a filtered comprehension": (
        """
        def f(t, n):
            dist.all_gather([torch.empty_like(t) for i in range(n) if i], t)
    """,
        "more than one plain for",
    ),
    "a global input": (
        """
        def f():
            dist.all_gather([torch.empty_like(T) for _ in range(2)], T)
    """,
        "not a local",
    ),
    "declared global": (
        """
        def f(x):
            global t
            t = x
            dist.all_gather([torch.empty_like(t) for _ in range(2)], t)
    """,
        "global",
    ),
    "bound by :=": (
        """
        def f(x):
            dist.all_gather([torch.empty_like(t := x), torch.empty_like(t)], t)
    """,
        ":=",
    ),
    "captured by a closure": (
        """
        def f(t):
            later = lambda: t
            dist.all_gather([torch.empty_like(t) for _ in range(2)], t)
            return later
    """,
        "captured",
    ),
    "the function reads its frame": (
        """
        def f(t):
            names = locals()
            dist.all_gather([torch.empty_like(t) for _ in range(2)], t)
    """,
        "reads its own frame",
    ),
    "the list read again in the gather's statement": (
        """
        def f(t):
            out = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(out, out[0])
    """,
        "not a local name",
    ),
    "the list twice in the gather's statement": (
        """
        def f(t):
            out = [torch.empty_like(t) for _ in range(2)]
            keep(out, dist.all_gather(out, t))
    """,
        "used again in the statement",
    ),
    "a list from elsewhere": (
        """
        def f(t, out):
            dist.all_gather(out, t)
    """,
        "not bound by the statement just before",
    ),
    "an empty display": (
        """
        def f(t):
            dist.all_gather([], t)
    """,
        "not every slot",
    ),
    "not a list": (
        """
        def f(t):
            dist.all_gather((torch.empty_like(t), torch.empty_like(t)), t)
    """,
        "neither written in the call nor a local name",
    ),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_the_forms_that_make_slots_like_the_input_are_proven(name: str) -> None:
    assert _why_not(ACCEPTED[name]) == "", name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_other_form_is_refused_with_its_reason(name: str) -> None:
    source, reason = REFUSED[name]
    assert reason in _why_not(source), (name, _why_not(source))


# On 2 gloo ranks: every call of every site observes exactly what torch gives it.

_PROVEN = ("moco", "zeros_async", "requires_grad", "in_inference_mode", "scalar", "pooled_channels_last")
_TO_TORCH = ("permuted_input", "statement_between")  # slots not contiguous; a slot's view kept
# Sites whose last call is changed by code run between the slots' making and the gather: a tracer
# (the proof holds, and the slots are read in full while it runs) or a property the callee is looked
# up through (not proven). The changed call goes to torch (the input is one of the slots).
_CHANGED_LAST = ("traced_input_slot", "property_callee")


@needs_rebind
def test_every_call_of_each_site_observes_what_torch_gives(pools: Any) -> None:
    from tests.sites import made_like

    calls = 4
    results = unwrap(pools(2, **EAGER).run(made_like.compare, calls))
    for rank, result in enumerate(results):
        for name, run in result.items():
            assert run["memgather"] == run["torch"], (rank, name, run)
            assert run["rewired"] == (0 if name in _TO_TORCH else calls - (name in _CHANGED_LAST)), (rank, name, run)
            # The first call is planned in full; the next ones take the kept plan, with the proof
            # where the site makes its slots like a contiguous input.
            assert run["made_like"] == (calls - 1 if name in _PROVEN else 0), (rank, name, run)


# On the fake backend: which check a kept plan's call runs, and the version counters it leaves.

_SPIES = """
from dataclasses import replace
from memgather.engine import strategies
counts = {"made_like_as_kept": 0, "rebinds_as_kept": 0}
def spy(name):
    real = getattr(strategies, name)
    def counting(*args, **kwargs):
        counts[name] += 1
        return real(*args, **kwargs)
    return counting
for name in list(counts):
    setattr(strategies, name, spy(name))
from memgather.engine import kept
kept._CHECKS.update({k: strategies.rebinds_as_kept for k, v in kept._CHECKS.items() if v.__name__ == "rebinds_as_kept"})
"""


def _site_module(tmp_path: Any, source: str) -> str:
    """A module file of ``source`` under ``tmp_path`` (the proof reads a call site's source file)."""
    (tmp_path / "made_like_site.py").write_text(textwrap.dedent(source))
    return str(tmp_path)


def _on_fake_with_site(path: str, body: str) -> str:
    """``body`` run on the fake backend with the spies, the module ``made_like_site`` of ``path``
    imported, and ``patched()`` to make it the target with every call rewired."""
    prelude = f"""
sys.path.insert(0, {path!r})
import made_like_site
def patched():
    memgather.patch(["made_like_site"])
    core.configure(replace(core.settings(), nccl_min_bytes=0))
"""
    return run_on_fake(_SPIES + prelude + textwrap.dedent(body))


@needs_rebind
def test_a_proven_site_reads_only_who_holds_each_slot_and_leaves_torchs_versions(tmp_path: Any) -> None:
    path = _site_module(
        tmp_path,
        """
        import torch
        import torch.distributed as dist

        def inline(t):
            dist.all_gather([torch.zeros_like(t), torch.zeros_like(t)], t)

        def bound(t):
            out = [torch.ones_like(t) for _ in range(2)]
            dist.all_gather(out, t)
            return [slot._version for slot in out]
    """,
    )
    out = _on_fake_with_site(
        path,
        """
        t = torch.ones(256)
        unpatched = [made_like_site.bound(t) for _ in range(3)]
        patched()
        versions = [made_like_site.bound(t) for _ in range(4)]
        for _ in range(4):
            made_like_site.inline(t)
        print(unpatched[0], versions, counts, dict(memgather.stats().by_strategy))
    """,
    )
    assert out.split("\n")[0] == (
        "[1, 1] [[1, 1], [1, 1], [1, 1], [1, 1]] {'made_like_as_kept': 6, 'rebinds_as_kept': 2} {'rebind': 8}"
    ), out


@needs_rebind
def test_while_a_tracer_runs_a_proven_sites_slots_are_read_in_full(tmp_path: Any) -> None:
    """A trace or profile function may run code between any two statements: while one is set, a
    proven site's kept plan reads each slot in full; once it is gone, only who holds each."""
    path = _site_module(
        tmp_path,
        """
        import torch
        import torch.distributed as dist

        def bound(t):
            out = [torch.ones_like(t) for _ in range(2)]
            dist.all_gather(out, t)
    """,
    )
    out = _on_fake_with_site(
        path,
        """
        t = torch.ones(256)
        patched()
        made_like_site.bound(t)  # planned in full
        for install in (sys.settrace, sys.setprofile):
            install(lambda frame, event, arg: None)
            made_like_site.bound(t)
            install(None)
        made_like_site.bound(t)
        print(counts, dict(memgather.stats().by_strategy))
    """,
    )
    assert out.split("\n")[0] == "{'made_like_as_kept': 1, 'rebinds_as_kept': 3} {'rebind': 4}", out


@needs_rebind
@pytest.mark.parametrize("made", ["transposed", "requires_grad", "inference", "negative_bit", "the_input"])
def test_a_kernel_registered_over_the_factory_cannot_make_a_proven_site_rebind_what_torch_would_not(
    tmp_path: Any, made: str
) -> None:
    """A CPU kernel registered over ``aten::empty_like`` that breaks its contract: the proven site's
    slots are found so by the cheap reads (or a read that raises), and planned in full: the strides,
    grad and versions torch leaves, or torch's own error."""
    path = _site_module(
        tmp_path,
        """
        import torch
        import torch.distributed as dist

        def bound(t):
            out = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(out, t, async_op=True).wait()
            return [(slot.stride(), slot.requires_grad, slot.is_inference(), slot.is_neg()) for slot in out]
    """,
    )
    body = f"""
        sys.path.insert(0, {path!r})
        import made_like_site
        on = [False]
        def empty_like(t, *args, **kwargs):
            if not on[0]:
                return torch.empty(t.shape, dtype=t.dtype)
            if {made!r} == "transposed":
                return torch.empty(t.shape[::-1], dtype=t.dtype).t()
            if {made!r} == "requires_grad":
                return torch.empty(t.shape, dtype=t.dtype).requires_grad_()
            if {made!r} == "inference":
                with torch.inference_mode():
                    return torch.empty(t.shape, dtype=t.dtype)
            if {made!r} == "negative_bit":  # a tensor of its own whose reads negate its bytes
                made = torch.ones(t.shape, dtype=t.dtype)
                torch._C._set_neg(made, True)
                return made
            return t
        library = torch.library.Library("aten", "IMPL")
        library.impl("empty_like", empty_like, "CPU")
        def run():
            seen = []
            for call in range(3):
                on[0] = call == 2
                try:
                    seen.append(made_like_site.bound(torch.ones(2, 3)))
                except RuntimeError as error:
                    seen.append(str(error).split(".")[0])
                on[0] = False
            return seen
        unpatched = run()
        memgather.patch(["made_like_site"])
        core.configure(replace(core.settings(), nccl_min_bytes=0))
        patched = run()
        print(patched == unpatched, counts["made_like_as_kept"], unpatched[2])
    """
    out = run_on_fake(_SPIES + textwrap.dedent(body))
    assert out.split("\n")[0].startswith("True 2 "), out


@needs_rebind
def test_a_callee_or_globals_that_could_run_code_on_the_lookup_are_not_proven(tmp_path: Any) -> None:
    """The gather looked up through a class (whose metaclass could compute it), or run under globals
    that are a dict subclass (whose lookups run its code), or with a garbage collection callback
    registered (which runs between any two statements): the slots are read in full."""
    path = _site_module(
        tmp_path,
        """
        import torch
        import torch.distributed as dist

        class Comm:
            all_gather = dist.all_gather

        def through_class(t):
            out = [torch.ones_like(t) for _ in range(2)]
            Comm.all_gather(out, t)

        def plain(t):
            out = [torch.ones_like(t) for _ in range(2)]
            dist.all_gather(out, t)
    """,
    )
    out = run_on_fake(
        _SPIES
        + textwrap.dedent(f"""
        import gc, types
        sys.path.insert(0, {path!r})
        import made_like_site
        memgather.patch(["made_like_site"])
        core.configure(replace(core.settings(), nccl_min_bytes=0))
        made_like_site.Comm.all_gather = dist.all_gather  # the wrapper, installed after the import
        class Globals(dict):
            pass
        under_subclass = types.FunctionType(made_like_site.plain.__code__, Globals(vars(made_like_site)))
        t = torch.ones(256)
        for name, site in (("class", made_like_site.through_class), ("globals", under_subclass)):
            for name_ in list(counts):
                counts[name_] = 0
            for _ in range(3):
                site(t)
            print(name, counts)
        gc.callbacks.append(lambda phase, info: None)
        for name_ in list(counts):
            counts[name_] = 0
        for _ in range(3):
            made_like_site.plain(t)
        print("gc callback", counts)
        gc.callbacks.clear()
        for _ in range(2):
            made_like_site.plain(t)
        print("none", counts, dict(memgather.stats().by_strategy))
    """)
    )
    lines = out.split("\n")[:4]
    assert lines[:3] == [
        "class {'made_like_as_kept': 0, 'rebinds_as_kept': 3}",
        "globals {'made_like_as_kept': 0, 'rebinds_as_kept': 3}",
        "gc callback {'made_like_as_kept': 0, 'rebinds_as_kept': 3}",
    ], out
    assert lines[3].startswith("none {'made_like_as_kept': 2, 'rebinds_as_kept': 3}"), out


@needs_rebind
def test_a_factory_rebound_since_the_proof_sends_the_slots_to_the_full_check(tmp_path: Any) -> None:
    """The proof rests on ``torch.zeros_like`` being torch's: rebound to a function that keeps a view
    of what it makes, the slots are read in full again, and the view's slot is not rebound."""
    path = _site_module(
        tmp_path,
        """
        import torch
        import torch.distributed as dist

        def bound(t):
            out = [torch.zeros_like(t) for _ in range(2)]
            dist.all_gather(out, t)
    """,
    )
    out = _on_fake_with_site(
        path,
        """
        t = torch.ones(256)
        patched()
        for _ in range(3):
            made_like_site.bound(t)
        print(counts, dict(memgather.stats().by_strategy))
        views, real = [], torch.zeros_like
        def keeping(tensor):
            made = real(tensor)
            views.append(made[:1])
            return made
        torch.zeros_like = keeping
        memgather.reset_stats()
        for _ in range(3):
            made_like_site.bound(t)
        torch.zeros_like = real
        print(counts, dict(memgather.stats().by_strategy), dict(memgather.stats().fallbacks))
    """,
    )
    first, second = out.split("\n")[:2]
    assert first == "{'made_like_as_kept': 2, 'rebinds_as_kept': 1} {'rebind': 3}", out
    # Proven no more: the kept plan's next call reads its slots in full, finds a view kept, and each
    # call is planned in full and left to torch.
    assert second == "{'made_like_as_kept': 2, 'rebinds_as_kept': 2} {'fallback': 3} {'slots_shared': 3}", out


@needs_rebind
def test_slots_that_share_a_version_counter_are_left_as_torch_leaves_them() -> None:
    """Two slots that each hold a storage of their own alone, yet share one version counter (``x``
    and ``x.detach()`` after ``set_``): torch's list call bumps that counter once per slot."""
    out = run_on_fake(
        textwrap.dedent("""
        from dataclasses import replace
        def slots():
            a = torch.zeros(4)
            b = a.detach()
            b.set_(torch.zeros(4))
            return [a, b]
        def run(calls):
            seen = []
            for _ in range(calls):
                got = slots()
                user["site"](got, torch.ones(4))
                seen.append([slot._version for slot in got])
            return seen
        exec(compile('import torch, torch.distributed as dist\\n'
                     'def site(slots, t):\\n'
                     '    dist.all_gather(slots, t)\\n', '<user>', 'exec'), user)
        print(run(4))
        memgather.patch(["user_code"])
        core.configure(replace(core.settings(), nccl_min_bytes=0))
        print(run(4), dict(memgather.stats().by_strategy))
    """)
    )
    torch_run, memgather_run = out.split("\n")[:2]
    assert memgather_run == torch_run + " {'rebind': 4}", out


@needs_rebind
def test_one_code_under_other_globals_or_a_shadowed_builtin_is_proven_anew(tmp_path: Any) -> None:
    """A proof rests on the names it resolved in the globals it was made under: the same code run
    under another globals dict (whose ``torch`` makes float64 slots), or a global that now hides a
    builtin the proof resolved, is proven anew, and torch's error is what the caller gets."""
    path = _site_module(tmp_path, """
        import torch
        import torch.distributed as dist

        def gather(t):
            out = [torch.zeros_like(t) for _ in range(2)]
            dist.all_gather(out, t)
            return out
    """)
    out = run_on_fake(textwrap.dedent(f"""
        sys.path.insert(0, {path!r})
        import types
        from dataclasses import replace
        import made_like_site
        shim = types.ModuleType("torch_shim")
        shim.__dict__.update(vars(torch))
        shim.zeros_like = lambda t: torch.zeros(t.shape, dtype=torch.float64)
        other = types.FunctionType(made_like_site.gather.__code__, dict(vars(made_like_site), torch=shim), "gather")
        t = torch.ones(256)
        def outcome(function):
            try:
                function(t)
                return "ok"
            except Exception as error:
                return type(error).__name__
        def run():
            return [outcome(made_like_site.gather) for _ in range(3)] + [outcome(other)]
        unpatched = run()
        memgather.patch(["made_like_site"])
        core.configure(replace(core.settings(), nccl_min_bytes=0))
        print(unpatched, run())
        made_like_site.range = lambda n: [0, 1]  # a global hides the builtin the comprehension steps through
        print(outcome(made_like_site.gather), dict(memgather.stats().by_strategy))
    """))
    first, second = out.splitlines()[:2]
    assert first == "['ok', 'ok', 'ok', 'ValueError'] ['ok', 'ok', 'ok', 'ValueError']", out
    assert second.startswith("ok {'rebind': 4"), out
