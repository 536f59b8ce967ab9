"""Specialise a layer class's source for one model: fold what is constant, drop the branches never taken.

An ejected file carries the source of each layer class it uses. The classes serve every model, so they
branch on features (``if rope is not None``, ``if self.causal``); for one model many of these are
constant: an attribute every instance sets to the same value, a keyword argument no call passes, a
constructor argument every call passes the same. :func:`specialise` substitutes those constants, folds
the tests that become constant and keeps only the branches taken. It edits the original text, so
comments (the shape comments at reshapes) and layout survive.
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
from typing import Any

__all__ = ["Facts", "specialise"]

_UNKNOWN = object()
_MUTABLE = {"training"}  # attributes that change after construction


def _is_flag(v: Any) -> bool:
    """Flags and kinds (``True``, ``None``, ``"conv"``) are folded; sizes stay arguments, as written."""
    return isinstance(v, bool | str | type(None))


class Facts:
    """What is constant in one class for one model.

    Args:
        attrs: ``self.<name>`` -> its value in every instance.
        absent: keyword arguments of ``forward`` no call passes (always their default, None).
        init: constructor arguments every call passes with the same value.
    """

    def __init__(self, attrs: dict[str, Any], absent: set[str], init: dict[str, Any]):
        self.attrs = {k: v for k, v in attrs.items() if _is_flag(v) and k not in _MUTABLE}
        self.absent = set(absent)
        self.init = {k: v for k, v in init.items() if _is_flag(v)}


class _Fold(ast.NodeTransformer):
    """Substitutes known names and attributes in an expression and evaluates what becomes constant."""

    def __init__(self, names: dict[str, Any], attrs: dict[str, Any]):
        self.names, self.attrs = names, attrs

    def forget(self, stmt: ast.stmt) -> None:
        """A kept statement assigns these names: they are no longer the constants they started as."""
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        for target in targets:
            for node in ast.walk(target) if target is not None else ():
                if isinstance(node, ast.Name):
                    self.names.pop(node.id, None)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.names:
            return ast.copy_location(ast.Constant(self.names[node.id]), node)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
        if is_self and isinstance(node.ctx, ast.Load) and node.attr in self.attrs:
            return ast.copy_location(ast.Constant(self.attrs[node.attr]), node)
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        value = _compare(node)
        return ast.copy_location(ast.Constant(value), node) if value is not _UNKNOWN else node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        is_and = isinstance(node.op, ast.And)
        kept = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                if bool(v.value) != is_and:  # False in `and`, True in `or` decides
                    return ast.copy_location(ast.Constant(not is_and), node)
                continue
            kept.append(v)
        if not kept:
            return ast.copy_location(ast.Constant(is_and), node)
        return kept[0] if len(kept) == 1 else ast.copy_location(ast.BoolOp(node.op, kept), node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and isinstance(node.operand, ast.Constant):
            return ast.copy_location(ast.Constant(not node.operand.value), node)
        return node

    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.test, ast.Constant):
            return node.body if node.test.value else node.orelse
        return node


def _compare(node: ast.Compare) -> Any:
    """The value of a comparison of constants (``None is not None``, ``"conv" == "linear"``), if decidable."""
    if len(node.ops) != 1 or not isinstance(node.left, ast.Constant):
        return _UNKNOWN
    a, op, right = node.left.value, node.ops[0], node.comparators[0]
    if isinstance(right, ast.Tuple | ast.List) and all(isinstance(e, ast.Constant) for e in right.elts):
        options = [e.value for e in right.elts if isinstance(e, ast.Constant)]
        return {ast.In: a in options, ast.NotIn: a not in options}.get(type(op), _UNKNOWN)
    if not isinstance(right, ast.Constant):
        return _UNKNOWN
    b = right.value
    return {ast.Is: a is b, ast.IsNot: a is not b, ast.Eq: a == b, ast.NotEq: a != b}.get(type(op), _UNKNOWN)


class _Renderer:
    """Re-emits a class's source line by line, folding constant tests and substituting constants."""

    def __init__(self, source: str, facts: Facts):
        self.lines = source.splitlines()
        self.facts = facts
        self.fold = _Fold({}, {})

    def text(self, stmt: ast.stmt) -> list[str]:
        """The original lines of ``stmt`` (trailing comments included), constants substituted and folded."""
        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        lines = self.lines[first - 1 : last]
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line) + 1)
        text = "\n".join(lines)
        for (a, b), replacement in sorted(self._edits(stmt), reverse=True):
            i, j = offsets[a[0] - first] + a[1], offsets[b[0] - first] + b[1]
            text = text[:i] + replacement + text[j:]
        return text.splitlines()

    def _edits(self, node: ast.AST) -> list[tuple[tuple[tuple[int, int], tuple[int, int]], str]]:
        """Text replacements inside ``node``: the outermost sub-expressions that fold or are substituted."""
        out = []
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.JoinedStr | ast.stmt):
                continue
            if isinstance(child, ast.expr) and not isinstance(getattr(child, "ctx", None), ast.Store):
                before = ast.unparse(child)
                after = ast.unparse(self.fold.visit(_copy(child)))
                if after != before and not isinstance(child, ast.Tuple):  # a tuple's items fold one by one
                    end = (child.end_lineno or child.lineno, child.end_col_offset or 0)
                    out.append((((child.lineno, child.col_offset), end), _paren(after)))
                    continue
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

    def ends(self, stmt: ast.stmt) -> bool:
        """Whether control never passes ``stmt``: a return, a raise, or a folded ``if`` whose branch ends so."""
        if isinstance(stmt, ast.Return | ast.Raise):
            return True
        if isinstance(stmt, ast.If):
            test = self.fold.visit(_copy(stmt.test))
            if isinstance(test, ast.Constant):
                taken = stmt.body if test.value else stmt.orelse
                return bool(taken) and any(self.ends(s) for s in taken)
        return False

    def statement(self, stmt: ast.stmt, indent: int, as_if: bool = False) -> list[str]:
        """The lines of ``stmt``; ``as_if``: an ``elif`` whose ``if`` folded away starts a chain itself."""
        if isinstance(stmt, ast.If):
            test = self.fold.visit(_copy(stmt.test))
            if isinstance(test, ast.Constant):
                taken = stmt.body if test.value else stmt.orelse
                if not test.value and self._is_elif(taken):  # the elif becomes the chain's if
                    return self.statement(taken[0], indent, as_if=True)
                return self.block(taken, indent + _inner(stmt, self.lines)) if taken else []
        if isinstance(stmt, ast.If | ast.For | ast.While | ast.With | ast.FunctionDef):
            return self.compound(stmt, indent, as_if)
        lines = [_dedent(line, indent) for line in self.text(stmt)]
        self.fold.forget(stmt)
        return lines

    def _is_elif(self, orelse: list[ast.stmt]) -> bool:
        return len(orelse) == 1 and self.lines[orelse[0].lineno - 1].lstrip().startswith("elif")

    def compound(self, stmt: Any, indent: int, as_if: bool = False) -> list[str]:
        """A statement with a body: its header (folded), its body, and an ``else``/``elif`` if any."""
        head = self.lines[stmt.lineno - 1 : stmt.body[0].lineno - 1]
        if isinstance(stmt, ast.If):
            elif_ = self.lines[stmt.lineno - 1].lstrip().startswith("elif") and not as_if
            kw = "elif" if elif_ else "if"
            pad = " " * (len(head[0]) - len(head[0].lstrip()))
            head = [f"{pad}{kw} {ast.unparse(self.fold.visit(_copy(stmt.test)))}:"]
        out = [_dedent(line, indent) for line in head]
        out += self.block(stmt.body, indent)
        orelse = getattr(stmt, "orelse", [])
        if not orelse:
            return out
        if isinstance(stmt, ast.If) and self._is_elif(orelse):
            branch = self.statement(orelse[0], indent)
            if not branch or branch[0].lstrip().startswith("elif"):
                return [*out, *branch]
            return [*out, f"{_indent_of(out[0])}else:", *("    " + line if line else line for line in branch)]
        else_line = next(
            i for i in range(stmt.body[-1].end_lineno, orelse[0].lineno) if self.lines[i].strip() == "else:"
        )
        return [*out, _dedent(self.lines[else_line], indent), *self.block(orelse, indent)]


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
    atomic = ast.Name | ast.Constant | ast.Call | ast.Attribute | ast.Subscript | ast.List | ast.Dict
    return text if isinstance(node, atomic) else f"({text})"


def _copy(node: ast.expr) -> ast.expr:
    return copy.deepcopy(node)  # folding must not touch the original tree


def _signature(fn: ast.FunctionDef, drop: set[str], lines: list[str], indent: int) -> list[str]:
    """The ``def`` line of ``fn`` without the parameters ``drop``."""
    args = fn.args
    defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    parts = [
        ast.unparse(a) + (f" = {ast.unparse(d)}" if d is not None else "")
        for a, d in zip(args.args, defaults, strict=True)
        if a.arg not in drop
    ]
    kw = [
        ast.unparse(a) + (f" = {ast.unparse(d)}" if d is not None else "")
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
        if a.arg not in drop
    ]
    if kw:
        parts += ["*", *kw]
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    pad = _indent_of(lines[fn.lineno - 1])[indent:]
    one = f"{pad}def {fn.name}({', '.join(parts)}){returns}:"
    if len(one) <= 110:
        return [one]
    return [f"{pad}def {fn.name}(", *(f"{pad}    {p}," for p in parts), f"{pad}){returns}:"]


def _docstring(node: ast.FunctionDef | ast.ClassDef, drop: set[str], lines: list[str]) -> list[str]:
    """``node``'s docstring lines without the ``Args:`` entries of the parameters ``drop``."""
    first = node.body[0]
    out: list[str] = []
    skipping, depth = False, 0
    for line in lines[first.lineno - 1 : first.end_lineno]:
        name = line.strip().split(":", 1)[0]
        if ":" in line and name in drop:
            skipping, depth = True, len(_indent_of(line))
            continue
        if skipping and line.strip() and len(_indent_of(line)) > depth:
            continue
        skipping = False
        out.append(line)
    return out


def specialise(cls: type, facts: Facts) -> str:
    """The source of ``cls`` with the constants of ``facts`` folded and the branches never taken removed.

    Args:
        cls: a layer class of :mod:`specvit.nn`.
        facts: what is constant for the model being ejected.
    """
    source = textwrap.dedent(inspect.getsource(cls))
    tree = ast.parse(source)
    klass = tree.body[0]
    assert isinstance(klass, ast.ClassDef)
    r = _Renderer(source, facts)
    out = r.lines[: klass.lineno]
    if ast.get_docstring(klass) is not None:
        out += _docstring(klass, set(facts.init), r.lines)
    out += r.lines[klass.body[0].end_lineno : klass.body[1].lineno - 1] if len(klass.body) > 1 else []
    for k, item in enumerate(klass.body):
        if k == 0 and ast.get_docstring(klass) is not None:
            continue
        start = min([item.lineno, *(d.lineno for d in getattr(item, "decorator_list", []))])
        if k > 1 or (k == 1 and ast.get_docstring(klass) is None):
            out += r.lines[klass.body[k - 1].end_lineno : start - 1]
        if not isinstance(item, ast.FunctionDef):
            out += r.lines[item.lineno - 1 : item.end_lineno]
            continue
        drop = (
            facts.absent if item.name == "forward" else set(facts.init) if item.name == "__init__" else set()
        )
        names = (
            dict.fromkeys(facts.absent)
            if item.name == "forward"
            else facts.init
            if item.name == "__init__"
            else {}
        )
        attrs = facts.attrs if item.name not in ("__init__", "extra_repr") else {}
        r.fold = _Fold(dict(names), attrs)
        out += r.lines[start - 1 : item.lineno - 1]  # decorators
        out += _signature(item, drop, r.lines, 0)
        body = item.body
        if ast.get_docstring(item) is not None:
            out += _docstring(item, drop, r.lines)
            body = body[1:]
        out += r.block(body, 0) or [_indent_of(r.lines[item.lineno - 1]) + "    pass"]
    return _drop_unused_methods(_drop_dead_stores("\n".join(out) + "\n"))


def _drop_unused_methods(source: str) -> str:
    """Remove private methods (``_memory``) that no kept line of the class calls any more."""
    while True:
        klass = ast.parse(source).body[0]
        assert isinstance(klass, ast.ClassDef)
        methods = [f for f in klass.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_")]
        for fn in methods:
            if fn.name.startswith("__"):
                continue
            used = any(
                isinstance(n, ast.Attribute) and n.attr == fn.name and isinstance(n.value, ast.Name)
                for other in klass.body
                if other is not fn
                for n in ast.walk(other)
            )
            if not used:
                lines = source.splitlines()
                first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
                while first > 1 and not lines[first - 2].strip():  # the blank lines before it
                    first -= 1
                source = "\n".join(lines[: first - 1] + lines[fn.end_lineno or fn.lineno :]) + "\n"
                break
        else:
            return source


def _drop_dead_stores(source: str) -> str:
    """Remove one-line assignments, without calls, to local names no kept line reads (``past = 0``)."""
    while True:
        lines = source.splitlines()
        dead: set[int] = set()
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, ast.FunctionDef):
                continue
            loaded = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            for stmt in ast.walk(fn):
                if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
                    continue
                target = stmt.targets[0]
                names = [target] if isinstance(target, ast.Name) else getattr(target, "elts", [])
                stored = [n.id for n in names if isinstance(n, ast.Name)]
                pure = not any(isinstance(n, ast.Call) for n in ast.walk(stmt))
                one_line = stmt.lineno == stmt.end_lineno
                if stored and len(stored) == len(names) and not set(stored) & loaded and pure and one_line:
                    dead.add(stmt.lineno)
        if not dead:
            return source
        source = "\n".join(line for i, line in enumerate(lines, start=1) if i not in dead) + "\n"
