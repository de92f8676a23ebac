"""Faults in the rules of the cat-elision proof, one at a time: which of them no test holds.

    .venv/bin/python -m tests.proof_faults [LABEL ...]      (about 3 minutes on 2 cores)

Each fault changes one rule of ``memgather/patching/proof.py``, ``flow.py`` or ``sites.py`` (a
gather statement's exception edges, a factory told by its last name, two reads of the list in
one statement, the receiver's cat, an ``if`` or ``while`` test that reads the list, an
``except ... as`` binding the list's name, the re-check of the names a verdict rests on, a
local named like torch's function, a nested scope's own names). It is applied to a copy of the
working tree, and the proof's tests (static, and live on real gloo ranks) run against that
copy. ``tox -e mutation`` runs mutmut's own mutants of proof.py and flow.py (docs/elision.md).
"""

from __future__ import annotations

from typing import List

from tests import fault_runs

TESTS = ["tests/test_proof_rules.py", "tests/test_proof.py", "tests/test_made_like.py"]
# (module, label, the text of the rule, what the fault puts in its place)
FAULTS: List[fault_runs.Fault] = [
    ("proof", "gather-exception-edges", "[*at.succ, *at.exc], name, hand_over", "list(at.succ), name, hand_over"),
    ("proof", "factory-by-last-name", "        return self.resolve(function) in FACTORIES", "        return \"torch.\" + last_name(function) in FACTORIES"),
    ("proof", "two-reads-in-one-statement", "                if len(reads) != 1 or not hand_over(self, node, reads[0]):", "                if not hand_over(self, node, reads[0]):"),
    ("proof", "reads-in-the-gather-statement", "        if [n for n in flow.loads(at, name) if n is not listed] or flow.binds(at, name):", "        if flow.binds(at, name):"),
    ("proof", "received-without-cat-check", "        if isinstance(parent, ast.Call) and _tensors_argument(parent) is call and self._is_cat(parent):", "        if isinstance(parent, ast.Call) and _tensors_argument(parent) is call:"),
    ("proof", "received-binding-read", "        if flow.loads(at, target):\n", "        if False:\n"),
    ("flow", "if-reads-nothing", "            node = self._new(s, [s.test])\n            node.succ = [self._block(s.body, after), self._block(s.orelse, after)]", "            node = self._new(s, [])\n            node.succ = [self._block(s.body, after), self._block(s.orelse, after)]"),
    ("flow", "while-reads-nothing", "            head = self._new(s, [s.test])", "            head = self._new(s, [])"),
    ("flow", "except-as-L-binds-nothing", "            binds = [handler] if handler.name else []", "            binds = []"),
    ("flow", "except-as-L-not-a-bind", "        if isinstance(part, ast.ExceptHandler):\n            if part.name == name:\n                return True", "        if isinstance(part, ast.ExceptHandler):\n            if False:\n                return True"),
    ("sites", "bindings-never-re-checked", "        if space.get(name, _MISSING) is not thing:\n            return False", "        if False:\n            return False"),
    ("sites", "site-verdict-not-re-checked", "            and _still_bound(held[1], held[2])\n", ""),
    ("sites", "locals-resolved-through-globals", "        self.local = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)", "        self.local = set()"),
    ("flow", "nested-scope-names", "        if inner is part or not isinstance(inner, _SCOPES):", "        if True:"),
    ("proof", "nested-capture-check", "            if node is not self.function and isinstance(node, _NESTED) and _mentions(node, name):\n                return f\"line {node.lineno}: {name} is captured by a nested function or class\"\n            if isinstance(node, _REPEATED[:-1])", "            if isinstance(node, _REPEATED[:-1])"),
]


if __name__ == "__main__":
    fault_runs.main(FAULTS, TESTS)
