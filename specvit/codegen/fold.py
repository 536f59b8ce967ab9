"""Constant folding of expressions for :mod:`specvit.codegen.specialise`.

:class:`Fold` substitutes what is known about one model (a flag every instance sets alike, a keyword
argument no call passes, a local name assigned a constant once) into an expression and evaluates what
becomes constant: comparisons, ``and``/``or``/``not``, conditional expressions. Flags (booleans, strings,
None, floats) are substituted where they are read; sizes (integers, tuples of them) stay names in the text
and only decide the tests that read them. Calls lose the keyword arguments their callee's default already
says, and names standing for a fast path are renamed to the plain torch call (``Linear`` -> ``nn.Linear``).
"""

from __future__ import annotations

import ast
import builtins
import inspect
import io
import operator
import re
import tokenize
import types
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["UNKNOWN", "Fold", "PlainCall", "is_flag", "unparse"]

UNKNOWN = object()

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}

PlainCall = Callable[[ast.Call], ast.expr]
"""How a fast path's call is written in plain torch: the call in, the expression it becomes out."""

_ARITHMETIC: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Mod: operator.mod,
    ast.FloorDiv: operator.floordiv,
}


def is_flag(value: Any) -> bool:
    """Flags and settings (``True``, ``None``, ``"conv"``, ``1e-6``) are substituted where read; integers
    are sizes, kept as the names a reader expects (``dim``, ``num_heads``)."""
    if isinstance(value, tuple):
        return bool(value) and all(is_flag(v) for v in value)
    return isinstance(value, bool | str | type(None) | float)


def unparse(node: ast.AST) -> str:
    """``ast.unparse`` with the double quotes ruff's formatter writes, and without the parentheses Python
    3.11's puts around the later operands of ``and``/``or`` (``a and b and (c is None)``)."""
    text = ast.unparse(node)
    quirks = any(
        (isinstance(n, ast.BoolOp) and len(n.values) > 2)
        or (isinstance(n, ast.Call) and len(n.args) == 1 and isinstance(n.args[0], ast.GeneratorExp))
        for n in ast.walk(node)
    )
    text = _quotes(_no_redundant_parens(text) if quirks else text)
    return _POWER.sub("**", text) if "**" in text else text


_POWER = re.compile(r"(?<=[\w.])(?<![\w.]\.\.) \*\* (?=-?[\w.]+(?:\b|$)(?![\w.]*[(\[]))")
"""`` ** `` between simple operands (names, numbers, attributes), which ruff's formatter writes ``a**b``."""


def _no_redundant_parens(text: str) -> str:
    """``text`` without parentheses around operands that parse the same without them."""
    try:
        want = ast.dump(ast.parse(text))
    except SyntaxError:
        return text
    start = 0
    while (i := text.find("(", start)) >= 0:
        start = i + 1
        if i and (text[i - 1].isalnum() or text[i - 1] in "_)]"):
            continue  # a call's parentheses
        j = _closing(text, i)
        inside = text[i + 1 : j]
        sole = i and text[i - 1] == "(" and text[j + 1 : j + 2] == ")"  # f((x for x in y)): f(x for x in y)
        if j < 0 or _top_level_comma(inside) or (" for " in inside and not sole):
            continue  # a tuple's, a generator's
        if " and " in inside or " or " in inside:
            continue  # they make the precedence of and/or plain (ruff's RUF021)
        candidate = text[:i] + text[i + 1 : j] + text[j + 1 :]
        try:
            if ast.dump(ast.parse(candidate)) == want:
                text, start = candidate, i
        except SyntaxError:
            continue
    return text


def _top_level_comma(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            return True
    return False


def _closing(text: str, i: int) -> int:
    """The index of the parenthesis closing the one at ``i`` (-1 if none; strings are not looked into)."""
    depth, quote = 0, ""
    for j in range(i, len(text)):
        ch = text[j]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return j
    return -1


def _quotes(text: str) -> str:
    """Strings in double quotes where they hold none."""
    if "'" not in text:
        return text
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    swaps = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type != tokenize.STRING:
            continue
        body = tok.string.lstrip("rbfuRBFU")
        if body.startswith("'") and not body.startswith("'''") and '"' not in body and "\\" not in body:
            at = starts[tok.start[0] - 1] + tok.start[1] + len(tok.string) - len(body)
            swaps += [at, at + len(body) - 1]
    chars = list(text)
    for at in swaps:
        chars[at] = '"'
    return "".join(chars)


def _defaults(obj: Any) -> dict[str, Any]:
    """The keyword defaults of a callable (a class: of its constructor), or {} when unknown."""
    name = getattr(obj, "__name__", "")
    module = getattr(obj, "__module__", "") or ""
    if not (module.startswith(("torch", "specvit")) or isinstance(obj, types.BuiltinFunctionType)):
        return {}
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return _documented_defaults(name, obj.__doc__ or "")
    return {p.name: p.default for p in params if p.default is not p.empty and p.kind is not p.POSITIONAL_ONLY}


def _documented_defaults(name: str, doc: str) -> dict[str, Any]:
    """The literal keyword defaults of a builtin from the signature its docstring opens with
    (``scaled_dot_product_attention(query, key, value, attn_mask=None, ...) -> Tensor``)."""
    start = doc.find(f"{name}(")
    if start < 0 or doc[:start].strip():
        return {}
    depth, end = 0, -1
    for i in range(start + len(name), len(doc)):
        depth += doc[i] == "("
        depth -= doc[i] == ")"
        if depth == 0:
            end = i
            break
    params = doc[start + len(name) : end + 1]
    try:
        fn = ast.parse(f"def _{params}: ...").body[0]
    except SyntaxError:
        try:  # ``zeros(*size, *, out=None, ...)``: a bare * after *size
            fn = ast.parse(f"def _{params.replace(', *,', ',')}: ...").body[0]
        except SyntaxError:
            return {}
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args
    pairs = [*zip(args.args[len(args.args) - len(args.defaults) :], args.defaults, strict=True)]
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
    out = {}
    for arg, default in pairs:
        try:
            out[arg.arg] = ast.literal_eval(default)
        except ValueError:
            continue
    return out


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


class Fold(ast.NodeTransformer):
    """Substitutes what is known in an expression and evaluates what becomes constant.

    Args:
        names: local name -> its value (keyword arguments never passed, constructor arguments, constants).
        attrs: ``self.<name>`` -> its value in every instance.
        module: where the source's names are defined (for callees' defaults and renames).
        renames: name -> the expression text it becomes (``Linear`` -> ``nn.Linear``).
        plain_calls: functions whose call is written otherwise -> the call it becomes
            (``sdpa_layout(x)`` -> ``x``).
        always: names substituted whatever their value (parameters that leave the signature).
    """

    def __init__(
        self,
        names: dict[str, Any],
        attrs: dict[str, Any],
        module: types.ModuleType | None = None,
        renames: dict[str, str] | None = None,
        plain_calls: Mapping[str, PlainCall] | None = None,
        always: frozenset[str] = frozenset(),
    ):
        self.names, self.attrs, self.module = names, attrs, module
        self.renames, self.plain_calls, self.always = renames or {}, plain_calls or {}, always
        self.initial = dict(names)  # the values the names started as
        self.dropped: set[str] = set(always)  # parameters that leave the signature
        self.assigned: set[str] = set()  # names bound on every path to the statement folded
        self.exposed: set[str] = set()  # dropped parameters read where they may be unbound
        self.aliases: dict[str, str] = {}  # a local name -> the name it stands for (``kv_inner = inner``)
        self.bound: dict[str, tuple[list[str], set[str]]] = {}  # method -> its parameters, those folded
        self.functions: dict[str, tuple[list[str], set[str]]] = {}  # helper function -> the same

    def forget(self, stmt: ast.stmt) -> None:
        """A kept statement assigns these names: they are no longer the constants they started as."""
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        for target in targets:
            for node in ast.walk(target) if target is not None else ():
                if isinstance(node, ast.Name):
                    self.names.pop(node.id, None)

    def value(self, node: ast.AST) -> Any:
        """The value of a constant, a known name or a known ``self.<attr>``; else ``UNKNOWN``."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name) and node.id in self.names:
            return self.names[node.id]
        if _is_self(node) and isinstance(node, ast.Attribute) and node.attr in self.attrs:
            return self.attrs[node.attr]
        if isinstance(node, ast.Tuple | ast.List):
            items = [self.value(e) for e in node.elts]
            return UNKNOWN if any(i is UNKNOWN for i in items) else tuple(items)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:  # head_dim % 2, for a check
            a, b = self.value(node.left), self.value(node.right)
            numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
            try:
                return _ARITHMETIC[type(node.op)](a, b) if numbers else UNKNOWN
            except ArithmeticError:
                return UNKNOWN
        return UNKNOWN

    def truth(self, node: ast.AST) -> bool | None:
        """Whether ``node`` is known true or false; None when it depends on the run."""
        value = self.value(node)
        return None if value is UNKNOWN else bool(value)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if not isinstance(node.ctx, ast.Load):
            return node
        if node.id in self.aliases:
            return ast.copy_location(ast.Name(self.aliases[node.id], ast.Load()), node)
        if node.id in self.names and (is_flag(self.names[node.id]) or node.id in self.always):
            return ast.copy_location(ast.Constant(self.names[node.id]), node)
        if node.id in self.dropped and node.id not in self.assigned:
            self.exposed.add(node.id)  # a branch stored it, another left the parameter's value
        if node.id in self.renames and self._resolves(node.id):
            return ast.copy_location(ast.parse(self.renames[node.id], mode="eval").body, node)
        return node

    def _resolves(self, name: str) -> bool:
        """Whether ``name`` is a module-level name of the source (not a local of the same name)."""
        return self.module is None or name in vars(self.module)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        known = _is_self(node) and isinstance(node.ctx, ast.Load) and node.attr in self.attrs
        if known and is_flag(self.attrs[node.attr]):
            return ast.copy_location(ast.Constant(self.attrs[node.attr]), node)
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) != 1 or type(node.ops[0]) not in _OPS:
            return node
        a, b = self.value(node.left), self.value(node.comparators[0])
        if a is UNKNOWN or b is UNKNOWN:
            return node
        try:
            result = _OPS[type(node.ops[0])](a, b)
        except TypeError:
            return node
        return ast.copy_location(ast.Constant(bool(result)), node)

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        """Python's own rule: ``a and b`` is a when a is false, else b (``or`` the other way round); an
        operand known to decide is the result, one known not to is dropped (the last one stays)."""
        self.generic_visit(node)
        is_and = isinstance(node.op, ast.And)
        kept: list[ast.expr] = []
        for k, v in enumerate(node.values):
            truth = self.truth(v)
            if truth is None or k == len(node.values) - 1:
                kept.append(v)
            elif truth != is_and:  # a false operand of `and`, a true one of `or`: the value when reached
                kept.append(v)
                break
        flat = [
            x
            for v in kept
            for x in (v.values if isinstance(v, ast.BoolOp) and type(v.op) is type(node.op) else [v])
        ]
        last = self.truth(flat[-1]) if len(flat) > 1 else None
        if last == is_and and all(_boolean(v) for v in flat[:-1]):
            flat = flat[:-1]  # `a == 1 and True` is `a == 1`: the operands before are booleans
        decided = self.value(flat[-1])
        if (
            len(flat) > 1
            and isinstance(decided, bool)
            and decided != is_and
            and all(map(_boolean, flat[:-1]))
        ):
            return ast.copy_location(ast.Constant(decided), node)  # `a == 1 and False` is False
        if len(flat) == 1:
            return flat[0]
        truth = self.truth(flat[0])
        if truth is not None and truth != is_and:
            return flat[0]
        return ast.copy_location(ast.BoolOp(node.op, flat), node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        truth = self.truth(node.operand)
        if isinstance(node.op, ast.Not) and truth is not None:
            return ast.copy_location(ast.Constant(not truth), node)
        return node

    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        self.generic_visit(node)
        truth = self.truth(node.test)
        if truth is not None:
            return node.body if truth else node.orelse
        return node.body if ast.dump(node.body) == ast.dump(node.orelse) else node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Add | ast.Sub) and _same(self.value(node.right), 0):
            return node.left  # x + 0, x - 0
        if isinstance(node.op, ast.Add) and _same(self.value(node.left), 0):
            return node.right
        return node

    def visit_Slice(self, node: ast.Slice) -> ast.AST:
        self.generic_visit(node)
        if node.lower is not None and _same(self.value(node.lower), 0):
            node.lower = None  # x[0:] is x[:]
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and (plain := self.plain_calls.get(node.func.id)) is not None:
            return ast.copy_location(plain(node), node)
        if (known := self._isinstance(node)) is not None:
            return ast.copy_location(ast.Constant(known), node)
        if _is_self(node.func) and isinstance(node.func, ast.Attribute) and node.func.attr in self.bound:
            params, folded = self.bound[node.func.attr]  # a private method called with constants: dropped
            node.args = [a for i, a in enumerate(node.args) if i >= len(params) or params[i] not in folded]
            node.keywords = [k for k in node.keywords if k.arg not in folded]
        if isinstance(node.func, ast.Name) and node.func.id in self.functions:
            params, folded = self.functions[node.func.id]  # a helper called with constants: dropped
            node.args = [a for i, a in enumerate(node.args) if i >= len(params) or params[i] not in folded]
            node.keywords = [k for k in node.keywords if k.arg not in folded]
        callee = self._callee(node.func)
        defaults = _defaults(callee) if callee is not None else dict.fromkeys(("device", "dtype"))
        node.keywords = [
            k
            for k in node.keywords
            if not (
                k.arg is not None
                and k.arg in defaults
                and isinstance(k.value, ast.Constant)
                and _same(k.value.value, defaults[k.arg])
            )
        ]
        return node

    def _isinstance(self, node: ast.Call) -> bool | None:
        """``isinstance(False, bool)`` (a folded argument) as its value; None when not known."""
        if not (isinstance(node.func, ast.Name) and node.func.id == "isinstance" and len(node.args) == 2):
            return None
        plain = self.module is None and "isinstance" not in self.names  # a helper's names: builtins
        if not (plain or self._callee(node.func) is builtins.isinstance) or node.keywords:
            return None
        value = self.value(node.args[0])
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        types_ = [getattr(builtins, k.id, None) if isinstance(k, ast.Name) else None for k in kinds]
        if value is UNKNOWN or not all(isinstance(t, type) for t in types_):
            return None
        return isinstance(value, tuple(types_))  # type: ignore[arg-type]

    def _callee(self, func: ast.expr) -> Any:
        """The object a call's function names (``nn.Linear``, ``F.scaled_dot_product_attention``), or None."""
        if isinstance(func, ast.Name):
            if func.id in self.names or self.module is None:
                return None
            return vars(self.module).get(func.id, getattr(builtins, func.id, None))
        if isinstance(func, ast.Attribute):
            owner = self._callee(func.value)
            return getattr(owner, func.attr, None) if owner is not None else None
        return None


def _boolean(node: ast.expr) -> bool:
    """Whether ``node`` evaluates to a bool (a comparison, a ``not``, such operands joined)."""
    if isinstance(node, ast.Compare) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)):
        return True
    if isinstance(node, ast.BoolOp):
        return all(_boolean(v) for v in node.values)
    return isinstance(node, ast.Constant) and isinstance(node.value, bool)


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
