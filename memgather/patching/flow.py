"""The control flow of one function body, statement by statement, for following one local name.

A node stands for one simple statement, or for the part of a compound
statement that runs on its own (an ``if``'s test, a ``for``'s iterator and its
target, a ``with`` item, an ``except`` clause). Each node has the nodes that
may run next when it completes (``succ``) and those that may run next when it
raises (``exc``: the handlers of every enclosing ``try``, the code after every
enclosing ``with``, whose ``__exit__`` may swallow the exception).

The graph over-approximates: a ``finally`` block may go on to anything it could
in any case (the code after the ``try``, the function's exit, an enclosing
loop's targets, the enclosing handlers), a loop's iterator counts as read on
every iteration, every ``match`` case may be tried. Extra paths can only make
a proof refuse, never accept what a real path would refute. Only the standard
library is used, so the module reads alike on every Python the project supports
(3.9 to 3.13: ``match`` from 3.10, ``except*`` from 3.11, ``type`` from 3.12).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Tuple

EXIT = 0  # the function's exit: a node with no code


class Unsupported(Exception):
    """A statement this reader does not know (a newer Python's): no proof is made."""


@dataclass
class Node:
    """What runs as one step: ``reads`` are evaluated, then ``binds`` bound (or deleted)."""

    index: int
    line: int
    reads: Tuple[ast.AST, ...] = ()
    binds: Tuple[ast.AST, ...] = ()  # targets, and statements that bind a name of their own
    succ: List[int] = field(default_factory=list)
    exc: List[int] = field(default_factory=list)
    statement: Optional[ast.stmt] = None  # the statement the node belongs to


@dataclass
class _Loop:
    head: int  # where ``continue`` goes
    after: int  # where ``break`` goes
    finals: int  # how many finally blocks enclosed the loop: one entered since runs first


class Graph:
    """The nodes of one function's body; node 0 is the exit, ``entry`` the first to run."""

    def __init__(self, function: ast.AST) -> None:
        body = getattr(function, "body", None)
        if not isinstance(body, list):
            raise Unsupported("not a function with a body of statements")
        self.nodes: List[Node] = [Node(EXIT, 0)]
        self._loops: List[_Loop] = []
        self._raise_to: List[Tuple[int, ...]] = []  # per enclosing try / with: where an exception may go
        self._finally: List[int] = []  # join nodes of enclosing finally blocks
        self.entry = self._block(body, EXIT)

    def predecessors(self) -> List[List[Tuple[int, bool]]]:
        """For each node, the nodes that may run right before it, each with whether it got there
        by raising (then what it binds was not bound)."""
        before: List[List[Tuple[int, bool]]] = [[] for _ in self.nodes]
        for node in self.nodes:
            for nxt in set(node.succ):
                before[nxt].append((node.index, False))
            for nxt in set(node.exc):  # also where it goes on normally: raising, it bound nothing
                before[nxt].append((node.index, True))
        return before

    def containing(self, target: ast.AST) -> Optional[Node]:
        """The node whose own reads or binds hold ``target`` (an expression of the body)."""
        for node in self.nodes:
            for part in (*node.reads, *node.binds):
                if any(inner is target for inner in ast.walk(part)):
                    return node
        return None

    # Building, backwards: each statement is built knowing what runs after it.

    def _new(self, statement: Optional[ast.stmt], reads: Sequence[ast.AST] = (), binds: Sequence[ast.AST] = ()) -> Node:
        line = getattr(statement, "lineno", 0)
        raise_to = tuple(dict.fromkeys(target for level in self._raise_to for target in level))
        node = Node(len(self.nodes), line, tuple(reads), tuple(binds), [], list(raise_to), statement)
        self.nodes.append(node)
        return node

    def _block(self, statements: Sequence[ast.stmt], after: int) -> int:
        nxt = after
        for statement in reversed(statements):
            nxt = self._statement(statement, nxt)
        return nxt

    def _leave(self) -> int:
        """Where a ``return`` goes: the innermost ``finally``, else the exit."""
        return self._finally[-1] if self._finally else EXIT

    def _statement(self, s: ast.stmt, after: int) -> int:
        if isinstance(s, (ast.If,)):
            node = self._new(s, [s.test])
            node.succ = [self._block(s.body, after), self._block(s.orelse, after)]
            return node.index
        if isinstance(s, ast.While):
            head = self._new(s, [s.test])
            self._loops.append(_Loop(head.index, after, len(self._finally)))
            body = self._block(s.body, head.index)
            self._loops.pop()
            head.succ = [body, self._block(s.orelse, after)]
            return head.index
        if isinstance(s, (ast.For, ast.AsyncFor)):
            iterator = self._new(s, [s.iter])
            step = self._new(s)  # next(): ends the loop or binds the target
            target = self._new(s, [s.target], [s.target])
            self._loops.append(_Loop(step.index, after, len(self._finally)))
            body = self._block(s.body, step.index)
            self._loops.pop()
            target.succ = [body]
            step.succ = [target.index, self._block(s.orelse, after)]
            iterator.succ = [step.index]
            return iterator.index
        if isinstance(s, (ast.With, ast.AsyncWith)):
            # __exit__ may swallow what the body raised (or a later item): then the code after the with runs.
            self._raise_to.append((after,))
            nxt = self._block(s.body, after)
            for position, item in reversed(list(enumerate(s.items))):
                if position == 0:
                    self._raise_to.pop()  # the first item's own exception meets no __exit__ of this with
                binds = [item.optional_vars] if item.optional_vars is not None else []
                node = self._new(s, [item.context_expr, *binds], binds)
                node.succ = [nxt]
                nxt = node.index
            return nxt
        if isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            return self._try(s, after)
        if type(s).__name__ == "Match":
            return self._match(s, after)
        if isinstance(s, ast.Return):
            node = self._new(s, [s])
            node.succ = [self._leave()]
            return node.index
        if isinstance(s, ast.Raise):
            node = self._new(s, [s])  # only its exception edges lead on
            return node.index
        if isinstance(s, (ast.Break, ast.Continue)):
            node = self._new(s)
            if self._loops:
                loop = self._loops[-1]
                if len(self._finally) > loop.finals:  # a finally inside the loop runs on the way out
                    node.succ = [self._finally[-1]]
                else:
                    node.succ = [loop.after if isinstance(s, ast.Break) else loop.head]
            return node.index
        if isinstance(s, _SIMPLE) or type(s).__name__ == "TypeAlias":
            node = self._new(s, [s], [s])
            node.succ = [after]
            return node.index
        raise Unsupported(f"a {type(s).__name__} statement at line {getattr(s, 'lineno', '?')}")

    def _try(self, s: ast.stmt, after: int) -> int:
        handlers: List[ast.ExceptHandler] = getattr(s, "handlers", [])
        final: List[ast.stmt] = getattr(s, "finalbody", [])
        orelse: List[ast.stmt] = getattr(s, "orelse", [])
        body: List[ast.stmt] = getattr(s, "body", [])
        go_on = after
        if final:
            # After a finally: wherever the try could have gone (normally, by return, break,
            # continue or an exception that goes on up).
            join = self._new(s)
            outward = [t for level in self._raise_to for t in level]
            join.succ = list(dict.fromkeys([after, self._leave(), *_loop_targets(self._loops), *outward]))
            go_on = self._block(final, join.index)
        # The handlers and else run inside the finally, not inside the try's handlers.
        if final:
            self._raise_to.append((go_on,))
            self._finally.append(go_on)
        orelse_entry = self._block(orelse, go_on)
        entries = []
        for handler in handlers:
            binds = [handler] if handler.name else []
            node = self._new(s, [handler.type] if handler.type is not None else [], binds)
            node.succ = [self._block(handler.body, go_on)]
            entries.append(node.index)
        if final:
            self._raise_to.pop()
        self._raise_to.append(tuple(entries) + ((go_on,) if final else ()))
        entry = self._block(body, orelse_entry)
        self._raise_to.pop()
        if final:
            self._finally.pop()
        return entry

    def _match(self, s: Any, after: int) -> int:
        """A ``match`` (Python 3.10+; typed loosely, as the oldest Python has no ast.Match)."""
        subject = self._new(s, [s.subject])
        successors = [after]
        for case in s.cases:
            guard = [case.guard] if case.guard is not None else []
            node = self._new(s, [case.pattern, *guard], [case.pattern])
            node.succ = [self._block(case.body, after), after]
            successors.append(node.index)
        subject.succ = successors
        return subject.index


_SIMPLE = (
    ast.Expr,
    ast.Assign,
    ast.AugAssign,
    ast.AnnAssign,
    ast.Delete,
    ast.Pass,
    ast.Import,
    ast.ImportFrom,
    ast.Global,
    ast.Nonlocal,
    ast.Assert,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
)


def _loop_targets(loops: Sequence[_Loop]) -> Iterator[int]:
    for loop in loops:
        yield loop.head
        yield loop.after


def loads(node: Node, name: str) -> List[ast.Name]:
    """Every read of ``name`` among what ``node`` evaluates (nested scopes included: a conservative count)."""
    found = []
    for part in node.reads:
        for inner in ast.walk(part):
            if isinstance(inner, ast.Name) and inner.id == name and isinstance(inner.ctx, ast.Load):
                found.append(inner)
            elif isinstance(inner, ast.AugAssign) and isinstance(inner.target, ast.Name) and inner.target.id == name:
                found.append(inner.target)  # L += x reads L (and may hand back the same object)
    return found


def binds(node: Node, name: str) -> bool:
    """Whether ``node`` binds or deletes ``name`` as a local of the function once it completes."""
    for part in node.binds:
        if isinstance(part, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if part.name == name:
                return True
            continue  # its body is another scope
        if isinstance(part, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in part.names):
                return True
            continue
        if isinstance(part, ast.ExceptHandler):
            if part.name == name:
                return True
            continue
        if isinstance(part, ast.AnnAssign) and part.value is None:
            continue  # an annotation alone binds nothing
        if isinstance(part, ast.AugAssign):
            continue  # reads the name first (``loads``): the same object may come back
        for inner in _same_scope(part):
            if isinstance(inner, ast.Name) and inner.id == name and isinstance(inner.ctx, (ast.Store, ast.Del)):
                return True
            if type(inner).__name__ in ("MatchAs", "MatchStar") and getattr(inner, "name", None) == name:
                return True
            if type(inner).__name__ == "MatchMapping" and getattr(inner, "rest", None) == name:
                return True
    return False


_SCOPES = (
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Lambda,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)


def _same_scope(part: ast.AST) -> Iterator[ast.AST]:
    """``part`` and what it holds, short of nested scopes (whose names are their own)."""
    pending = [part]
    while pending:
        inner = pending.pop()
        yield inner
        if inner is part or not isinstance(inner, _SCOPES):
            pending.extend(ast.iter_child_nodes(inner))
