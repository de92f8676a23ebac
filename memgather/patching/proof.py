"""Reading a call site's code: is the gathered list dropped right after one ``torch.cat``?

Cat elision hands out the gathered buffer itself as the result of ``torch.cat``
(or ``torch.stack``) of the gathered slots: the slots and the result then share
memory (``memgather.engine.elision``). That is invisible only if nothing uses
the slots after the cat. This module proves it from the function's own code,
per call site, in one of four roles:

- ``gatherer``: the function calls ``all_gather(L, ...)`` itself. ``L`` must be
  a local bound, on every path to the gather, to a fresh list (a list display or
  comprehension whose elements are new tensors: ``torch.empty_like(t)``,
  ``t.clone()``, ...) and not read between that binding and the gather; after
  the gather the first read of ``L`` on every path must be one ``torch.cat`` /
  ``concat`` / ``concatenate`` / ``stack`` of the whole list along dim 0, and
  after that cat ``L`` must not be read again on any path (loops and exception
  handlers included) before it is bound anew.
- ``forward``: an autograd Function's ``forward`` that gathers as above and, in
  place of the cat, returns the list whole (``return tuple(L)``, ``return L``).
- ``passes_on``: a frame between such a ``forward`` and its applier (torch's
  ``torch.distributed.nn.all_gather``) that returns the call's value as it is.
- ``receiver``: the frame that applied the Function. The call's value is either
  concatenated at once (``torch.cat(all_gather(t))``) or bound to a local that
  is then used as ``gatherer``'s list is after its gather.

Everywhere the name must be a plain local: not ``global`` / ``nonlocal``, not
captured by a nested function, lambda or class, not bound by ``:=``, and the
function must not read its own frame (``locals()``, ``vars()``, ``dir()``,
``exec``, ``eval``, ``breakpoint()``, ``sys._getframe``, ``inspect.currentframe``,
``f_locals``). Names are followed by where they are bound and read, node by node
of the control flow (``memgather.patching.flow``), so one name may be a tensor
in one branch and the list in another.

What is not proven gets a reason naming the line. Names of functions are
resolved by the caller of this module (``resolve``: an expression to a dotted
name such as ``"torch.cat"``, or None), so the same proof serves a live frame
(resolved through its globals) and a file read without importing it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Set, Tuple, Union

from memgather.patching import flow

Resolve = Callable[[ast.expr], Optional[str]]
# A rule over one read of the list: whether the node ``read`` stands in hands it over, or lets it pass.
_Reading = Callable[["_Proof", "flow.Node", ast.Name], bool]

CATS = frozenset(("torch.cat", "torch.concat", "torch.concatenate", "torch.stack"))
GATHERS = frozenset(("torch.distributed.all_gather", "torch.distributed.distributed_c10d.all_gather"))
FUNCTION_GATHERS = frozenset(("torch.distributed.nn.all_gather", "torch.distributed.nn.functional.all_gather"))
# Calls that always return a tensor nobody else holds.
FACTORIES = frozenset(
    "torch." + name
    for name in (
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "empty",
        "zeros",
        "ones",
        "full",
        "rand",
        "randn",
        "empty_strided",
        "tensor",
    )
)
# Calls whose one argument makes a new tensor like it: its dtype, shape, device, layout and strides
# (the input's memory format), no grad, memory of the device's allocator (slots_like_input).
LIKE_FACTORIES = frozenset(("torch.empty_like", "torch.zeros_like", "torch.ones_like"))
# Tensor methods that return a new tensor of its own: read by name, whatever the receiver
# (the slots' type is checked when the call is planned: a plain tensor's methods are these).
FRESH_METHODS = frozenset(("clone", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"))
_WHOLE = frozenset(("tuple", "list"))  # return tuple(L): the list handed on whole
_FRAME_READERS = frozenset(("locals", "vars", "dir", "exec", "eval", "breakpoint"))
_FRAME_ATTRIBUTES = frozenset(
    ("_getframe", "currentframe", "f_locals", "getouterframes", "getinnerframes", "set_trace", "locals", "vars", "exec")
)
# What a resolver names objects that read the calling frame (however the code spells them).
FRAME_READERS = frozenset(
    (
        "builtins.locals",
        "builtins.vars",
        "builtins.dir",
        "builtins.exec",
        "builtins.eval",
        "builtins.breakpoint",
        "sys._getframe",
        "inspect.currentframe",
        "inspect.stack",
        "inspect.trace",
        "pdb.set_trace",
    )
)

_BEFORE, _AFTER = 0, 1
_FIRST_USE = "first used after the gather by the cat"


@dataclass(frozen=True)
class Verdict:
    """Whether a call site drops the gathered list after one cat, and the reason (with line numbers).

    ``like_input``: whether the call's slots are proven to be new tensors made like its input
    (``slots_like_input``), a proof of its own that a gatherer's verdict carries beside.
    ``needs_cow``: the proof holds only where the cat's result is a copy-on-write snapshot
    (``memgather.cow``): the list's first use after the gather is the cat, but the slots are
    used again after it, or the list is returned and its first use lies in the caller's code.
    """

    proven: bool
    reason: str
    like_input: bool = False
    needs_cow: bool = False
    returned: bool = False  # the list is returned: the caller's first use of the slots decides, at run time


def refuse(reason: str) -> Verdict:
    return Verdict(False, reason)


def gather_list(call: ast.Call) -> Optional[ast.expr]:
    """The list argument of an ``all_gather(tensor_list, tensor, ...)`` call, if written out."""
    for keyword in call.keywords:
        if keyword.arg == "tensor_list":
            return keyword.value
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    return None


def gather_tensor(call: ast.Call) -> Optional[ast.expr]:
    """The input argument of an ``all_gather(tensor_list, tensor, ...)`` call, if written out."""
    for keyword in call.keywords:
        if keyword.arg == "tensor":
            return keyword.value
    if len(call.args) > 1 and not any(isinstance(a, ast.Starred) for a in call.args[:2]):
        return call.args[1]
    return None


def slots_like_input(function: ast.AST, call: ast.Call, resolve: Resolve) -> Optional[str]:
    """Why the slots of the gather ``call`` cannot be shown to be new tensors made like its input
    ("" where they are).

    They are where the list is written in the call itself, or bound by the statement just before
    the call's, in the same block, to a list display or a comprehension (one ``for``, no ``if``)
    each of whose elements is ``torch.empty_like(t)``, ``torch.zeros_like(t)`` or
    ``torch.ones_like(t)``, nothing else in the call, of the very local ``t`` the call gathers.
    Such slots have the input's dtype, shape, device, layout and strides, no grad, and memory of
    torch's CPU allocator, neither pinned nor shared, and nothing but the list can have reached
    them: no statement runs between their making and the gather (a mode entered then is still
    active at the call, which a kept plan checks), nor the lookup of the callee, which must be
    torch's all_gather through modules (``GATHERS``: an object's attribute could be a property).
    A kept plan then spares two of its reads of each slot, those only code the proof cannot see
    could make wrong: pinned memory, and storages emptied since (``memgather.engine.kept``).
    """
    return _Proof(function, resolve).like_input(call)


def gatherer(function: ast.AST, call: ast.Call, resolve: Resolve) -> Verdict:
    """The function gathers into a list with ``call``; its first use after the gather must be one
    cat (dropped after it, or, ``needs_cow``, used again), else the list must be returned (``needs_cow``)
    with nothing done to it on the way but items replaced (``L[i] = x``)."""
    proof = _Proof(function, resolve)
    found = proof.gathered(call, _cat_node, "drops the list after the cat")
    if found.proven:
        return found
    returned = proof.gathered(call, _returned_whole, "returns the list", passes=_item_replaced, reuse=True)
    if not returned.proven:
        return found
    reason = f"{returned.reason}: its first use by torch is checked at run time"
    return replace(returned, reason=reason, needs_cow=True, returned=True)


def forward(function: ast.AST, call: ast.Call, resolve: Resolve) -> Verdict:
    """An autograd Function's ``forward``: gathers into a list with ``call`` and returns it whole."""
    return _Proof(function, resolve).gathered(call, _returned_whole, "returns the list whole")


def passes_on(function: ast.AST, call: ast.Call) -> Verdict:
    """A frame between a Function's ``forward`` and its applier: returns ``call``'s value as it is."""
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and node.value is call:
            return Verdict(True, f"returns the call's value at line {call.lineno}")
    return refuse(f"line {call.lineno}: does not return the gathered tensors as they are")


def receiver(function: ast.AST, call: ast.Call, resolve: Resolve) -> Verdict:
    """The applier of an all-gathering Function: the call's value must be dropped after one cat."""
    return _Proof(function, resolve).received(call)


class _Proof:
    def __init__(self, function: ast.AST, resolve: Resolve) -> None:
        self.function = function
        self.resolve = resolve
        self.parents: Dict[int, ast.AST] = {}
        for node in ast.walk(function):
            for child in ast.iter_child_nodes(node):
                self.parents[id(child)] = node

    def gathered(
        self,
        call: ast.Call,
        hand_over: _Reading,
        done: str,
        passes: Optional[_Reading] = None,
        reuse: bool = False,
    ) -> Verdict:
        listed = gather_list(call)
        if self.repeated(call):
            return refuse(f"line {call.lineno}: the gather is inside a comprehension or lambda")
        if not isinstance(listed, ast.Name):
            return refuse(f"line {call.lineno}: the gathered list is not a local name")
        name = listed.id
        graph, refusal = self._graph(name)
        if graph is None:
            return refuse(refusal)
        at = graph.containing(call)
        if at is None:
            return refuse(f"line {call.lineno}: the gather is not a statement of the function's own")
        if [n for n in flow.loads(at, name) if n is not listed] or flow.binds(at, name):
            return refuse(f"line {at.line}: {name} is used again in the statement that gathers into it")
        refusal = self._fresh_before(graph, at, name)
        if refusal:
            return refuse(refusal)
        return self._handed_over(graph, [*at.succ, *at.exc], name, hand_over, at.line, done, passes, reuse)

    def _handed_over(
        self,
        graph: flow.Graph,
        starts: List[int],
        name: str,
        hand_over: _Reading,
        line: int,
        done: str,
        passes: Optional[_Reading] = None,
        reuse: bool = False,
    ) -> Verdict:
        """``_dropped_after``; where that refuses a use after the hand-over, whether the hand-over
        is still the first use on every path (``needs_cow``: sound where the cat's result is a
        copy-on-write snapshot, which no later use of the slots can tell from torch's copy)."""
        strict = self._dropped_after(graph, starts, name, hand_over, line, done, passes)
        if strict.proven or reuse:
            return strict
        first = self._dropped_after(graph, starts, name, hand_over, line, _FIRST_USE, passes, reuse=True)
        if not first.proven:
            return strict
        reason = f"{first.reason} ({strict.reason}; proven where the cat's result is copy-on-write)"
        return Verdict(True, reason, needs_cow=True)

    def like_input(self, call: ast.Call) -> str:
        if not isinstance(self.function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return "not inside a function"
        tensor = gather_tensor(call)
        if not isinstance(tensor, ast.Name):
            return f"line {call.lineno}: the gathered tensor is not a local name"
        name = tensor.id
        if not _bound_locally(self.function, name):
            return f"line {call.lineno}: {name} is not a local of the function"
        refusal = self._reached(name)
        if refusal:
            return refusal
        if self.resolve(call.func) not in GATHERS:
            # Looking the callee up must run no code either (a property could change the input).
            return f"line {call.lineno}: the gather is not torch.distributed.all_gather, looked up through modules"
        listed = gather_list(call)
        made: Union[ast.List, ast.ListComp]
        if isinstance(listed, (ast.List, ast.ListComp)):
            made = listed
        elif isinstance(listed, ast.Name):
            made_or_why = self._bound_just_before(call, listed)
            if isinstance(made_or_why, str):
                return made_or_why
            made = made_or_why
        else:
            return f"line {call.lineno}: the gathered list is neither written in the call nor a local name"
        # No code of anyone's may run between the slots' making and the gather: it could change
        # the input in place (its dtype, its shape: ``t.data = ...``) after the slots were made
        # like it. So the gather must be its statement's whole value, its other arguments names or
        # constants, and a comprehension must step through a range.
        refusal = self._nothing_runs_after(call, listed, tensor)
        if refusal:
            return refusal
        if isinstance(made, ast.ListComp):
            if len(made.generators) != 1 or made.generators[0].ifs or made.generators[0].is_async:
                return f"line {made.lineno}: the list comprehension has more than one plain for"
            generator = made.generators[0]
            if not isinstance(generator.target, ast.Name) or generator.target.id == name:
                return f"line {made.lineno}: the comprehension binds {name}, or something other than a name"
            if not (isinstance(generator.iter, ast.Call) and self.resolve(generator.iter.func) == "range"):
                return f"line {made.lineno}: the comprehension steps through something other than a range"
            elements = [made.elt]
        else:
            elements = list(made.elts)
        if not elements or not all(self._made_like(element, name) for element in elements):
            return f"line {made.lineno}: not every slot is torch.empty_like, zeros_like or ones_like of {name}"
        return ""

    def _nothing_runs_after(self, call: ast.Call, listed: Optional[ast.expr], tensor: ast.expr) -> str:
        # What the call's value is used for runs after it (``dist.all_gather(...).wait()``).
        node: ast.AST = call
        statement = self.parents.get(id(node))
        while (isinstance(statement, ast.Attribute) and statement.value is node) or (
            isinstance(statement, ast.Call) and statement.func is node
        ):
            node, statement = statement, self.parents.get(id(statement))
        whole = isinstance(statement, (ast.Expr, ast.Assign, ast.AnnAssign)) and statement.value is node
        if not whole:
            return f"line {call.lineno}: the gather is part of a larger expression"
        others = [a for a in call.args if a is not listed and a is not tensor]
        others += [k.value for k in call.keywords if k.value is not listed and k.value is not tensor]
        if any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
            return f"line {call.lineno}: the gather's arguments are unpacked"
        if not all(isinstance(other, (ast.Name, ast.Constant)) for other in others):
            return f"line {call.lineno}: an argument of the gather is neither a name nor a constant"
        return ""

    def _made_like(self, element: ast.expr, name: str) -> bool:
        return (
            isinstance(element, ast.Call)
            and not element.keywords
            and len(element.args) == 1
            and isinstance(element.args[0], ast.Name)
            and element.args[0].id == name
            and self.resolve(element.func) in LIKE_FACTORIES
        )

    def _reached(self, name: str) -> str:
        """Ways for the local ``name`` to change other than by a binding of the function's own."""
        for node in ast.walk(self.function):
            if isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
                return f"line {node.lineno}: {name} is declared global or nonlocal"
            if isinstance(node, ast.NamedExpr) and node.target.id == name:
                return f"line {node.lineno}: {name} is bound by :="
            if node is not self.function and isinstance(node, _NESTED) and _mentions(node, name):
                return f"line {node.lineno}: {name} is captured by a nested function or class"
            if isinstance(node, ast.Call) and (_frame_reader(node) or self.resolve(node.func) in FRAME_READERS):
                return f"line {node.lineno}: the function reads its own frame"
            if isinstance(node, ast.Attribute) and node.attr in _FRAME_ATTRIBUTES:
                return f"line {node.lineno}: the function reads frames (.{node.attr})"
            if isinstance(node, ast.Name) and _mangled(node.id):
                return f"line {node.lineno}: {node.id} is a private name (mangled inside a class): not followed"
        return ""

    def _bound_just_before(self, call: ast.Call, listed: ast.Name) -> Union[ast.List, ast.ListComp, str]:
        """The list display or comprehension that the statement just before the gather's binds
        ``listed`` to, in the same block; else why not."""
        statement: Optional[ast.AST] = call
        while statement is not None and not isinstance(statement, ast.stmt):
            statement = self.parents.get(id(statement))
        parent = self.parents.get(id(statement)) if statement is not None else None
        block = None
        for field in ("body", "orelse", "finalbody"):
            items = getattr(parent, field, None)
            if isinstance(items, list) and any(item is statement for item in items):
                block = items
        if block is None or statement is None:
            return f"line {call.lineno}: the gather is not a statement of a block"
        index = next(i for i, item in enumerate(block) if item is statement)
        previous = block[index - 1] if index else None
        if previous is None or _single_target(previous) != listed.id:
            return f"line {call.lineno}: {listed.id} is not bound by the statement just before the gather"
        value = previous.value  # an Assign or AnnAssign: _single_target said so
        if not isinstance(value, (ast.List, ast.ListComp)):
            return f"line {previous.lineno}: {listed.id} is not bound to a list display or comprehension"
        refusal = self._reached(listed.id)
        if refusal:
            return refusal
        uses = [n for n in ast.walk(statement) if isinstance(n, ast.Name) and n.id == listed.id]
        if uses != [listed]:
            return f"line {call.lineno}: {listed.id} is used again in the statement that gathers into it"
        return value

    def argument_of(self, expression: ast.expr) -> Optional[ast.AST]:
        """The node holding ``expression``: for a keyword argument, the call (not the keyword)."""
        parent = self.parents.get(id(expression))
        return self.parents.get(id(parent)) if isinstance(parent, ast.keyword) else parent

    def repeated(self, node: ast.AST) -> bool:
        """Whether ``node`` lies in a comprehension, generator expression or lambda: run any number of times."""
        current = self.parents.get(id(node))
        while current is not None and current is not self.function:
            if isinstance(current, _REPEATED):
                return True
            current = self.parents.get(id(current))
        return False

    def received(self, call: ast.Call) -> Verdict:
        if self.repeated(call):
            return refuse(f"line {call.lineno}: the call is inside a comprehension or lambda")
        parent = self.argument_of(call)
        if isinstance(parent, ast.Call) and _tensors_argument(parent) is call and self._is_cat(parent):
            return Verdict(True, f"concatenates the gathered tensors at once at line {parent.lineno}")
        target = _single_target(parent) if isinstance(parent, (ast.Assign, ast.AnnAssign)) else None
        if target is None:
            return refuse(f"line {call.lineno}: the gathered tensors are neither bound to a name nor concatenated")
        graph, refusal = self._graph(target)
        if graph is None:
            return refuse(refusal)
        at = graph.containing(call)
        assert at is not None  # the call is part of the assignment, a statement of the function
        if flow.loads(at, target):
            return refuse(f"line {at.line}: {target} is used in the statement that binds it")
        return self._handed_over(graph, list(at.succ), target, _cat_node, at.line, "drops the tensors after the cat")

    # The parts of a proof.

    def _graph(self, name: str) -> Tuple[Optional[flow.Graph], str]:
        if not isinstance(self.function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None, "not inside a function (module or class code: its names are shared)"
        refusal = self._escapes(name)
        if refusal:
            return None, refusal
        try:
            return flow.Graph(self.function), ""
        except flow.Unsupported as error:
            return None, f"cannot follow {error}"

    def _escapes(self, name: str) -> str:
        """Ways for ``name`` to be reached other than by its reads in the function's own code."""
        for node in ast.walk(self.function):
            if isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
                kind = "global" if isinstance(node, ast.Global) else "nonlocal"
                return f"line {node.lineno}: {name} is declared {kind}"
            if isinstance(node, ast.NamedExpr) and node.target.id == name:
                return f"line {node.lineno}: {name} is bound by :="
            if node is not self.function and isinstance(node, _NESTED) and _mentions(node, name):
                return f"line {node.lineno}: {name} is captured by a nested function or class"
            if isinstance(node, _REPEATED[:-1]) and _mentions(node, name):
                return f"line {node.lineno}: {name} is read inside a comprehension or generator expression"
            if isinstance(node, ast.Call):
                reader = _frame_reader(node)
                if reader:
                    return f"line {node.lineno}: the function reads its own frame ({reader})"
            if isinstance(node, ast.Attribute) and node.attr in _FRAME_ATTRIBUTES:
                return f"line {node.lineno}: the function reads frames (.{node.attr})"
            if isinstance(node, ast.Call) and self.resolve(node.func) in FRAME_READERS:
                return f"line {node.lineno}: the function reads its own frame ({self.resolve(node.func)})"
            if isinstance(node, ast.Name) and _mangled(node.id):
                return f"line {node.lineno}: {node.id} is a private name (mangled inside a class): not followed"
        return ""

    def _fresh_before(self, graph: flow.Graph, at: flow.Node, name: str) -> str:
        """Every path into the gather binds ``name`` to a fresh list and reads it no more before the gather."""
        before = graph.predecessors()
        pending = list(before[at.index])
        if at.index == graph.entry:
            return f"{name} is not bound to a list in this function before the gather (a parameter, or unbound)"
        seen: Set[Tuple[int, bool]] = set()
        while pending:
            index, raised = pending.pop()
            if (index, raised) in seen:
                continue
            seen.add((index, raised))
            node = graph.nodes[index]
            # What the binding statement reads is the name's earlier value; one that raised bound nothing.
            if not raised and flow.binds(node, name):
                if not self._binds_fresh_list(node, name):
                    return f"line {node.line}: {name} is bound to something that is not a list of new tensors"
                continue
            if flow.loads(node, name):
                return f"line {node.line}: {name} is used before the gather"
            if index == graph.entry:
                return f"{name} is not bound to a list in this function before the gather (a parameter, or unbound)"
            pending.extend(before[index])
        return ""

    def _binds_fresh_list(self, node: flow.Node, name: str) -> bool:
        statement = node.statement
        if not isinstance(statement, (ast.Assign, ast.AnnAssign)) or _single_target(statement) != name:
            return False
        if node.binds != (statement,):  # the statement's own node, not a compound one it heads
            return False
        value = statement.value
        if isinstance(value, ast.ListComp):
            return self._fresh_tensor(value.elt)
        if isinstance(value, ast.List):
            return bool(value.elts) and all(self._fresh_tensor(element) for element in value.elts)
        return False

    def _fresh_tensor(self, expression: ast.expr) -> bool:
        if not isinstance(expression, ast.Call):
            return False
        function = expression.func
        if isinstance(function, ast.Attribute) and function.attr in FRESH_METHODS:
            return True
        return self.resolve(function) in FACTORIES

    def _dropped_after(
        self,
        graph: flow.Graph,
        starts: List[int],
        name: str,
        hand_over: _Reading,
        line: int,
        done: str,
        passes: Optional[_Reading] = None,
        reuse: bool = False,
    ) -> Verdict:
        """From ``starts`` the first read of ``name`` on every path is a hand-over, and (unless
        ``reuse``) none follows one; before it, only reads that ``passes`` allows."""
        pending = [(index, _BEFORE, 0) for index in starts]
        seen: Set[Tuple[int, int]] = set()
        handed: List[int] = []
        while pending:
            index, state, handed_at = pending.pop()
            if (index, state) in seen:
                continue
            seen.add((index, state))
            node = graph.nodes[index]
            reads = flow.loads(node, name)
            if reads and state == _AFTER:
                if reuse:
                    continue  # what follows the hand-over on this path is not this proof's to read
                return refuse(f"line {node.line}: {name} is used again after line {handed_at}")
            if reads and not (len(reads) == 1 and passes is not None and passes(self, node, reads[0])):
                if len(reads) != 1 or not hand_over(self, node, reads[0]):
                    return refuse(f"line {node.line}: {name} is used after the gather at line {line}, not by a cat")
                state, handed_at = _AFTER, node.line
                handed.append(node.line)
            pending.extend((nxt, state, handed_at) for nxt in node.exc)
            if not flow.binds(node, name):
                pending.extend((nxt, state, handed_at) for nxt in node.succ)
        if not handed:
            return refuse(f"line {line}: {name} is never concatenated")
        lines = ", ".join(str(n) for n in sorted(set(handed)))
        return Verdict(True, f"{done} at line {lines}")

    def _is_cat(self, call: ast.Call) -> bool:
        if self.resolve(call.func) not in CATS or len(call.args) > 2:
            return False
        if any(isinstance(a, ast.Starred) for a in call.args):
            return False
        dims = [call.args[1]] if len(call.args) == 2 else []
        for keyword in call.keywords:
            if keyword.arg == "dim":
                dims.append(keyword.value)
            elif keyword.arg != "tensors" or call.args:
                return False  # out=, axis=, **kwargs, or the list given twice
        return all(isinstance(d, ast.Constant) and type(d.value) is int and d.value == 0 for d in dims)


def _cat_node(proof: _Proof, node: flow.Node, read: ast.Name) -> bool:
    parent = proof.argument_of(read)
    return (
        isinstance(parent, ast.Call)
        and _tensors_argument(parent) is read
        and proof._is_cat(parent)
        and not proof.repeated(parent)
    )


def _returned_whole(proof: _Proof, node: flow.Node, read: ast.Name) -> bool:
    statement = node.statement
    if not isinstance(statement, ast.Return) or statement.value is None:
        return False
    value = statement.value
    if value is read:
        return True
    return (
        isinstance(value, ast.Call)
        and value.args == [read]
        and not value.keywords
        and proof.resolve(value.func) in _WHOLE
    )


def _item_replaced(proof: _Proof, node: flow.Node, read: ast.Name) -> bool:
    """``L[i] = x`` (the list's one read in the statement): an item replaced, no slot touched.

    The slot it replaces is dropped from the list; the cat that follows is checked at run time
    (a rank's own entry replaced by the gather's input, as torchmetrics does, still gives the
    buffer where the input's bytes are the ones gathered)."""
    statement = node.statement
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
        return False
    target = statement.targets[0]
    return isinstance(target, ast.Subscript) and target.value is read and not isinstance(target.slice, ast.Slice)


def last_name(expression: ast.expr) -> str:
    """The name an expression ends with: ``b`` of ``a.b``, ``a`` of ``a`` ("" for anything else)."""
    if isinstance(expression, ast.Attribute):
        return expression.attr
    return expression.id if isinstance(expression, ast.Name) else ""


def _tensors_argument(call: ast.Call) -> Optional[ast.expr]:
    if call.args:
        return call.args[0]
    for keyword in call.keywords:
        if keyword.arg == "tensors":
            return keyword.value
    return None


def _single_target(statement: ast.AST) -> Optional[str]:
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        target: ast.AST = statement.targets[0]
    elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
        target = statement.target
    else:
        return None
    return target.id if isinstance(target, ast.Name) else None


_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
# Scopes of their own that run where they stand, any number of times (a generator expression later still).
_REPEATED = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)


def _bound_locally(function: ast.AST, name: str) -> bool:
    """Whether ``name`` is a parameter of ``function`` or bound in its own code (not only in a nested scope)."""
    arguments = function.args  # type: ignore[attr-defined]  # a FunctionDef's: the caller checked
    parameters = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    parameters += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
    if any(parameter.arg == name for parameter in parameters):
        return True
    pending = list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        if isinstance(node, (*_NESTED, *_REPEATED)):
            continue
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        pending.extend(ast.iter_child_nodes(node))
    return False


def _mentions(scope: ast.AST, name: str) -> bool:
    """Whether a nested scope's own code names ``name`` (its decorators and defaults are the outer code's)."""
    if isinstance(scope, ast.Lambda):
        parts: List[ast.AST] = [scope.body]
    elif isinstance(scope, _REPEATED):
        parts = [scope]
    else:
        parts = list(getattr(scope, "body", []))
    return any(isinstance(n, ast.Name) and n.id == name for part in parts for n in ast.walk(part))


def _frame_reader(call: ast.Call) -> str:
    function = call.func
    if isinstance(function, ast.Name) and function.id in _FRAME_READERS:
        if function.id in ("vars", "dir") and call.args:
            return ""  # vars(obj) / dir(obj) read obj, not the frame
        return f"{function.id}()"
    if (
        isinstance(function, ast.Attribute)
        and function.attr in ("stack", "trace")
        and isinstance(function.value, ast.Name)
        and function.value.id == "inspect"
    ):
        return f"inspect.{function.attr}()"
    return ""


def calls_at(function: ast.AST, line: int, position: Optional[Tuple[int, int, int, int]]) -> List[ast.Call]:
    """The calls a frame may be making: the one at ``position`` (Python 3.11+ records each
    instruction's span), else every call that starts on ``line``, outermost first."""
    found = []
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        if position is not None:
            span = (node.lineno, node.end_lineno, node.col_offset, node.end_col_offset)
            if span == position:
                return [node]
        elif node.lineno == line:
            found.append(node)
    return [] if position is not None else found


def _mangled(name: str) -> bool:
    """``__name`` inside a class body means ``_Class__name`` at run time: not what a resolver looks up."""
    return name.startswith("__") and not name.endswith("__")


Source = Tuple[str, str]  # (module, attribute; "" for the module itself)


def imported_only(function: ast.AST, module_of: Callable[[ast.ImportFrom], Optional[str]]) -> Dict[str, Source]:
    """Names the function binds by imports alone -> what they import (``module_of``: the module
    a ``from`` import reads, None where it cannot be told).

    A name qualifies only where every binding of it anywhere in the function (nested scopes
    included, whose bindings a walk cannot always tell from the function's own) is an import of
    one and the same object, and at least one of those imports is in the function's own scope:
    so ``try: from a import cat`` / ``except ImportError: from torch import cat`` (two objects),
    an import in a nested function only, an import whose module cannot be told, a ``match``
    capture, an ``except ... as`` name or a ``global`` declaration of the name each leave it
    unresolved.
    """
    sources: Dict[str, Set[Source]] = {}
    own: Set[str] = set()
    other: Set[str] = set()
    stack: List[Tuple[ast.AST, bool]] = [(child, False) for child in ast.iter_child_nodes(function)]
    while stack:
        node, inside = stack.pop()
        for name, source in bindings(node, module_of):
            if source is None:
                other.add(name)
            else:
                sources.setdefault(name, set()).add(source)
                if not inside:
                    own.add(name)
        below = inside or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
        stack.extend((child, below) for child in ast.iter_child_nodes(node))
    return {
        name: next(iter(found))
        for name, found in sources.items()
        if name in own and name not in other and len(found) == 1
    }


def bindings(node: ast.AST, module_of: Callable[[ast.ImportFrom], Optional[str]]) -> List[Tuple[str, Optional[Source]]]:
    """The names ``node`` itself binds, each with what its import reads (``imported_only``), else None."""
    if isinstance(node, ast.ImportFrom):
        module = module_of(node)
        return [(alias.asname or alias.name, None if module is None else (module, alias.name)) for alias in node.names]
    if isinstance(node, ast.Import):
        found: List[Tuple[str, Optional[Source]]] = []
        for alias in node.names:
            # ``import a.b`` binds the top-level module ``a``; ``import a.b as c`` binds ``a.b`` to ``c``.
            module = alias.name if alias.asname else alias.name.split(".")[0]
            found.append((alias.asname or module, (module, "")))
        return found
    if isinstance(node, ast.Name):
        return [(node.id, None)] if isinstance(node.ctx, (ast.Store, ast.Del)) else []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [(node.name, None)]
    if isinstance(node, ast.arg):
        return [(node.arg, None)]
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return [(name, None) for name in node.names]
    # An ``except ... as`` name, and a ``match`` capture (MatchAs, MatchStar: name; MatchMapping: rest).
    if isinstance(node, ast.ExceptHandler) or type(node).__name__ in ("MatchAs", "MatchStar", "MatchMapping"):
        names = (getattr(node, field, None) for field in ("name", "rest"))
        return [(name, None) for name in names if isinstance(name, str)]
    return []
