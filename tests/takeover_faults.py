"""Faults in the rules of the helpers' takeover, one at a time: which of them no test holds.

    .venv/bin/python -m tests.takeover_faults [LABEL ...]      (about 15 minutes on 2 cores)

Each fault changes one rule of ``memgather/patching/padded.py`` or ``helpers.py`` (the rules that
decide soundness: each rank's verdict on its input, what every rank reads alike, where the
library keeps its own way, the entries' versions and views, the re-issued warning, the graph
break under compile, a re-patch). It is applied to a copy of the working tree, and the
differential tests of ``tests/test_padded.py`` and ``tests/test_takeover_programs.py`` run
against that copy on real gloo ranks. A fault those tests let pass is a rule no test holds
(docs/calls.md lists the one left, and why it cannot change what a call does).
"""

from __future__ import annotations

from typing import List

from tests import fault_runs

TESTS = [
    "tests/test_padded.py::test_taken_over_helpers_answer_as_the_libraries_own_code",
    "tests/test_padded.py::test_ranks_that_differ_where_the_library_allows_take_one_way",
    "tests/test_takeover_programs.py",
]
# (module, label, the text of the rule, what the fault puts in its place)
FAULTS: List[fault_runs.Fault] = [
    ("padded", "conjugate-bit", "        and not tensor.is_conj()\n", ""),
    ("padded", "transforms",
     "    if compat.functorch_active() or compat.forward_ad_active() or compat.functorch_wrapped(tensor):\n"
     "        return False\n", ""),
    ("padded", "modes", "    if compat.dispatch_mode_active() or compat.function_mode_active():\n        return False\n", ""),
    ("padded", "every-rank-ok", "        all(t.ok and t.context == first.context for t in table)",
     "        first.ok and all(t.context == first.context for t in table)"),
    ("padded", "rows-read-alike", "        and [t.rows for t in table] == [shape[0] if shape else -1 for shape in shapes]\n", ""),
    ("padded", "equal-shapes", "        if len(set(shapes)) == 1 or any(", "        if any("),
    ("padded", "slot-versions", "        versions = [size._version for size in exchanged]",
     "        versions = [0 for size in exchanged]"),
    ("padded", "entry-views", "            parts.append(base[:rows])", "            parts.append(base)"),
    ("helpers", "initialised-group", "    if not (dist.is_available() and dist.is_initialized()):\n        return False\n", ""),
    ("helpers", "graph-break",
     "    if torch.distributed.is_available() and torch.distributed.is_initialized():\n"
     "        return _run_eagerly()(entry, args, kwargs, None)\n", ""),
    ("helpers", "re-patch", "        for key, entry in list(_installed.items()):\n            if not selected(entry.helper.module):",
     "        for key, entry in list(_installed.items()):\n            if True:"),
    ("padded", "whole-numbers",
     "    if not all(isinstance(d, int) and not isinstance(d, bool) for shape in given for d in shape):",
     "    if not all(isinstance(d, int) for shape in given for d in shape):"),
    ("padded", "group-of-ranks", "            isinstance(group, list)\n            or getattr", "            False\n            or getattr"),
    ("padded", "rank-outside-group", "            or namespace[\"_rank_not_in_group\"](group)\n", ""),
    ("padded", "re-issued-warning", "            _warn_as_the_library(call, len(gathered))", "            pass"),
    ("padded", "monai-0-d", "ok=ndims > 0 and same_device", "ok=same_device"),
    ("padded", "cat-version", "            compat.set_version(taken.out, 0)  # torch.cat's result, as the library's\n", ""),
    ("padded", "refused-list-index", "    return bool(call.options[\"list_index\"]) and _list_index_warnings() is None",
     "    return False"),
    ("padded", "own-entry", "        if own_entry_is_input:  # \"to propagate autograd graph from local rank\"\n            gathered[",
     "        if False:\n            gathered["),
    ("helpers", "mocks", "    return not any(_is_mock(getattr(dist, name, None)) for name in (\"all_gather\", \"barrier\", \"get_world_size\"))",
     "    return True"),
    ("padded", "inference-versions", "    return None if tensor.is_inference() else tensor._version", "    return tensor._version"),
    ("padded", "unwinds-cleanly", "ok=call.unwinds_cleanly, ", ""),
    ("padded", "shapes-read-once",
     "    if type(shapes) not in (list, tuple) or not all(type(shape) in (list, tuple, torch.Size) for shape in shapes):\n"
     "        return []\n", ""),
    ("padded", "ignite-group",
     "            not (group is None or isinstance(group, torch.distributed.ProcessGroup))",
     "            isinstance(group, list)"),
    ("padded", "ignite-warning", "            _warn_as_the_library(call, len(parts))", "            pass"),
    ("padded", "caller-proven", "    return call.caller is not None and sites.received(call.caller, call.frame).proven",
     "    return call.caller is not None"),
]


if __name__ == "__main__":
    fault_runs.main(FAULTS, TESTS)
