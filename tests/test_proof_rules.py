"""Each entry of the elision proof's tables, and each of its small rules, held by a call site of its own.

Read statically (``memgather.patching.callsites``, as ``memgather doctor`` reads a library),
in seconds: a fault in one entry (a cat, a factory, a frame reader forgotten or misspelt)
changes one verdict here. The mutation run over the proof (``tox -e mutation``) uses these
with tests/test_proof.py's static cases; the live behaviour of each kind of site is
tests/test_proof.py's.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import re
import textwrap
from pathlib import Path
from typing import Any, List

import pytest

from memgather.patching import callsites, flow, proof

_HEAD = """\
import builtins
import inspect
import pdb
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d
import torch.distributed.nn
import torch.distributed.nn.functional

"""
_counter = itertools.count()

# What the proof must recognise, written out here (not read from its own tables, which a fault in
# them would change along with the cases).
CATS = ("torch.cat", "torch.concat", "torch.concatenate", "torch.stack")
GATHERS = ("torch.distributed.all_gather", "torch.distributed.distributed_c10d.all_gather", "dist.all_gather")
FUNCTION_GATHERS = ("torch.distributed.nn.all_gather", "torch.distributed.nn.functional.all_gather")
FACTORIES = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "empty",
             "zeros", "ones", "full", "rand", "randn", "empty_strided", "tensor")
FRESH_METHODS = ("clone", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
FRAME_ATTRIBUTES = ("_getframe", "currentframe", "f_locals", "getouterframes", "getinnerframes", "set_trace", "locals",
                    "vars", "exec")
FRAME_READERS = ("builtins.locals", "builtins.vars", "builtins.dir", "builtins.exec", "builtins.eval",
                 "builtins.breakpoint", "sys._getframe", "inspect.currentframe", "inspect.stack", "inspect.trace",
                 "pdb.set_trace")


def _sites(tmp_path: Path, body: str) -> List[callsites.CallSite]:
    name = f"rule_{next(_counter)}"
    path = tmp_path / f"{name}.py"
    path.write_text(_HEAD + textwrap.dedent(body))
    return callsites.of_file(str(path), name)


def _verdict(tmp_path: Path, body: str, qualname: str = "case") -> proof.Verdict:
    [site] = [site for site in _sites(tmp_path, body) if site.qualname == qualname]
    return site.verdict


def _gatherer(make: str = "torch.empty_like(t)", gather: str = "dist.all_gather(slots, t)", after: str = "") -> str:
    return f"""
def case(t):
    slots = [{make} for _ in range(2)]
    {gather}
    {after or "return torch.cat(slots)"}
"""


@pytest.mark.parametrize("cat", CATS)
def test_each_cat_is_a_hand_over(tmp_path: Path, cat: str) -> None:
    found = _verdict(tmp_path, _gatherer(after=f"return {cat}(slots)"))
    assert found.proven and not found.needs_cow and not found.returned, found
    assert found.reason.startswith("drops the list after the cat at line"), found


@pytest.mark.parametrize("other", ["torch.hstack", "torch.vstack", "torch.row_stack", "sum"])
def test_another_function_of_the_list_is_not(tmp_path: Path, other: str) -> None:
    found = _verdict(tmp_path, _gatherer(after=f"return {other}(slots)"))
    assert not found.proven and "not by a cat" in found.reason, found


@pytest.mark.parametrize("cat", ["torch.cat(slots, 1)", "torch.cat(slots, dim=-1)", "torch.cat(slots, out=o)",
                                 "torch.cat(*slots)", "torch.cat(slots, dim=d)", "torch.stack(slots, axis=0)"])
def test_a_cat_other_than_along_dim_0_into_a_new_tensor_is_not(tmp_path: Path, cat: str) -> None:
    found = _verdict(tmp_path, _gatherer(after=f"o = d = 0\n    return {cat}"))
    assert not found.proven, found


@pytest.mark.parametrize("gather", GATHERS)
def test_each_spelling_of_torchs_list_gather_is_a_gather(tmp_path: Path, gather: str) -> None:
    found = _verdict(tmp_path, _gatherer(gather=f"{gather}(slots, t)"))
    assert found.proven, found


@pytest.mark.parametrize("gather", ["dist.all_gather(slots, *rest)", "dist.all_gather(tensor_list=slots, tensor=t)",
                                    "dist.all_gather(slots, tensor=t)", "dist.all_gather(slots, t, *rest)"])
def test_a_gather_however_its_arguments_are_passed_is_read(tmp_path: Path, gather: str) -> None:
    found = _verdict(tmp_path, _gatherer(gather=gather).replace("(t)", "(t, *rest)", 1))
    assert found.proven, found


@pytest.mark.parametrize("gather", ["dist.all_gather(*pair)", "dist.all_gather(**spec)"])
def test_a_gather_whose_list_is_not_written_out_is_not(tmp_path: Path, gather: str) -> None:
    found = _verdict(tmp_path, _gatherer(gather=f"pair, spec = (slots, t), {{}}\n    {gather}"))
    assert not found.proven, found


@pytest.mark.parametrize("factory", FACTORIES)
def test_each_factory_makes_fresh_slots(tmp_path: Path, factory: str) -> None:
    argument = "t" if factory.endswith("_like") else "t.shape"
    found = _verdict(tmp_path, _gatherer(make=f"torch.{factory}({argument})"))
    assert found.proven, found


@pytest.mark.parametrize("method", FRESH_METHODS)
def test_each_fresh_method_makes_fresh_slots(tmp_path: Path, method: str) -> None:
    found = _verdict(tmp_path, _gatherer(make=f"t.{method}()"))
    assert found.proven, found


@pytest.mark.parametrize("make", ["torch.as_tensor(t)", "t.view(-1)", "t", "t.detach()", "torch.from_numpy(t)"])
def test_anything_else_is_not_a_fresh_slot(tmp_path: Path, make: str) -> None:
    found = _verdict(tmp_path, _gatherer(make=make))
    assert not found.proven and "not a list of new tensors" in found.reason, found


def _forward(tmp_path: Path, returned: str) -> callsites.CallSite:
    """The call site of an autograd Function's forward that gathers and returns ``returned``."""
    body = f"""
class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        slots = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(slots, t)
        return {returned}
"""
    [site] = _sites(tmp_path, body)
    assert site.role == "forward", site
    return site


@pytest.mark.parametrize("returned", ["slots", "tuple(slots)", "list(slots)"])
def test_a_forward_hands_its_list_on_whole(tmp_path: Path, returned: str) -> None:
    site = _forward(tmp_path, returned)
    assert site.verdict.proven and site.verdict.reason.startswith("returns the list whole at line"), site


@pytest.mark.parametrize("returned", ["sorted(slots)", "slots[:]", "set(slots)", "tuple(slots, )[0]"])
def test_a_forward_that_hands_on_anything_else_is_not(tmp_path: Path, returned: str) -> None:
    site = _forward(tmp_path, returned)
    assert not site.verdict.proven, site


@pytest.mark.parametrize("function", FUNCTION_GATHERS)
def test_each_spelling_of_the_all_gathering_function_is_received(tmp_path: Path, function: str) -> None:
    body = f"""
def case(t):
    return torch.cat({function}(t))
"""
    [site] = _sites(tmp_path, body)
    assert site.role == "receiver" and site.verdict.proven, site


@pytest.mark.parametrize("reader", ["locals()", "vars()", "dir()", "exec('0')", "eval('0')", "breakpoint()"])
def test_each_builtin_that_reads_the_frame_refuses(tmp_path: Path, reader: str) -> None:
    found = _verdict(tmp_path, _gatherer(after=f"seen = {reader}\n    return torch.cat(slots)"))
    assert not found.proven and "reads its own frame" in found.reason, found


@pytest.mark.parametrize("reader", ["vars(t)", "dir(t)"])
def test_vars_and_dir_of_an_object_read_no_frame(tmp_path: Path, reader: str) -> None:
    found = _verdict(tmp_path, _gatherer(after=f"seen = {reader}\n    return torch.cat(slots)"))
    assert found.proven, found


@pytest.mark.parametrize("attribute", FRAME_ATTRIBUTES)
def test_each_attribute_that_reaches_frames_refuses(tmp_path: Path, attribute: str) -> None:
    found = _verdict(tmp_path, _gatherer(after=f"seen = t.{attribute}\n    return torch.cat(slots)"))
    assert not found.proven and f"reads frames (.{attribute})" in found.reason, found


@pytest.mark.parametrize("reader", FRAME_READERS)
def test_each_frame_reader_under_another_name_refuses(tmp_path: Path, reader: str) -> None:
    module, _, name = reader.rpartition(".")
    body = f"""
def case(t):
    from {module} import {name} as innocent
    slots = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(slots, t)
    seen = innocent()
    return torch.cat(slots)
"""
    found = _verdict(tmp_path, body)
    assert not found.proven and f"reads its own frame ({reader})" in found.reason, found


def test_a_use_after_the_cat_says_what_the_proof_rests_on(tmp_path: Path) -> None:
    found = _verdict(tmp_path, _gatherer(after="result = torch.cat(slots)\n    return result, slots[0]"))
    assert found.proven and found.needs_cow, found
    assert found.reason.startswith("first used after the gather by the cat at line"), found
    assert "slots is used again after line" in found.reason and "copy-on-write" in found.reason, found


@pytest.mark.parametrize("replaced", ["slots[0] = t", "slots[dist.get_rank()] = t.clone()", "slots[-1] = None"])
def test_a_returned_list_may_have_items_replaced(tmp_path: Path, replaced: str) -> None:
    found = _verdict(tmp_path, _gatherer(after=f"{replaced}\n    return slots"))
    assert found.proven and found.needs_cow and found.returned, found
    assert found.reason.startswith("returns the list at line") and "checked at run time" in found.reason, found


@pytest.mark.parametrize("use", ["slots[0] += 1", "slots[0:1] = [t]", "slots[0] = slots[1]", "slots[0].add_(1)",
                                 "slots.append(t)", "slots[0], slots[1] = t, t", "x = slots[0]"])
def test_a_returned_list_used_any_other_way_is_not(tmp_path: Path, use: str) -> None:
    found = _verdict(tmp_path, _gatherer(after=f"{use}\n    return slots"))
    assert not found.proven and "not by a cat" in found.reason, found


def test_a_refusal_proves_nothing_else() -> None:
    refused: Any = proof.refuse("why")
    assert (refused.proven, refused.like_input, refused.needs_cow, refused.returned) == (False, False, False, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        refused.proven = True  # a verdict is kept per call site and shared: nothing may change it


def _passes_on(tmp_path: Path, body: str) -> proof.Verdict:
    """``proof.passes_on`` on the one function of ``body`` and its call of ``hand``."""
    path = tmp_path / f"hand_{next(_counter)}.py"
    path.write_text(textwrap.dedent(body))
    function = ast.parse(path.read_text()).body[0]
    [call] = [node for node in ast.walk(function) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "hand"]
    return proof.passes_on(function, call)


def test_a_frame_that_returns_the_value_as_it_is_passes_it_on(tmp_path: Path) -> None:
    found = _passes_on(tmp_path, "def helper(t):\n    return hand(t)\n")
    assert found.proven and found.reason.startswith("returns the call's value at line 2"), found


@pytest.mark.parametrize("body", ["def helper(t):\n    x = hand(t)\n    return x\n",
                                  "def helper(t):\n    return list(hand(t))\n",
                                  "def helper(t):\n    hand(t)\n    return None\n"])
def test_a_frame_that_does_anything_else_with_it_does_not(tmp_path: Path, body: str) -> None:
    found = _passes_on(tmp_path, body)
    assert not found.proven and re.match(r"line \d+: does not return the gathered tensors as they are$", found.reason)


@pytest.mark.parametrize(
    "body,why",
    [
        (_gatherer(gather="dist.all_gather(slots, slots[0])"), "slots is used again in the statement that gathers"),
        (_gatherer(gather="slots = dist.all_gather(slots, t)"), "slots is used again in the statement that gathers"),
        (_gatherer(gather="[dist.all_gather(slots, t) for _ in range(1)]"), "the gather is inside a comprehension"),
        (_gatherer(gather="dist.all_gather(slots[:], t)"), "the gathered list is not a local name"),
        (_gatherer(after="return torch.cat(slots), slots"), "slots is used after the gather at line"),
    ],
)
def test_each_refusal_names_its_line_and_its_reason(tmp_path: Path, body: str, why: str) -> None:
    found = _verdict(tmp_path, body)
    assert not found.proven and re.match(r"line \d+: ", found.reason) and why in found.reason, found



# Ways the list escapes or is bound other than by the function's own fresh list: each refused, by
# the rule that names it (the kinds of binding a fault could forget: for, with, +=, :=, a parameter).
ESCAPES = {
    "walrus_in_if": ("if (slots := [torch.empty_like(t) for _ in range(2)]):\n        pass", "bound by :="),
    "global": ("global slots", "declared global"),  # (stated first: Python wants it before any binding)
    "closure": ("keep = lambda: slots", "captured by a nested function"),
    "nested_def": ("def keep():\n        return slots", "captured by a nested function"),
    "comprehension": ("sizes = [s.shape for s in slots]", "read inside a comprehension"),
    "generator": ("sizes = list(s.shape for s in slots)", "read inside a comprehension"),
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_each_escape_of_the_list_is_refused(tmp_path: Path, name: str) -> None:
    line, why = ESCAPES[name]
    first, then = (line, "") if name == "global" else ("", line)
    body = f"""
def case(t):
    {first}
    slots = [torch.empty_like(t) for _ in range(2)]
    {then}
    dist.all_gather(slots, t)
    return torch.cat(slots)
"""
    found = _verdict(tmp_path, body)
    assert not found.proven and why in found.reason and re.match(r"line \d+: ", found.reason), found


REBOUND = {
    "for": "for slots in [[torch.empty_like(t)] * 2]:\n        pass",
    "with": "with contextlib.nullcontext([t, t]) as slots:\n        pass",
    "augmented": "slots += [torch.empty_like(t)]",
    "parameter_on_one_path": "if flag:\n        slots = [torch.empty_like(t) for _ in range(2)]",
    "tuple_target": "slots, other = [torch.empty_like(t)] * 2, None",
    "annotated_alone": "slots: list",
}


@pytest.mark.parametrize("name", sorted(REBOUND))
def test_a_list_bound_to_anything_but_fresh_slots_on_some_path_is_refused(tmp_path: Path, name: str) -> None:
    body = f"""
import contextlib


def case(t, flag=True, slots=None):
    {"slots = [torch.empty_like(t) for _ in range(2)]" if name not in ("parameter_on_one_path", "annotated_alone") else ""}
    {REBOUND[name]}
    dist.all_gather(slots, t)
    return torch.cat(slots)
"""
    found = _verdict(tmp_path, body)
    assert not found.proven and re.match(r"(line \d+: )?slots is ", found.reason), found


def test_a_cat_inside_a_loop_is_the_first_use_only_where_every_path_enters_it(tmp_path: Path) -> None:
    entered = """
def case(t):
    slots = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(slots, t)
    while True:
        out = torch.cat(slots)
        break
    return out
"""
    found = _verdict(tmp_path, entered)
    assert found.proven and not found.needs_cow, found
    maybe = entered.replace("while True:", "while t.numel() > 3:").replace("return out", "return slots")
    found = _verdict(tmp_path, maybe)
    assert not found.proven and "not by a cat" in found.reason, found  # the loop may not run: the return reads it


def test_a_continue_through_a_finally_reaches_the_next_iterations_gather(tmp_path: Path) -> None:
    """The next iteration gathers into the list the cat already used: a read before its gather."""
    body = """
def case(t):
    slots = [torch.empty_like(t) for _ in range(2)]
    outs = []
    for _ in range(2):
        try:
            dist.all_gather(slots, t)
            outs.append(torch.cat(slots))
            continue
        finally:
            pass
    return outs
"""
    found = _verdict(tmp_path, body)
    assert not found.proven and "used before the gather" in found.reason, found


# After the cat, a statement that binds the list's name anew: the read that follows is of the new
# object (dropped after the cat); one that binds another name leaves the read a use of the list.
# A match's capture binds only in its case: the read is made there.
REBINDS = {
    "def": "def {n}():\n        return 0\n    return result, slots",
    "class": "class {n}:\n        pass\n    return result, slots",
    "import": "import os as {n}\n    return result, slots",
    "import_dotted": "import os.path as {n}\n    return result, slots",
    "from_import": "from os import path as {n}\n    return result, slots",
    "assign": "{n} = None\n    return result, slots",
    "match_capture": "match 0:\n        case {n}:\n            return result, slots\n    return result",
    "match_star": "match []:\n        case [*{n}]:\n            return result, slots\n    return result",
    "match_rest": "match {{}}:\n        case {{**{n}}}:\n            return result, slots\n    return result",
}


@pytest.mark.parametrize("kind", sorted(REBINDS))
@pytest.mark.parametrize("same", [True, False], ids=["the_list", "another_name"])
def test_a_binding_after_the_cat_ends_the_list_only_where_it_binds_its_name(
    tmp_path: Path, kind: str, same: bool
) -> None:
    rest = REBINDS[kind].format(n="slots" if same else "other")
    found = _verdict(tmp_path, _gatherer(after=f"result = torch.cat(slots)\n    {rest}"))
    assert found.proven, found
    assert found.needs_cow is not same, found  # a read of the list itself after the cat needs copy-on-write


# Call sites on which a fault of the proof (a mutant of proof.py or flow.py that the cases above
# let pass: tox -e mutation) changes a verdict: the cat proof's (role, proven, reason) of each
# site, and the made-like proof's reason for each gather (slots_like_input; "" where proven).
# Each verdict is the proof's as it stands: a change to one is a change of a rule, to be made
# on purpose.
PINNED = {
    'assert_before_cat': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            assert slots
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 15: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'cat_three_args': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots, 0, t)
""",
        [('gatherer', False, 'line 15: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'comprehension_two_for': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2) for __ in range(1) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ['line 13: the list comprehension has more than one plain for'],
    ),
    'fn_gather_forward': (
        """\
        def case(t):
            return torch.distributed.nn.all_gather(t)
""",
        [('receiver', False, 'line 13: the gathered tensors are neither bound to a name nor concatenated')],
        [],
    ),
    'fn_gather_stack': (
        """\
        def case(t):
            return torch.stack(torch.distributed.nn.functional.all_gather(t))
""",
        [('receiver', True, 'concatenates the gathered tensors at once at line 13')],
        [],
    ),
    'frame_attr': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            sys._getframe().f_locals
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 15: the function reads frames (.f_locals)')],
        ['line 15: the function reads frames (.f_locals)'],
    ),
    'group_call': (
        """\
        def case(t, get=None):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t, group=get())
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ['line 14: an argument of the gather is neither a name nor a constant'],
    ),
    'import_local': (
        """\
        def case(t):
            import torch.distributed as d2
            slots = [torch.empty_like(t) for _ in range(2)]
            d2.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 16')],
        [''],
    ),
    'in_finally': (
        """\
        def case(t):
            try:
                pass
            finally:
                slots = [torch.empty_like(t) for _ in range(2)]
                dist.all_gather(slots, t)
                return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 18')],
        [''],
    ),
    'in_for_else': (
        """\
        def case(t):
            for i in range(2):
                pass
            else:
                slots = [torch.empty_like(t) for _ in range(2)]
                dist.all_gather(slots, t)
                return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 18')],
        [''],
    ),
    'inspect_stack': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            inspect.stack()
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 15: the function reads its own frame (inspect.stack())')],
        ['line 15: the function reads its own frame'],
    ),
    'inspect_trace': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            inspect.trace()
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 15: the function reads its own frame (inspect.trace())')],
        ['line 15: the function reads its own frame'],
    ),
    'kw_list_is_slots': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t, group=slots)
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 14: slots is used again in the statement that gathers into it')],
        ['line 14: slots is used again in the statement that gathers into it'],
    ),
    'lambda_gather': (
        """\
        def case(t):
            f = lambda s: dist.all_gather(s, t)
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 16')],
        ['line 13: t is captured by a nested function or class'],
    ),
    'locals_call': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            locals()
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 15: the function reads its own frame (locals())')],
        ['line 15: the function reads its own frame'],
    ),
    'mangled': (
        """\
        class A:
            def case(self, t):
                __slots = [torch.empty_like(t) for _ in range(2)]
                dist.all_gather(__slots, t)
                return torch.cat(__slots)
""",
        [('gatherer', False, 'line 14: __slots is a private name (mangled inside a class): not followed')],
        ['line 14: __slots is a private name (mangled inside a class): not followed'],
    ),
    'new_empty': (
        """\
        def case(t):
            slots = [t.new_empty(t.shape) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ['line 13: not every slot is torch.empty_like, zeros_like or ones_like of t'],
    ),
    'one_arg': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ['line 14: the gathered tensor is not a local name'],
    ),
    'param_list': (
        """\
        def case(t, slots):
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', False, 'slots is not bound to a list in this function before the gather (a parameter, or unbound)')],
        ['line 13: slots is not bound by the statement just before the gather'],
    ),
    'reached_global': (
        """\
        def case(t):
            global slots
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 13: slots is declared global')],
        ['line 13: slots is declared global or nonlocal'],
    ),
    'reached_nonlocal': (
        """\
        def outer(t):
            slots = None
            def case():
                nonlocal slots
                slots = [torch.empty_like(t) for _ in range(2)]
                dist.all_gather(slots, t)
                return torch.cat(slots)
            return case
""",
        [('gatherer', False, 'line 15: slots is declared nonlocal')],
        ['line 17: t is not a local of the function'],
    ),
    'return_none': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return
""",
        [('gatherer', False, 'line 14: slots is never concatenated')],
        [''],
    ),
    'star_third': (
        """\
        def case(t, *rest):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t, *rest)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ["line 14: the gather's arguments are unpacked"],
    ),
    'tensor_kw': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, tensor=t)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        [''],
    ),
    'try_else': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            try:
                pass
            except Exception:
                pass
            else:
                slots.append(1)
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 20: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'try_finally_after': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            try:
                r = torch.cat(slots)
            finally:
                slots.append(1)
            return r
""",
        [('gatherer', True, "first used after the gather by the cat at line 16 (line 18: slots is used again after line 16; proven where the cat's result is copy-on-write)")],
        [''],
    ),
    'walrus_gather': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            (w := dist.all_gather(slots, t))
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ['line 14: the gather is part of a larger expression'],
    ),
    'returned_finally_reads': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            try:
                return slots
            finally:
                print(len(slots))
""",
        [('gatherer', False, 'line 16: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'positional_group_call_and_kw': (
        """\
        def case(t, get=None):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t, get(), async_op=False)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ['line 14: an argument of the gather is neither a name nor a constant'],
    ),
    'bound_binop': (
        """\
        def case(t):
            slots = [torch.empty_like(t)] * 2
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 13: slots is bound to something that is not a list of new tensors')],
        ['line 13: slots is not bound to a list display or comprehension'],
    ),
    'fn_gather_in_comprehension_deep': (
        """\
        def case(t):
            return [torch.cat(torch.distributed.nn.all_gather(t)) + 0 for _ in range(2)]
""",
        [('receiver', False, 'line 13: the call is inside a comprehension or lambda')],
        [],
    ),
    'fresh_bad_binding_then_loop': (
        """\
        def case(t, f):
            if f:
                slots = f()
            else:
                slots = [torch.empty_like(t) for _ in range(2)]
            for i in range(2):
                pass
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 14: slots is bound to something that is not a list of new tensors')],
        ['line 19: slots is not bound by the statement just before the gather'],
    ),
    'bad_then_reuse_else': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            if t.numel():
                x = slots[1]
                r = torch.cat(slots)
            else:
                r = torch.cat(slots)
                x = slots[0]
            return r
""",
        [('gatherer', False, 'line 20: slots is used again after line 19')],
        [''],
    ),
    'if_two_cats': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            if t.numel():
                return torch.cat(slots)
            else:
                return torch.stack(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 16, 18')],
        [''],
    ),
    'cat_tensors_kw_out': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(tensors=slots, out=t)
""",
        [('gatherer', False, 'line 15: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'except_type_reads': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            try:
                r = torch.cat(slots)
            except slots[0]:
                pass
            return r
""",
        [('gatherer', True, "first used after the gather by the cat at line 16 (line 15: slots is used again after line 16; proven where the cat's result is copy-on-write)")],
        [''],
    ),
    'import_dotted_binds_top': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            r = torch.cat(slots)
            import slots.sub
            return r, slots
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        [''],
    ),
    'gather_in_nested_statement_expr': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            def f(a=dist.all_gather(slots, t)):
                pass
            return torch.cat(slots)
""",
        [('gatherer', False, "line 14: the gather is not a statement of the function's own")],
        ['line 14: t is not a local of the function'],
    ),
    'like_gather_not_resolved': (
        """\
        def case(t, dist=None):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ['line 14: the gather is not torch.distributed.all_gather, looked up through modules'],
    ),
    'like_list_attr': (
        """\
        def case(t, self=None):
            dist.all_gather(self.slots, t)
            return torch.cat(self.slots)
""",
        [('gatherer', False, 'line 13: the gathered list is not a local name')],
        ['line 13: the gathered list is neither written in the call nor a local name'],
    ),
    'like_binds_t': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for t in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ['line 13: the comprehension binds t, or something other than a name'],
    ),
    'like_not_range': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in [0, 1]]
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 15')],
        ['line 13: the comprehension steps through something other than a range'],
    ),
    'walrus_binds_t': (
        """\
        def case(u):
            if (t := u):
                pass
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', True, 'drops the list after the cat at line 17')],
        ['line 13: t is bound by :='],
    ),
    'fn_gather_reads_own_name': (
        """\
        def case(x):
            x = torch.distributed.nn.all_gather(x)
            return torch.cat(x)
""",
        [('receiver', False, 'line 13: x is used in the statement that binds it')],
        [],
    ),
    'fn_gather_bound_then_cat': (
        """\
        def case(t):
            x = torch.distributed.nn.all_gather(t)
            return torch.cat(x)
""",
        [('receiver', True, 'drops the tensors after the cat at line 14')],
        [],
    ),
    'frame_reader_named': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            inspect.currentframe()
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 15: the function reads its own frame (inspect.currentframe)')],
        ['line 15: the function reads its own frame'],
    ),
    'cat_starred': (
        """\
        def case(t, *rest):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots, *rest)
""",
        [('gatherer', False, 'line 15: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'revisit_then_bad_branch': (
        """\
        def case(t, f, g):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            if f:
                y = slots[0]
                r = torch.cat(slots)
            else:
                while g:
                    g = g - 1
                r = torch.cat(slots)
            return r
""",
        [('gatherer', False, 'line 16: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'gather_raises_into_a_handler_that_reads_the_list': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            try:
                dist.all_gather(slots, t)
            except RuntimeError:
                return slots
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 17: slots is used after the gather at line 15, not by a cat')],
        ['line 15: slots is not bound by the statement just before the gather'],
    ),
    'factory_of_another_module_by_a_factorys_name': (
        """\
        def case(t):
            slots = [builtins.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 13: slots is bound to something that is not a list of new tensors')],
        ['line 13: not every slot is torch.empty_like, zeros_like or ones_like of t'],
    ),
    'if_reads_the_list_before_the_cat': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            if slots:
                return torch.cat(slots)
""",
        [('gatherer', False, 'line 15: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'while_reads_the_list_before_the_cat': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            while not slots:
                pass
            return torch.cat(slots)
""",
        [('gatherer', False, 'line 15: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'all_gathered_tensors_given_to_a_call_that_is_not_a_cat': (
        """\
        def case(t):
            return sorted(torch.distributed.nn.all_gather(t))
""",
        [('receiver', False, 'line 13: the gathered tensors are neither bound to a name nor concatenated')],
        [],
    ),
    'a_handler_binds_the_lists_name_after_the_cat': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            try:
                return torch.cat(slots)
            except RuntimeError as slots:
                raise ValueError(str(slots))
""",
        [('gatherer', True, 'drops the list after the cat at line 16')],
        [''],
    ),
    'cat_and_a_slot_in_one_statement': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return torch.cat(slots) + slots[0]
""",
        [('gatherer', False, 'line 15: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
    'list_then_its_cat_in_one_statement': (
        """\
        def case(t):
            slots = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(slots, t)
            return slots, torch.cat(slots)
""",
        [('gatherer', False, 'line 15: slots is used after the gather at line 14, not by a cat')],
        [''],
    ),
}


def _like(tmp_path: Path, body: str) -> List[str]:
    """``proof.slots_like_input`` for each gather of the module, as a live frame resolves names
    (the builtin ``range`` included), in the order of the module's functions."""
    name = f"rule_{next(_counter)}"
    path = tmp_path / f"{name}.py"
    path.write_text(_HEAD + textwrap.dedent(body))
    tree = ast.parse(path.read_text())
    imported = callsites._imports(tree.body, "")
    found = []
    for function, _, _ in callsites._functions(tree):
        plain = callsites._resolver(function, imported, "")

        def resolve(expression: ast.expr, plain: Any = plain) -> Any:
            return "range" if isinstance(expression, ast.Name) and expression.id == "range" else plain(expression)

        for call in callsites._own_calls(function):
            if (resolve(call.func) or callsites._SPELLED.get(callsites._dotted(call.func))) in proof.GATHERS:
                found.append(proof.slots_like_input(function, call, resolve))
    return found


@pytest.mark.parametrize("name", sorted(PINNED))
def test_each_site_a_fault_of_the_proof_once_passed_keeps_its_verdict(tmp_path: Path, name: str) -> None:
    body, verdicts, like = PINNED[name]
    found = sorted((site.role, site.verdict.proven, site.verdict.reason) for site in _sites(tmp_path, body))
    assert found == sorted(verdicts)
    assert _like(tmp_path, body) == like


def _statement(source: str) -> Any:
    return ast.parse(textwrap.dedent(source)).body[0]


def test_the_names_each_kind_of_node_binds_and_what_its_import_reads() -> None:
    """``proof.bindings``, which the live resolver asks of every statement of a function."""
    module_of = lambda node: node.module  # noqa: E731
    assert proof.bindings(_statement("import a.b"), module_of) == [("a", ("a", ""))]
    assert proof.bindings(_statement("import a.b as c"), module_of) == [("c", ("a.b", ""))]
    assert proof.bindings(_statement("from a.b import c as d, e"), module_of) == [("d", ("a.b", "c")), ("e", ("a.b", "e"))]
    handlers = _statement("try:\n    pass\nexcept E as e:\n    pass\nexcept F:\n    pass").handlers
    assert [proof.bindings(h, module_of) for h in handlers] == [[("e", None)], []]
    match = _statement("match x:\n    case [a, *rest]:\n        pass\n    case {**kw}:\n        pass\n    case _:\n        pass")
    patterns = {type(node).__name__ + ":" + str(getattr(node, "name", None) or getattr(node, "rest", None)): node
                for node in ast.walk(match) if type(node).__name__ in ("MatchAs", "MatchStar", "MatchMapping")}
    found = {key: proof.bindings(node, module_of) for key, node in patterns.items()}
    assert found == {"MatchAs:a": [("a", None)], "MatchStar:rest": [("rest", None)], "MatchMapping:kw": [("kw", None)],
                     "MatchAs:None": []}
    alias = _statement("import a").names[0]  # an alias has a name of its own, and binds nothing by itself
    assert proof.bindings(alias, module_of) == []


def test_the_calls_a_frame_may_be_making() -> None:
    """``proof.calls_at``: the call at the recorded span, or (without one) every call on the line, outermost first."""
    function = _statement("def f():\n    a(b(1))\n    c()\n")
    outer = function.body[0].value
    inner = outer.args[0]
    assert proof.calls_at(function, 2, None) == [outer, inner]
    assert proof.calls_at(function, 3, None) == [function.body[1].value]
    span = (inner.lineno, inner.end_lineno, inner.col_offset, inner.end_col_offset)
    assert proof.calls_at(function, 2, span) == [inner]
    assert proof.calls_at(function, 2, (2, 2, 0, 1)) == []


def _node(*parts: Any) -> Any:
    return flow.Node(1, 1, (), tuple(parts))


def test_what_a_node_binds_part_by_part() -> None:
    """``flow.binds`` reads every part of a node: a part that binds another name (or nothing) does not end the search."""
    assignment = _statement("slots = 2")
    for other in ("def other(): slots = 1", "class Other: slots = 1", "import os", "from os import path",
                  "x: int", "slots += [1]"):
        assert flow.binds(_node(_statement(other), assignment), "slots"), other
    handler = _statement("try:\n    pass\nexcept E as e:\n    pass").handlers[0]
    assert flow.binds(_node(handler, assignment), "slots") and flow.binds(_node(handler), "e")
    assert flow.binds(_node(_statement("def slots(): pass")), "slots")
    assert flow.binds(_node(_statement("import slots.sub")), "slots") and not flow.binds(_node(_statement("import a.slots")), "slots")
    for alone in ("def other(): slots = 1", "slots: list", "slots += [1]", "x = [slots for slots in range(2)]",
                  "f = lambda slots: slots"):
        assert not flow.binds(_node(_statement(alone)), "slots"), alone
    assert flow.binds(_node(_statement("slots = [x for x in range(2)]")), "slots")


def test_an_exception_of_a_with_item_meets_the_exits_of_the_items_before_it_only() -> None:
    """``with a as x, b as y``: what ``b`` raises passes ``a``'s ``__exit__``, which may swallow it (the
    code after the with runs next); what ``a`` raises meets no ``__exit__`` of this with."""
    function = _statement("def f(a, b):\n    with a as x, b as y:\n        z = 1\n    w = 2\n")
    graph = flow.Graph(function)
    after = next(node.index for node in graph.nodes if node.line == 4)
    first, second = (next(node for node in graph.nodes if node.reads and getattr(node.reads[0], "id", None) == name)
                     for name in ("a", "b"))
    assert after not in first.exc and after in second.exc
    body = next(node for node in graph.nodes if node.line == 3)
    assert after in body.exc
