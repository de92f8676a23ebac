"""Cat elision's default, proven from the call site's code (memgather.patching.proof), tested differentially.

The fixed call sites of tests/sites/proof_cases.py (shapes copied from
accelerate, transformers, ignite, Lightning, MoCo, a GatherLayer; and one refusal
for each way a list can be used after the cat or escape before it) are read
statically and run on 2 gloo ranks under torch and under memgather's default.
Hypothesis then writes functions of its own into files (the proof reads source
files, as it does in a user's job): ones that drop the list, wrapped in every
kind of block, must be elided; ones with a use after the gather or an escape
before it, anywhere and wrapped in anything, must not be. Either way the caller
must observe exactly what torch gives it: values, sharing between the returned
tensors, errors.
"""

from __future__ import annotations

import ast
import itertools
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from memgather import compat, cow
from memgather.patching import callsites, proof
from tests.conftest import EAGER, ROOT, unwrap
from tests.sites import proof_cases, proof_runs

CASES = Path(proof_cases.__file__)
EXAMPLES = int(os.environ.get("MEMGATHER_PROOF_EXAMPLES", "300"))
needs_rebind = pytest.mark.skipif(not compat.can_prove_exclusive(), reason="no storage use count: nothing is elided")


def test_the_static_proof_reads_each_case() -> None:
    """Read from the file, never imported: every torch all_gather call site gets the verdict its name says."""
    found = {site.qualname: site for site in callsites.of_file(str(CASES), "tests.sites.proof_cases")}
    for qualname, site in found.items():
        if qualname in proof_cases.RUNTIME_ONLY:
            assert site.verdict.proven, site.verdict  # what the file alone shows; the live proof refuses
            continue
        copy_on_write = qualname in proof_cases.COPY_ON_WRITE_ONLY
        expected = any(part.startswith("accepted_") for part in qualname.split(".")) or qualname == "GatherLayer.forward"
        assert site.verdict.proven is (expected or copy_on_write), (qualname, site.verdict)
        assert site.verdict.needs_cow is copy_on_write, (qualname, site.verdict)
    assert found["GatherLayer.forward"].role == "forward" and found["accepted_receiver"].role == "receiver"
    assert found["accepted_accelerate.<locals>._gpu_gather_one"].verdict.proven
    # Every refusal names the line and what happened there.
    reasons = {name: site.verdict.reason for name, site in found.items() if not site.verdict.proven or site.verdict.needs_cow}
    assert "slots is used again after line" in reasons["refused_scale_then_read_slot"]
    assert "copy-on-write" in reasons["refused_scale_then_read_slot"]
    assert "returns the list" in reasons["_simple_gather"]
    assert "not by a cat" in reasons["refused_returned_after_a_slot_is_read"]
    assert "not by a cat" in reasons["refused_returned_after_an_item_is_written.<locals>.gather"]
    assert "captured by a nested function" in reasons["refused_closure"]
    assert "reads its own frame (locals())" in reasons["refused_locals"]
    assert "reads its own frame (eval())" in reasons["refused_eval"]
    assert "reads frames (." in reasons["refused_frame"]
    assert "declared global" in reasons["refused_global"]
    assert "reads its own frame (exec())" in reasons["refused_exec"]
    assert "nonlocal" in reasons["refused_nonlocal"] or "captured" in reasons["refused_nonlocal"]
    assert "used again after" in reasons["_yields"]
    assert "used before the gather" in reasons["refused_stored_before"]
    assert "used before the gather" in reasons["refused_aliased"]
    assert "not a list of new tensors" in reasons["refused_not_fresh"]
    assert "not by a cat" in reasons["refused_other_dim"] and "not by a cat" in reasons["refused_a_part"]
    assert "used again after" in reasons["refused_in_a_handler"]
    assert "used again after" in reasons["refused_in_the_loop_after"]
    assert "not by a cat" in reasons["KeepingLayer.forward"]


@needs_rebind
def test_each_case_observes_what_torch_gives_and_gets_its_verdict(pools: Any) -> None:
    names = sorted(proof_cases.CASES)
    results = unwrap(pools(2, **EAGER).run(proof_runs.compare, "tests.sites.proof_cases", names))
    for rank, result in enumerate(results):
        for name in names:
            run = result[name]
            assert run["memgather"] == run["torch"], (rank, name, run)
            assert run["rewired"] >= 1, (rank, name, run)
            copy_on_write = name in proof_cases.COPY_ON_WRITE_ONLY
            elides = (name.startswith("accepted_") or copy_on_write) and (cow.works() or not copy_on_write)
            assert (run["elided"] > 0) is elides, (rank, name, run)


# Functions hypothesis writes.

_HEADER = """\
import contextlib

import torch
import torch.distributed as dist

KEPT = []


def keep(value):
    KEPT.append(value)
    return value


def case(tensor, flag=True):
    del KEPT[:]
"""
# Ways to use the list after the gather or let it escape before: (where, lines); each
# keeps what it reaches in KEPT, which the case returns, so that a slot sharing the
# result's memory would show in the values.
VIOLATIONS: Dict[str, Tuple[str, List[str]]] = {
    "stored": ("before", ["KEPT.append(slots)"]),
    "passed": ("before", ["keep(slots)"]),
    "aliased": ("before", ["alias = slots", "KEPT.append(alias)"]),
    "in_a_dict": ("before", ["KEPT.append({'slots': slots})"]),
    "locals": ("before", ["KEPT.append(locals()['slots'])"]),
    "eval": ("before", ["KEPT.append(eval('slots'))"]),
    "vars": ("before", ["KEPT.append(vars()['slots'])"]),
    "closure": ("before", ["holder = lambda: slots", "KEPT.append(holder)"]),
    "nonlocal": ("before", ["def inner():", "    nonlocal slots", "    KEPT.append(slots)", "inner()"]),
    "exec": ("before", ["exec('KEPT.append(slots)')"]),
    "returned_after": ("after", ["if flag:", "    return result, slots"]),
    "len_between": ("between", ["KEPT.append(len(slots))"]),
    "slot_between": ("between", ["KEPT.append(slots[0])"]),
    "write_between": ("between", ["slots[1].add_(7)"]),
    "reversed_between": ("between", ["slots.reverse()"]),
    "read_after": ("after", ["KEPT.append(slots[0])"]),
    "list_after": ("after", ["KEPT.append(slots)"]),
    "copies_after": ("after", ["KEPT.append([s.clone() for s in slots])"]),
    "write_after": ("after", ["slots[1].mul_(3)", "KEPT.append(slots[1])"]),
    "unpacked_after": ("after", ["first, *rest = slots", "KEPT.append(first)"]),
    "iterated_after": ("after", ["for s in slots:", "    KEPT.append(s)"]),
    "formatted_after": ("after", ["KEPT.append(f'{slots}')"]),
}
WRAPS = ["", "if", "else", "for", "while", "with", "try", "try_finally"]


def _wrap(lines: List[str], how: str) -> List[str]:
    inner = ["    " + line for line in lines]
    if how == "if":
        return ["if flag:", *inner]
    if how == "else":
        return ["if not flag:", "    pass", "else:", *inner]
    if how == "for":
        return ["for _ in range(1):", *inner]
    if how == "while":
        return ["while True:", *inner, "    break"]
    if how == "with":
        return ["with contextlib.nullcontext():", *inner]
    if how == "try":
        return ["try:", *inner, "except ZeroDivisionError:", "    pass"]
    if how == "try_finally":
        return ["try:", *inner, "finally:", "    KEPT.append(0)"]
    return list(lines)


def _function(block_wrap: str, violation: str, violation_wrap: str, cat: str, tail: str) -> str:
    """A case: fresh slots, a gather, one cat (and, for a violation, one use or escape of the list)."""
    where, lines = VIOLATIONS[violation] if violation else ("", [])
    used = _wrap(lines, violation_wrap)
    body = ["slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]"]
    body += used if where == "before" else []
    body += ["dist.all_gather(slots, tensor)"]
    body += used if where == "between" else []
    body += [f"result = {cat}", "result.add_(1)"]
    body += used if where == "after" else []
    body += {"": [], "del": ["del slots"], "rebind": ["slots = None"]}[tail]
    block = _wrap(body, block_wrap)
    if block_wrap in ("if", "else", "for", "while", "with", "try", "try_finally"):
        block = ["result = None", *block]
    return _HEADER + textwrap.indent("\n".join([*block, "return result, KEPT"]), "    ") + "\n"


CAT_CALLS = ["torch.cat(slots)", "torch.cat(slots, 0)", "torch.cat(slots, dim=0)", "torch.stack(slots)",
             "torch.concat(slots, dim=0)", "torch.concatenate(slots)", "torch.cat(tensors=slots)"]
_counter = itertools.count()


@pytest.fixture(scope="module")
def generated(tmp_path_factory: Any) -> Path:
    return Path(tmp_path_factory.mktemp("generated_sites"))


def _run_generated(pools: Any, directory: Path, source: str) -> Tuple[proof.Verdict, List[Dict[str, Any]]]:
    name = f"generated_site_{os.getpid()}_{next(_counter)}"
    path = directory / f"{name}.py"
    path.write_text(source)
    [site] = [s for s in callsites.of_file(str(path), name) if s.qualname == "case"]
    results = unwrap(pools(2, **EAGER).run(proof_runs.compare, name, ["case"], str(directory)))
    return site.verdict, [result["case"] for result in results]


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
                 print_blob=True)


@needs_rebind
@settings(max_examples=EXAMPLES, **_SETTINGS)
@given(violation=st.sampled_from(sorted(VIOLATIONS)), violation_wrap=st.sampled_from(WRAPS),
       block_wrap=st.sampled_from(WRAPS), cat=st.sampled_from(CAT_CALLS), tail=st.sampled_from(["", "del", "rebind"]))
def test_a_use_or_an_escape_anywhere_is_refused_or_copy_on_write_and_torchs_values_kept(
    pools: Any, generated: Path, violation: str, violation_wrap: str, block_wrap: str, cat: str, tail: str
) -> None:
    source = _function(block_wrap, violation, violation_wrap, cat, tail)
    note(source)
    verdict, runs = _run_generated(pools, generated, source)
    # A use after the cat leaves the cat the list's first use: proven where the result is copy-on-write
    # (but for a read inside a comprehension, which is refused wherever it stands).
    after = VIOLATIONS[violation][0] == "after" and violation != "copies_after"
    assert verdict.proven is after and verdict.needs_cow is after, verdict
    for run in runs:
        assert run["memgather"] == run["torch"], run
        assert run["elided"] == int(after and cow.works()) and run["rewired"] >= 1, run


@needs_rebind
@settings(max_examples=max(EXAMPLES // 2, 1), **_SETTINGS)
@given(block_wrap=st.sampled_from(WRAPS), cat=st.sampled_from(CAT_CALLS), tail=st.sampled_from(["", "del", "rebind"]))
def test_a_dropped_list_is_elided_in_any_block(pools: Any, generated: Path, block_wrap: str, cat: str,
                                               tail: str) -> None:
    source = _function(block_wrap, "", "", cat, tail)
    note(source)
    verdict, runs = _run_generated(pools, generated, source)
    assert verdict.proven, verdict
    for run in runs:
        assert run["memgather"] == run["torch"], run
        assert run["elided"] == 1, run


_MATCH_CAPTURE = """\
import torch
import torch.distributed as dist

from tests.sites.proof_cases import CAT_KEPT
from tests.sites.proof_cases import cat as keeping


def case(tensor, flag=True):
    from torch import cat

    match keeping:
        case cat:
            pass
    slots = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, tensor)
    result = cat(slots)
    result.mul_(0)
    return result, CAT_KEPT.pop()[0]
"""


@needs_rebind
@pytest.mark.skipif(sys.version_info < (3, 10), reason="match statements: Python 3.10+")
def test_a_name_a_match_captures_is_not_taken_for_its_import(pools: Any, generated: Path) -> None:
    """``case cat:`` rebinds the imported name to whatever was matched (here a cat that keeps its
    inputs): the proof must not follow the import."""
    verdict, runs = _run_generated(pools, generated, _MATCH_CAPTURE)
    assert not verdict.proven, verdict
    for run in runs:
        assert run["memgather"] == run["torch"] and run["elided"] == 0, run


# The same proof on every Python the project supports: their syntax trees differ.

_PYTHONS = ["3.9", "3.10", "3.11", "3.12", "3.13"]


def _interpreter(version: str) -> str:
    """An interpreter of that version: pyenv's own build, else one on PATH (not a pyenv shim,
    which answers for the selected version only)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(root.glob(f"{version}.*/bin/python{version}")) if root.is_dir() else []
    if candidates:
        return str(candidates[-1])
    found = shutil.which(f"python{version}")
    return found if found and "/shims/" not in found else ""


@pytest.mark.parametrize("version", _PYTHONS)
def test_the_proof_reads_alike_on_each_python(version: str) -> None:
    """Without torch (a stand-in module): the static verdicts on the fixed cases, each Python's own
    statements (match, except*, type), and a live frame's call found by its position or line."""
    interpreter = _interpreter(version)
    if sys.version_info[:2] == tuple(map(int, version.split("."))):
        interpreter = sys.executable
    if not interpreter:
        pytest.skip(f"no python{version} here")
    done = subprocess.run([interpreter, str(ROOT / "tests" / "proof_on_python.py"), str(CASES)],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all verdicts as expected" in done.stdout, done.stdout


def test_the_benchmark_patterns_get_the_elision_their_rows_say() -> None:
    """memgather bench and selftest leave elision to its default: the proof's verdict on each pattern's code."""
    from memgather.tools import pattern_code, patterns

    found = {site.qualname: site.verdict for site in callsites.of_file(pattern_code.__file__, patterns.MODULE)}
    gathers_in = {"zeros_like_branches": "_NativeModel._do_all_gather"}  # a pattern that calls a method
    for pattern in patterns.PATTERNS:
        name = gathers_in.get(pattern.name, pattern.name)
        if name in found:
            # A pattern that returns its list has no cat of its own to elide (its slots are armed for the caller's).
            cats = found[name].proven and not found[name].reason.startswith("returns the list")
            assert cats is pattern.elide, (pattern.name, found[name])
        else:
            assert not pattern.elide, pattern.name  # no list all_gather in it: nothing to elide


_ZIPPED = '''\
import torch
import torch.distributed as dist


def concat_all_gather(tensor):
    slots = [torch.empty_like(tensor) for _ in range(2)]
    dist.all_gather(slots, tensor)
    return torch.cat(slots)
'''


def _import_from(path: Path, name: str) -> Any:
    import importlib

    sys.path.insert(0, str(path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(path))
        sys.modules.pop(name, None)


def test_source_is_read_from_a_zip_import_and_refused_where_there_is_none(tmp_path: Path) -> None:
    """A zip with the module's source is read through its loader; a zip of bytecode alone, and code
    compiled from a string, have no source to read: refused, with the reason."""
    import py_compile
    import zipfile

    from memgather.patching import sources

    with zipfile.ZipFile(tmp_path / "with_source.zip", "w") as archive:
        archive.writestr("zipped_site.py", _ZIPPED)
    module = _import_from(tmp_path / "with_source.zip", "zipped_site")
    found = sources.function_of(module.concat_all_gather.__code__, vars(module))
    assert isinstance(found, sources.Source), found
    call = next(node for node in ast.walk(found.function) if isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "all_gather")
    resolve = callsites._resolver(found.function, callsites._imports(ast.parse(_ZIPPED).body, ""), "")
    assert proof.gatherer(found.function, call, resolve).proven

    (tmp_path / "bytecode_site.py").write_text(_ZIPPED)
    compiled = py_compile.compile(str(tmp_path / "bytecode_site.py"), cfile=str(tmp_path / "bytecode_site.pyc"))
    with zipfile.ZipFile(tmp_path / "bytecode.zip", "w") as archive:
        archive.write(compiled, "bytecode_site.pyc")
    module = _import_from(tmp_path / "bytecode.zip", "bytecode_site")
    (tmp_path / "bytecode_site.py").unlink()  # the path the bytecode names is gone too
    refused = sources.function_of(module.concat_all_gather.__code__, vars(module))
    assert isinstance(refused, str) and "no source" in refused, refused

    namespace: Dict[str, Any] = {}
    exec(compile(_ZIPPED, "<string>", "exec"), namespace)
    refused = sources.function_of(namespace["concat_all_gather"].__code__, namespace)
    assert refused == "no source: compiled from a string (<string>)", refused
