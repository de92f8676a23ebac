"""The elision proof on the Python that runs this script, without torch (tests/test_proof.py runs it on each).

memgather's proof modules use the standard library alone; they are loaded here
without running ``memgather/__init__.py`` (which imports torch). Checked: the
static verdicts on tests/sites/proof_cases.py (argv[1]); this Python's own
statements (``match`` from 3.10, ``except*`` from 3.11, ``type`` from 3.12);
and, on a live frame of a stand-in ``torch``, that the running code is matched
to its source and the call found by its position (3.11+) or its line.
"""

from __future__ import annotations

import ast
import importlib
import sys
import tempfile
import textwrap
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for name, folder in (("memgather", ROOT / "memgather"), ("memgather.patching", ROOT / "memgather" / "patching")):
    package = types.ModuleType(name)
    package.__path__ = [str(folder)]
    sys.modules[name] = package

callsites = importlib.import_module("memgather.patching.callsites")
proof = importlib.import_module("memgather.patching.proof")
sources = importlib.import_module("memgather.patching.sources")
assert "torch" not in sys.modules

failures = []


def expect(label: str, verdict: object, proven: bool, needs_cow: bool = False) -> None:
    if getattr(verdict, "proven") is not proven or getattr(verdict, "needs_cow") is not needs_cow:
        wanted = ("proven (copy-on-write)" if needs_cow else "proven") if proven else "refused"
        failures.append(f"{label}: expected {wanted}, got {verdict}")


def copy_on_write_only(path: str) -> set:
    """proof_cases.COPY_ON_WRITE_ONLY, read from the file (importing it would import torch)."""
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["COPY_ON_WRITE_ONLY"]:
            return {element.value for element in node.value.elts}
    raise AssertionError("no COPY_ON_WRITE_ONLY in " + path)


COPY_ON_WRITE = copy_on_write_only(sys.argv[1])
for site in callsites.of_file(sys.argv[1], "tests.sites.proof_cases"):
    accepted = any(part.startswith("accepted_") for part in site.qualname.split(".")) or site.qualname in ("refused_pooled_slots", "refused_locals_by_another_name")
    cow = site.qualname in COPY_ON_WRITE
    expect(site.qualname, site.verdict, accepted or cow or site.qualname == "GatherLayer.forward", cow)

HEAD = "import torch\nimport torch.distributed as dist\n\n"
SPECIMENS = {
    (3, 10): """
def accepted_match(tensor, kind):
    slots = [torch.empty_like(tensor) for _ in range(2)]
    dist.all_gather(slots, tensor)
    match kind:
        case "a":
            return torch.cat(slots)
        case _:
            return torch.stack(slots)

def cow_match_after(tensor, kind):
    slots = [torch.empty_like(tensor) for _ in range(2)]
    dist.all_gather(slots, tensor)
    result = torch.cat(slots)
    match kind:
        case [first, *rest] if slots:
            return result, first
    return result

def refused_match_binds_list(tensor, kind):
    match kind:
        case [*slots]:
            pass
    dist.all_gather(slots, tensor)
    return torch.cat(slots)
""",
    (3, 11): """
def accepted_except_star(tensor):
    slots = [torch.empty_like(tensor) for _ in range(2)]
    dist.all_gather(slots, tensor)
    try:
        result = torch.cat(slots)
    except* ValueError:
        result = None
    return result

def cow_except_star(tensor):
    slots = [torch.empty_like(tensor) for _ in range(2)]
    dist.all_gather(slots, tensor)
    try:
        result = torch.cat(slots)
        result.add_(1)
    except* ValueError:
        result = slots
    return result
""",
    (3, 12): """
def accepted_type_alias(tensor):
    type Pair = tuple[int, int]
    slots = [torch.empty_like(tensor) for _ in range(2)]
    dist.all_gather(slots, tensor)
    return torch.cat(slots)
""",
}
with tempfile.TemporaryDirectory() as directory:
    for since, text in SPECIMENS.items():
        if sys.version_info < since:
            continue
        path = Path(directory) / f"specimen_{since[0]}_{since[1]}.py"
        path.write_text(HEAD + textwrap.dedent(text))
        found = callsites.of_file(str(path), path.stem)
        if not found:
            failures.append(f"{path.stem}: no call site found")
        for site in found:
            cow = site.qualname.startswith("cow_")  # the list used again after the cat
            expect(f"{path.stem}:{site.qualname}", site.verdict, site.qualname.startswith("accepted_") or cow, cow)

    # A live frame: a stand-in torch whose all_gather records its caller's frame.
    frames = []
    torch = types.ModuleType("torch")
    distributed = types.ModuleType("torch.distributed")

    def record(slots: object, tensor: object) -> None:
        """Where the caller is at the moment of the call: its line, and its instruction's span (3.11+)."""
        frame = sys._getframe(1)
        span = list(frame.f_code.co_positions())[frame.f_lasti // 2] if sys.version_info >= (3, 11) else None
        frames.append((frame, frame.f_lineno, span))

    distributed.all_gather = record  # type: ignore[attr-defined]
    torch.distributed = distributed  # type: ignore[attr-defined]
    torch.cat = torch.stack = lambda tensors, dim=0: list(tensors)  # type: ignore[attr-defined]
    torch.empty_like = lambda t: object()  # type: ignore[attr-defined]
    sys.modules.update({"torch": torch, "torch.distributed": distributed})
    live = Path(directory) / "live_site.py"
    live.write_text(HEAD + textwrap.dedent("""
        def accepted_multiline(tensor):
            slots = [torch.empty_like(tensor) for _ in range(2)]
            dist.all_gather(
                slots,
                tensor,
            )
            return torch.cat(slots)

        def refused_same_line(tensor):
            slots = [torch.empty_like(tensor) for _ in range(2)]
            dist.all_gather(slots, tensor); kept = slots
            return torch.cat(slots), kept
    """))
    sys.path.insert(0, directory)
    module = importlib.import_module("live_site")
    imports = callsites._imports(ast.parse(live.read_text()).body, "")
    for name in ("accepted_multiline", "refused_same_line"):
        getattr(module, name)(0)
        frame, line, position = frames.pop()
        found = sources.function_of(frame.f_code, frame.f_globals)
        if isinstance(found, str):
            failures.append(f"{name}: {found}")
            continue
        calls = [c for c in proof.calls_at(found.function, line, position) if getattr(c.func, "attr", "") == "all_gather"]
        if len(calls) != 1:
            failures.append(f"{name}: {len(calls)} calls found at the frame's position")
            continue
        resolve = callsites._resolver(found.function, imports, "")
        expect(name, proof.gatherer(found.function, calls[0], resolve), name.startswith("accepted_"))
    # The same file edited after import: its code no longer matches, and is refused.
    module.accepted_multiline(0)
    frame = frames.pop()[0]
    live.write_text(live.read_text().replace("range(2)", "range(3)"))
    edited = sources.function_of(frame.f_code, frame.f_globals)
    if not (isinstance(edited, str) and "not the source of the code that runs" in edited):
        failures.append(f"an edited file was not refused: {edited}")

if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"python {sys.version.split()[0]}: all verdicts as expected")
