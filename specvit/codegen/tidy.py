"""Tidying specialised source (:mod:`specvit.codegen.specialise`): what folding leaves behind goes.

Local stores nothing reads (``past = 0`` once ``past`` is folded), private methods nothing calls, attributes
nothing reads (``self.causal = True`` once every ``self.causal`` is folded), constructor parameters the body
no longer reads. Lines are split and joined as ruff's formatter writes them by :mod:`specvit.codegen.lines`.
"""

from __future__ import annotations

import ast
import itertools

from specvit.codegen.fold import unparse
from specvit.codegen.lines import WIDTH, rejoin, split_line

__all__ = [
    "dead_attributes",
    "docstring",
    "drop_attributes",
    "drop_unused_params",
    "signature",
    "tidy_class",
    "tidy_function",
]


def _drop_unused_methods(source: str, keep: frozenset[str]) -> str:
    """Remove private methods (``_memory``) that no kept line of the class calls any more."""
    while True:
        klass = ast.parse(source).body[0]
        assert isinstance(klass, ast.ClassDef)
        read = {n.attr for n in ast.walk(klass) if isinstance(n, ast.Attribute)}
        methods = [f for f in klass.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_")]
        for fn in methods:
            if fn.name.startswith("__") or fn.name in read or fn.name in keep:
                continue
            used = any(  # by another method (a method reading itself does not keep it)
                isinstance(n, ast.Attribute) and n.attr == fn.name
                for other in klass.body
                if other is not fn
                for n in ast.walk(other)
            )
            if not used:
                source = _cut(source, min([fn.lineno, *(d.lineno for d in fn.decorator_list)]), fn.end_lineno)
                break
        else:
            return source


def _cut(source: str, first: int, last: int | None) -> str:
    """``source`` without lines first..last (1-based) and the blank lines before them."""
    lines = source.splitlines()
    while first > 1 and not lines[first - 2].strip():
        first -= 1
    return "\n".join(lines[: first - 1] + lines[last or first :]) + "\n"


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
            dead |= _overwritten(fn)
        if not dead:
            return source
        source = "\n".join(line for i, line in enumerate(lines, start=1) if i not in dead) + "\n"


def _plain_attribute_stores(source: str) -> str:
    """``self.act: nn.Module = nn.GELU()`` as ``self.act = nn.GELU()``: the annotation served the branches a
    specialised class no longer has."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        t = getattr(node, "target", None)
        on_self = isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        if isinstance(node, ast.AnnAssign) and node.value is not None and on_self:
            assert isinstance(t, ast.Attribute)
            if node.value.lineno == node.lineno:
                line = lines[node.lineno - 1]
                head = line[: node.col_offset] + f"self.{t.attr} = "
                lines[node.lineno - 1] = head + line[node.value.col_offset :]
    return rejoin("\n".join(lines) + "\n")


def _ternaries(source: str) -> str:
    """``if c: x = a`` / ``else: x = b`` (what folding an ``elif`` away may leave) as ``x = a if c else b`` when
    that fits on a line, as ruff's SIM108 asks."""
    while True:
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.If) and len(node.body) == 1 and len(node.orelse) == 1):
                continue
            a, b = node.body[0], node.orelse[0]
            if not (
                isinstance(a, ast.Assign)
                and isinstance(b, ast.Assign)
                and len(a.targets) == len(b.targets) == 1
            ):
                continue
            target = ast.unparse(a.targets[0])
            if target != ast.unparse(b.targets[0]) or not isinstance(a.targets[0], ast.Name):
                continue
            if lines[node.lineno - 1].lstrip().startswith("elif"):
                continue
            indent = lines[node.lineno - 1][: node.col_offset]
            test, body, orelse = (unparse(n) for n in (node.test, a.value, b.value))
            line = f"{indent}{target} = {body} if {test} else {orelse}"
            if len(line) > WIDTH or (b.end_lineno or b.lineno) - node.lineno != 3:
                continue
            source = "\n".join([*lines[: node.lineno - 1], line, *lines[b.end_lineno or b.lineno :]]) + "\n"
            break
        else:
            return source


def _parallel(source: str) -> str:
    """Parallel assignments (``h, (qh, qw), groups = self.num_heads, self._extent, ...``) without the items
    whose names nothing reads any more; unread names in a nested unpacking become ``_``."""
    tree = ast.parse(source)
    lines = source.splitlines()
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        loaded = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        for stmt in ast.walk(fn):
            if not (
                isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and stmt.lineno == stmt.end_lineno
            ):
                continue
            t, v = stmt.targets[0], stmt.value
            if isinstance(t, ast.Tuple) and not isinstance(v, ast.Tuple):  # b, n, _ = x.shape: unread n is _
                blank = _blank_unread(t, loaded)
                names = {n.id for n in ast.walk(t) if isinstance(n, ast.Name)} - {"_"}
                if ast.dump(blank) != ast.dump(t) and names & loaded:
                    line = lines[stmt.lineno - 1]
                    text = unparse(blank)
                    text = (
                        text[1:-1]
                        if text.startswith("(") and not line[t.col_offset :].startswith("(")
                        else text
                    )
                    lines[stmt.lineno - 1] = line[: t.col_offset] + text + line[t.end_col_offset :]
                continue
            if not (isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts)):
                continue
            pairs = []
            for target, value in zip(t.elts, v.elts, strict=True):
                names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                if names & loaded or any(isinstance(n, ast.Call) for n in ast.walk(value)):
                    pairs.append((_blank_unread(target, loaded), value))
            if len(pairs) == len(t.elts) and all(a is b for (a, _), b in zip(pairs, t.elts, strict=True)):
                continue
            line = lines[stmt.lineno - 1]
            comment = line[stmt.end_col_offset :]
            if not pairs:
                text = ""
            elif len(pairs) == 1:
                left = unparse(pairs[0][0])
                left = left[1:-1] if isinstance(pairs[0][0], ast.Tuple) and left.startswith("(") else left
                text = f"{left} = {unparse(pairs[0][1])}"
            else:
                text = (
                    ", ".join(unparse(a) for a, _ in pairs) + " = " + ", ".join(unparse(b) for _, b in pairs)
                )
            lines[stmt.lineno - 1] = (line[: stmt.col_offset] + text + comment) if text else "\0"
    return "\n".join(line for line in lines if line != "\0") + "\n"


def _blank_unread(target: ast.expr, loaded: set[str]) -> ast.expr:
    """``target`` with its names nothing reads replaced by ``_`` (when it is a nested unpacking)."""
    if isinstance(target, ast.Tuple):
        return ast.Tuple([_blank_unread(e, loaded) for e in target.elts], ast.Store())
    if isinstance(target, ast.Name) and target.id not in loaded:
        return ast.Name("_", ast.Store())
    return target


def _overwritten(fn: ast.FunctionDef) -> set[int]:
    """Lines of one-line stores to a name (without calls) that the next statement stores again without
    reading it (``visible = None`` right before ``visible = self._visible(...)``)."""
    out = set()
    for block in (getattr(n, f, None) for n in ast.walk(fn) for f in ("body", "orelse")):
        if not isinstance(block, list):
            continue
        for a, b in itertools.pairwise(block):
            if not (isinstance(a, ast.Assign) and isinstance(b, ast.Assign) and len(a.targets) == 1):
                continue
            name = a.targets[0]
            if not isinstance(name, ast.Name) or a.lineno != a.end_lineno:
                continue
            pure = not any(isinstance(n, ast.Call) for n in ast.walk(a.value))
            again = len(b.targets) == 1 and isinstance(b.targets[0], ast.Name) and b.targets[0].id == name.id
            reads = any(isinstance(n, ast.Name) and n.id == name.id for n in ast.walk(b.value))
            if pure and again and not reads:
                out.add(a.lineno)
    return out


def tidy_function(source: str) -> str:
    """A specialised function without dead local stores."""
    return _drop_dead_stores(_parallel(_ternaries(source)))


def tidy_class(source: str, keep: frozenset[str] = frozenset()) -> str:
    """A specialised class without dead local stores and private methods nothing calls (but ``keep``)."""
    source = _ternaries(_plain_attribute_stores(source))
    return _drop_unused_methods(_drop_dead_stores(_parallel(source)), keep)


def dead_attributes(sources: list[str]) -> set[str]:
    """Attribute names that some ``__init__`` of ``sources`` sets to a value without calls and that no
    source reads (as an attribute, or a string that may name one: ``getattr(self, "cls_token")``)."""
    set_, read = set(), set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
                read.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                read.add(node.value)
            elif isinstance(node, ast.FunctionDef) and node.name == "__init__":
                set_ |= {a for a, _ in _attribute_stores(node)}
    return set_ - read


def _attribute_stores(fn: ast.FunctionDef) -> list[tuple[str, ast.Assign | ast.AnnAssign]]:
    """The ``self.name = value`` statements of ``fn`` whose value calls nothing, and the items of parallel
    stores (``self.dim, self.base = dim, base``), each with its statement."""
    out: list[tuple[str, ast.Assign | ast.AnnAssign]] = []
    for stmt in ast.walk(fn):
        if not isinstance(stmt, ast.Assign | ast.AnnAssign):
            continue
        if isinstance(stmt, ast.Assign) and len(stmt.targets) != 1:
            continue
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
        for t, value in _pairs(target, stmt.value):
            plain = value is not None and not any(isinstance(n, ast.Call) for n in ast.walk(value))
            if isinstance(t, ast.Attribute) and _is_self_name(t.value) and plain:
                out.append((t.attr, stmt))
    return out


def _pairs(target: ast.expr, value: ast.expr | None) -> list[tuple[ast.expr, ast.expr | None]]:
    """A store's (target, value) pairs: one, or each item of ``a, b = x, y``."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return list(zip(target.elts, value.elts, strict=True))
    return [(target, value)]


def drop_attributes(source: str, dead: set[str]) -> str:
    """``source`` without the stores of attributes ``dead`` in its ``__init__`` methods (a parallel store
    keeps its other items, on one line if they fit)."""
    lines = source.splitlines()
    stores = {
        id(stmt): stmt
        for fn in ast.walk(ast.parse(source))
        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__"
        for name, stmt in _attribute_stores(fn)
        if name in dead
    }
    for stmt in sorted(stores.values(), key=lambda s: -s.lineno):
        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
        kept = [
            (ast.get_source_segment(source, t) or "", ast.get_source_segment(source, v) if v else "")
            for t, v in _pairs(target, stmt.value)
            if not (isinstance(t, ast.Attribute) and _is_self_name(t.value) and t.attr in dead)
        ]
        if any("\n" in t + (v or "") for t, v in kept):
            continue  # an item over lines: the store stays as it is
        indent, comment = lines[first - 1][: stmt.col_offset], lines[last - 1][stmt.end_col_offset or 0 :]
        targets, values = ", ".join(t for t, _ in kept), ", ".join(v or "" for _, v in kept)
        new = split_line(f"{targets} = {values}", indent, comment) if kept else []
        lines[first - 1 : last] = new  # self.dim, self.start = dim, start; or one item: self.dim = dim
    return "\n".join(lines) + "\n"


def _is_self_name(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _param(arg: ast.arg, default: ast.expr | None) -> str:
    """One parameter as ruff writes it: ``x: int = 0``, ``x=0`` without an annotation."""
    if default is None:
        return unparse(arg)
    return f"{unparse(arg)} = {unparse(default)}" if arg.annotation else f"{arg.arg}={unparse(default)}"


def signature(fn: ast.FunctionDef, drop: set[str], lines: list[str], indent: int) -> list[str]:
    """The ``def`` line of ``fn`` (whose text is ``lines``) without the parameters ``drop``, dedented by
    ``indent``: one line if it fits, else one parameter a line."""
    args = fn.args
    defaults: list[ast.expr | None] = [None] * (len(args.args) - len(args.defaults))
    defaults += list(args.defaults)
    parts = [_param(a, d) for a, d in zip(args.args, defaults, strict=True) if a.arg not in drop]
    kw = [_param(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if a.arg not in drop]
    if args.vararg is not None:
        parts.append(f"*{unparse(args.vararg)}")
    if kw:
        parts += kw if args.vararg is not None else ["*", *kw]
    if args.kwarg is not None:
        parts.append(f"**{unparse(args.kwarg)}")
    returns = f" -> {unparse(fn.returns)}" if fn.returns is not None else ""
    line = lines[fn.lineno - 1]
    pad = line[: len(line) - len(line.lstrip())][indent:]
    one = f"{pad}def {fn.name}({', '.join(parts)}){returns}:"
    if len(one) <= WIDTH:
        return [one]
    return [f"{pad}def {fn.name}(", *(f"{pad}    {p}," for p in parts), f"{pad}){returns}:"]


def drop_unused_params(source: str) -> str:
    """A class's ``__init__`` without the parameters its body no longer reads (and their ``Args:`` lines)."""
    klass = ast.parse(source).body[0]
    if not isinstance(klass, ast.ClassDef):
        return source
    init = next((f for f in klass.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None:
        return source
    loaded = {n.id for s in init.body for n in ast.walk(s) if isinstance(n, ast.Name)}
    unused = {a.arg for a in [*init.args.args[1:], *init.args.kwonlyargs] if a.arg not in loaded}
    if not unused:
        return source
    lines = source.splitlines()
    docs = [d for d in (klass.body[0], init.body[0]) if _is_docstring(d)]
    for doc in sorted(docs, key=lambda d: -d.lineno):  # the Args: entries, last docstring first
        first, last = doc.lineno, doc.end_lineno or doc.lineno
        lines[first - 1 : last] = _drop_arg_docs(lines[first - 1 : last], unused)
    out = ast.parse("\n".join(lines) + "\n").body[0]
    assert isinstance(out, ast.ClassDef)
    init = next(f for f in out.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    head = signature(init, unused, lines, 0)
    return "\n".join(lines[: init.lineno - 1] + head + lines[init.body[0].lineno - 1 :]) + "\n"


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _drop_arg_docs(lines: list[str], names: set[str]) -> list[str]:
    """Docstring ``lines`` without the ``name: ...`` entries (and their continuation lines) of ``names``."""
    out: list[str] = []
    skipping, depth = False, 0
    for line in lines:
        stripped = line.strip()
        key = stripped.split(":", 1)[0]
        if ":" in stripped and key in names:
            skipping, depth = True, len(line) - len(line.lstrip())
            continue
        if skipping and stripped and len(line) - len(line.lstrip()) > depth:
            continue
        skipping = False
        out.append(line)
    return out


def docstring(node: ast.FunctionDef | ast.ClassDef, drop: set[str], lines: list[str]) -> list[str]:
    """``node``'s docstring lines without the ``Args:`` entries of the parameters ``drop``."""
    first = node.body[0]
    out: list[str] = []
    skipping, depth = False, 0
    for line in lines[first.lineno - 1 : first.end_lineno]:
        name = line.strip().split(":", 1)[0]
        if ":" in line and name in drop:
            skipping, depth = True, _indent(line)
            continue
        if skipping and line.strip() and _indent(line) > depth:
            continue
        skipping = False
        out.append(line)
    return _empty_sections(out)


def _empty_sections(doc: list[str]) -> list[str]:
    """Docstring lines without an ``Args:`` header that no entry follows any more (and its blank line)."""
    for i, line in enumerate(doc):
        if line.strip() == "Args:":
            rest = [x.strip() for x in doc[i + 1 :]]
            if all(x in ("", '"""') for x in rest):
                before = doc[: i - 1] if i and not doc[i - 1].strip() else doc[:i]
                doc = [*before, *doc[i + 1 :]]
                break
    if len(doc) == 2 and doc[1].strip() == '"""' and doc[0].rstrip().endswith(tuple(".:)")):
        return [doc[0].rstrip() + '"""']  # a docstring of one line
    return doc


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
