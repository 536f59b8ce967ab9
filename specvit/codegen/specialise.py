"""Specialise a layer class's source for one model: fold what is constant, drop the branches never taken.

An ejected file carries the source of each layer class it uses. The classes serve every model, so they
branch on features (``if rope is not None``, ``if self.causal``); for one model many of these are
constant: an attribute every instance sets to the same value, a keyword argument no call passes, a
constructor argument every call passes the same. :func:`specialise` substitutes those constants
(:mod:`specvit.codegen.fold`), folds the tests that become constant and keeps only the branches taken, then
tidies what is left (:mod:`specvit.codegen.tidy`), until nothing changes. It edits the original text, so
comments (the shape comments at reshapes) and layout survive.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import keyword
import re
import textwrap
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specvit.codegen.fold import UNKNOWN, Fold, PlainCall, is_flag, unparse
from specvit.codegen.lines import reflow, rejoin_lines
from specvit.codegen.tidy import docstring, signature, tidy_class

__all__ = [
    "Facts",
    "Renderer",
    "docstring",
    "rewrite_function",
    "single_names",
    "specialise",
    "specialise_source",
]

_MUTABLE = {"training"}  # attributes that change after construction


@dataclass
class Facts:
    """What is constant in one class for one model.

    Args:
        attrs: ``self.<name>`` -> its value in every instance.
        absent: keyword arguments of ``forward`` no call passes -> their default.
        init: constructor arguments every call passes with the same value.
        module: where the class's names are defined.
        renames: names to write otherwise (``Linear`` -> ``nn.Linear``: no fast paths in an ejected file).
        plain_calls: functions whose call is written otherwise -> the call it becomes.
        keep: private methods other code calls (``owner._attend``): kept whole, with their parameters.
        functions: helper functions whose calls drop arguments: name -> (its parameters, those folded).
    """

    attrs: dict[str, Any]
    absent: dict[str, Any]
    init: dict[str, Any]
    module: types.ModuleType | None = None
    renames: dict[str, str] = field(default_factory=dict)
    plain_calls: Mapping[str, PlainCall] = field(default_factory=dict)
    keep: frozenset[str] = frozenset()
    functions: dict[str, tuple[list[str], set[str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.attrs = {k: v for k, v in self.attrs.items() if k not in _MUTABLE}

    @property
    def folded(self) -> set[str]:
        """The constructor arguments substituted into the class: no longer its parameters."""
        return {k for k, v in self.init.items() if is_flag(v)}

    def fold(self, method: str, single: dict[str, Any] | None = None) -> Fold:
        """The folding of one method's body."""
        names = dict(self.absent) if method == "forward" else dict(self.init) if method == "__init__" else {}
        attrs = self.attrs if method != "__init__" else {}
        always = frozenset(self.absent) if method == "forward" else frozenset()
        fold = Fold({**names, **(single or {})}, attrs, self.module, self.renames, self.plain_calls, always)
        fold.functions = self.functions
        return fold


class Renderer:
    """Re-emits a class's source line by line, folding constant tests and substituting constants."""

    def __init__(self, source: str, facts: Facts):
        self.lines = source.splitlines()
        self.facts = facts
        self.fold = Fold({}, {})
        self.single: set[str] = set()  # local names assigned once: a constant they are assigned is known

    def text(self, stmt: ast.stmt) -> list[str]:
        """The original lines of ``stmt`` (trailing comments included), constants substituted and folded."""
        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        lines = self.lines[first - 1 : last]
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line) + 1)
        text = "\n".join(lines)
        edits = self._edits(stmt)
        value = getattr(stmt, "value", None)
        for (a, b), replacement in sorted(edits, reverse=True):
            i, j = offsets[a[0] - first] + a[1], offsets[b[0] - first] + b[1]
            if value is not None and (a, b) == _span(value):  # a statement's whole value: its parentheses go
                before, after = text[:i].rstrip(), text[j:].lstrip()
                if (
                    before.endswith("(")
                    and after.startswith(")")
                    and before[:-1].rstrip().endswith(("=", "return"))
                ):
                    i, j = len(before) - 1, len(text) - len(after) + 1
                    replacement = (" " if not before[:-1].endswith(" ") else "") + replacement
            if _grouping(text, i, j) and _paren(replacement) == replacement:  # (q if c else x) -> q, not (q)
                i, j = i - 1, j + 1
            text = text[:i] + replacement + text[j:]
        out = text.splitlines()
        return reflow(rejoin_lines(out)) if edits else out

    def _edits(self, node: ast.AST) -> list[tuple[tuple[tuple[int, int], tuple[int, int]], str]]:
        """Text replacements inside ``node``: the outermost sub-expressions that fold or are substituted."""
        out = []
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.JoinedStr | ast.stmt):
                continue
            if isinstance(child, ast.expr) and not isinstance(getattr(child, "ctx", None), ast.Store):
                folded = self.fold.visit(_copy(child))
                if ast.unparse(folded) != ast.unparse(child) and not isinstance(child, ast.Tuple):
                    end = (child.end_lineno or child.lineno, child.end_col_offset or 0)
                    after = unparse(folded)
                    if isinstance(folded, ast.GeneratorExp) and _sole_argument(node, child):
                        after = after[1:-1]  # f(x for x in y)
                    out.append(
                        (
                            ((child.lineno, child.col_offset), end),
                            after if _bare(node, child) else _paren(after),
                        )
                    )
                    continue  # a tuple's items fold one by one
            out += self._edits(child)
        return out

    def block(self, stmts: list[ast.stmt], indent: int) -> list[str]:
        """The lines of ``stmts``, their indentation reduced by ``indent`` spaces; none after a return."""
        out: list[str] = []
        for k, stmt in enumerate(stmts):
            if k:  # blank lines and comments between statements
                out += [
                    _dedent(line, indent) for line in self.lines[stmts[k - 1].end_lineno : stmt.lineno - 1]
                ]
            out += self.statement(stmt, indent)
            if self.ends(stmt):
                break
        return out

    def test(self, stmt: ast.If) -> bool | None:
        """Whether ``stmt``'s branch is known to be taken (True), skipped (False), or not known (None)."""
        return self.fold.truth(self.fold.visit(_copy(stmt.test)))

    def ends(self, stmt: ast.stmt) -> bool:
        """Whether control never passes ``stmt``: a return, a raise, or a folded ``if`` whose branch ends so."""
        if isinstance(stmt, ast.Return | ast.Raise):
            return True
        if isinstance(stmt, ast.If) and (taken := self.test(stmt)) is not None:
            branch = stmt.body if taken else stmt.orelse
            return bool(branch) and any(self.ends(s) for s in branch)
        return False

    def statement(self, stmt: ast.stmt, indent: int, as_if: bool = False) -> list[str]:
        """The lines of ``stmt``; ``as_if``: an ``elif`` whose ``if`` folded away starts a chain itself."""
        if isinstance(stmt, ast.If) and (taken := self.test(stmt)) is not None:
            branch = stmt.body if taken else stmt.orelse
            if not taken and self._is_elif(branch):  # the elif becomes the chain's if
                return self.statement(branch[0], indent, as_if=True)
            return self.block(branch, indent + _inner(stmt, self.lines)) if branch else []
        if isinstance(stmt, ast.Expr) and _is_check(stmt):
            return []  # a validation of constructor arguments: the spec was validated
        if isinstance(stmt, ast.If | ast.For | ast.While | ast.With | ast.FunctionDef):
            if isinstance(stmt, ast.For | ast.While):
                self._forget_within(stmt)  # what a loop assigns is not known at its start either
            entry = set(self.fold.assigned)
            lines = self.compound(stmt, indent, as_if)
            self._forget_within(stmt)
            if not isinstance(stmt, ast.If | ast.With):  # a loop's body may not run
                self.fold.assigned = entry
            return lines
        if isinstance(stmt, ast.Try):
            self._forget_within(stmt)
        lines = [_dedent(line, indent) for line in self.text(stmt)]
        lines = rejoin_lines(lines) if indent else lines  # dedented out of a folded branch, it may fit a line
        self.fold.forget(stmt)
        self.fold.assigned |= _stored(stmt)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            value = self.fold.value(self.fold.visit(_copy(stmt.value)))
            if name in self.single and value is not UNKNOWN and not isinstance(value, tuple):
                self.fold.names[name] = value  # the later reads fold, and the store is dropped as dead
            elif name in self.single and isinstance(stmt.value, ast.Name) and stmt.value.id in self.single:
                self.fold.aliases[name] = stmt.value.id  # kv_inner = inner: read as inner
            elif is_flag(value):  # `visible = None`: so until the next statement assigning it
                self.fold.names[name] = value
        return lines

    def _forget_within(self, stmt: ast.stmt) -> None:
        """Names a compound statement assigns somewhere inside: after it (or in a loop) they are not known."""
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in self.single:
                self.fold.names.pop(node.id, None)

    def _is_elif(self, orelse: list[ast.stmt]) -> bool:
        return len(orelse) == 1 and self.lines[orelse[0].lineno - 1].lstrip().startswith("elif")

    def compound(self, stmt: Any, indent: int, as_if: bool = False) -> list[str]:
        """A statement with a body: its header (folded), its body, and an ``else``/``elif`` if any."""
        head = self.lines[stmt.lineno - 1 : stmt.body[0].lineno - 1]
        if isinstance(stmt, ast.If):
            elif_ = self.lines[stmt.lineno - 1].lstrip().startswith("elif") and not as_if
            kw = "elif" if elif_ else "if"
            pad = " " * (len(head[0]) - len(head[0].lstrip()))
            comment = head[0].partition("  # ")[2] if len(head) == 1 else ""
            head = [
                f"{pad}{kw} {unparse(self.fold.visit(_copy(stmt.test)))}:"
                + (f"  # {comment}" if comment else "")
            ]
        out = [_dedent(line, indent) for line in head]
        entry = dict(self.fold.names), dict(self.fold.aliases)  # what is known where each branch starts
        assigned = set(self.fold.assigned)  # the names bound on every path to here
        body_ends = any(self.ends(s) for s in stmt.body)
        out += self.block(stmt.body, indent)
        orelse = getattr(stmt, "orelse", [])
        if not orelse:
            self.fold.assigned = assigned if isinstance(stmt, ast.If) else self.fold.assigned
            return out
        if isinstance(stmt, ast.If):  # a name the body stores is still its constant in the else/elif
            self.fold.names, self.fold.aliases = dict(entry[0]), dict(entry[1])
        after_body, self.fold.assigned = self.fold.assigned, set(assigned)
        if isinstance(stmt, ast.If) and self._is_elif(orelse):
            branch = self.statement(orelse[0], indent)
            self._join(after_body, body_ends, any(self.ends(s) for s in orelse))
            if not branch or branch[0].lstrip().startswith("elif"):
                return [*out, *branch]
            return [*out, f"{_indent_of(out[0])}else:", *("    " + line if line else line for line in branch)]
        else_line = next(
            i
            for i in range(stmt.body[-1].end_lineno, orelse[0].lineno)
            if self.lines[i].strip().startswith("else:")
        )
        out += [_dedent(self.lines[else_line], indent), *self.block(orelse, indent)]
        self._join(after_body, body_ends, any(self.ends(s) for s in orelse))
        return out

    def _join(self, after_body: set[str], body_ends: bool, else_ends: bool) -> None:
        """The names bound after an if/else: those both branches bind (a branch that returns binds all)."""
        if body_ends and not else_ends:
            return  # only the else's path goes on
        self.fold.assigned = after_body if else_ends else after_body & self.fold.assigned

    def initialisers(self, indent: str) -> list[str]:
        """``window = None`` for each dropped parameter read where a branch may have left it unassigned: the
        value it was folded to, bound as the parameter was."""
        return [
            f"{indent}{n} = {unparse(ast.Constant(self.fold.initial[n]))}" for n in sorted(self.fold.exposed)
        ]


def _grouping(text: str, i: int, j: int) -> bool:
    """Whether ``text[i:j]`` is enclosed in parentheses that only group it (not a call's, not a tuple's)."""
    if i < 1 or j >= len(text) or text[i - 1] != "(" or text[j] != ")":
        return False
    before = text[: i - 1].rstrip()
    word = re.search(r"\w*$", before)
    if word and word.group(0) and keyword.iskeyword(word.group(0)):
        return True  # return (x), not (x)
    return not before or not (before[-1].isalnum() or before[-1] in "_)]}'\"")


def _stored(stmt: ast.stmt) -> set[str]:
    """The names a simple statement binds."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    return {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}


def _span(node: ast.expr) -> tuple[tuple[int, int], tuple[int, int]]:
    return (node.lineno, node.col_offset), (node.end_lineno or node.lineno, node.end_col_offset or 0)


def _bare(parent: ast.AST, child: ast.expr) -> bool:
    """Whether ``child`` of ``parent`` needs no parentheses whatever it becomes (a statement's value, an
    argument, an item)."""
    if isinstance(parent, ast.Call):
        return child is not parent.func
    return isinstance(parent, ast.stmt | ast.keyword | ast.List | ast.Tuple | ast.Set | ast.Dict)


def _sole_argument(parent: ast.AST, child: ast.expr) -> bool:
    return isinstance(parent, ast.Call) and parent.args == [child] and not parent.keywords


def _is_check(stmt: ast.Expr) -> bool:
    """``check_parts(...)``: a call, as a statement, of a function that validates (``check_*``)."""
    call = stmt.value
    return (
        isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id.startswith("check_")
    )


def _bound(klass: ast.ClassDef) -> dict[str, dict[str, Any]]:
    """Private method -> the parameters every call of it (``self._memory(memory, None, None)``) passes the
    same constant, with that constant (a default when a call leaves one out)."""
    methods = {f.name: f for f in klass.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_")}
    methods = {n: f for n, f in methods.items() if not n.startswith("__")}
    seen: dict[str, list[dict[str, Any]]] = {n: [] for n in methods}
    for node in ast.walk(klass):
        f = node.func if isinstance(node, ast.Call) else None
        on_self = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"
        if on_self and isinstance(f, ast.Attribute) and f.attr in methods and isinstance(node, ast.Call):
            seen[f.attr].append(_passed(methods[f.attr], node))
    out = {}
    for name, calls in seen.items():
        if calls:
            common = {k: v for k, v in calls[0].items() if all(k in c and _same(c[k], v) for c in calls)}
            out[name] = {k: v for k, v in common.items() if is_flag(v)}
    return {n: v for n, v in out.items() if v}


def _passed(fn: ast.FunctionDef, call: ast.Call) -> dict[str, Any]:
    """The constants a call passes to ``fn``'s parameters (its defaults for those it leaves out)."""
    params = [a.arg for a in fn.args.args[1:]]
    defaults = dict(zip(params[len(params) - len(fn.args.defaults) :], fn.args.defaults, strict=True))
    values: dict[str, ast.expr] = {**defaults, **dict(zip(params, call.args, strict=False))}
    values |= {k.arg: k.value for k in call.keywords if k.arg}
    return {k: v.value for k, v in values.items() if isinstance(v, ast.Constant)}


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def single_names(fn: ast.FunctionDef) -> set[str]:
    """Local names ``fn`` assigns exactly once, by a plain ``name = value``, and binds in no other way."""
    counts: Counter[str] = Counter()
    plain: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            counts[node.id] += 1
        elif isinstance(node, ast.arg):
            counts[node.arg] += 2
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            plain.add(node.targets[0].id)
        elif isinstance(node, ast.AugAssign | ast.NamedExpr):
            counts[getattr(node.target, "id", "")] += 2
    return {n for n in plain if counts[n] == 1}


def _indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _inner(stmt: ast.If, lines: list[str]) -> int:
    """How much deeper a branch of ``stmt`` is indented than ``stmt`` itself."""
    first = (stmt.body or stmt.orelse)[0]
    return len(_indent_of(lines[first.lineno - 1])) - len(_indent_of(lines[stmt.lineno - 1]))


def _dedent(line: str, indent: int) -> str:
    return line[min(indent, len(_indent_of(line))) :] if line.strip() else ""


def _paren(text: str) -> str:
    """Keep a replaced sub-expression's precedence: parenthesise operators, not atoms and calls."""
    node = ast.parse(text, mode="eval").body
    atomic = (
        ast.Name | ast.Constant | ast.Call | ast.Attribute | ast.Subscript | ast.List | ast.Dict | ast.Tuple
    )
    return text if isinstance(node, atomic) else f"({text})"


def _copy(node: ast.expr) -> ast.expr:
    return copy.deepcopy(node)  # folding must not touch the original tree


def _once(source: str, facts: Facts) -> str:
    """One pass of specialisation over a class's source."""
    tree = ast.parse(source)
    klass = tree.body[0]
    assert isinstance(klass, ast.ClassDef)
    r = Renderer(source, facts)
    bound = {m: v for m, v in _bound(klass).items() if m not in facts.keep}
    methods = {f.name: f for f in klass.body if isinstance(f, ast.FunctionDef)}
    out = r.lines[: klass.lineno]
    has_doc = ast.get_docstring(klass) is not None
    if has_doc:
        out += docstring(klass, facts.folded, r.lines)
    out += r.lines[klass.body[0].end_lineno : klass.body[1].lineno - 1] if len(klass.body) > 1 else []
    for k, item in enumerate(klass.body):
        if k == 0 and has_doc:
            continue
        start = min([item.lineno, *(d.lineno for d in getattr(item, "decorator_list", []))])
        if k > 1 or (k == 1 and not has_doc):
            out += r.lines[klass.body[k - 1].end_lineno : start - 1]
        if not isinstance(item, ast.FunctionDef):
            out += r.lines[item.lineno - 1 : item.end_lineno]
            continue
        if item.name == "extra_repr":  # what print(model) shows of a layer: not part of the model
            while out and not out[-1].strip():
                out.pop()
            continue
        drop = (
            set(facts.absent)
            if item.name == "forward"
            else facts.folded
            if item.name == "__init__"
            else set()
        )
        folded = bound.get(item.name, {})
        drop |= set(folded)
        r.fold, r.single = facts.fold(item.name, folded), single_names(item)
        r.fold.always |= set(folded)
        r.fold.dropped, r.fold.initial = (
            set(drop),
            {**r.fold.initial, **dict.fromkeys(drop - set(r.fold.initial))},
        )
        r.fold.bound = {m: ([a.arg for a in methods[m].args.args[1:]], set(v)) for m, v in bound.items()}
        out += r.lines[start - 1 : item.lineno - 1]  # decorators
        out += signature(item, drop, r.lines, 0)
        body = item.body
        if ast.get_docstring(item) is not None:
            out += docstring(item, drop, r.lines)
            body = body[1:]
        lines = r.block(body, 0)
        out += r.initialisers(_indent_of(r.lines[item.lineno - 1]) + "    ") + lines
        out += [] if lines else [_indent_of(r.lines[item.lineno - 1]) + "    pass"]
    while out and not out[-1].strip():
        out.pop()
    return tidy_class("\n".join(out) + "\n", facts.keep)


def specialise_source(source: str, facts: Facts) -> str:
    """:func:`specialise` of a class's source text."""
    for _ in range(8):
        done = _once(source, facts)
        facts = dataclasses.replace(facts, functions={})  # a call drops its folded arguments once
        if done == source:
            break
        source = done
    return source


def specialise(cls: type, facts: Facts) -> str:
    """The source of ``cls`` with the constants of ``facts`` folded and the branches never taken removed.

    Args:
        cls: a layer class (of :mod:`specvit.nn`, or a plain one of :mod:`specvit.codegen.templates`).
        facts: what is constant for the model being ejected.
    """
    return specialise_source(textwrap.dedent(inspect.getsource(cls)), facts)


def rewrite_function(
    source: str,
    module: types.ModuleType,
    renames: dict[str, str],
    plain_calls: Mapping[str, PlainCall],
    keep: frozenset[str] = frozenset(),
) -> str:
    """A module-level function's or class's source with the names ``renames`` and the calls of ``plain_calls``
    written otherwise (an ejected file's plain torch for the fast paths).

    Args:
        source: the definition's text.
        module: where its names are defined.
        renames: name -> the expression it becomes.
        plain_calls: functions whose call is written otherwise -> the call it becomes.
        keep: private methods other code calls.
    """
    facts = Facts({}, {}, {}, module, renames, plain_calls, keep)
    node = ast.parse(source).body[0]
    if isinstance(node, ast.ClassDef):
        return specialise_source(source, facts)
    r = Renderer(source, facts)
    r.fold = Fold({}, {}, module, renames, plain_calls)
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    if not isinstance(node, ast.FunctionDef):
        return source
    return "\n".join([*r.lines[start - 1 : node.lineno - 1], *r.statement(node, 0)]) + "\n"
