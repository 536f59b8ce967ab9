"""The helper functions of an ejected file, specialised to their calls.

A helper the layer classes call (``head_norm``, ``rope_tables``) serves every model; in one file every call
may pass a parameter the same constant (``head_norm(None, ...)``: no QK-norm; ``rope_tables(..., "half")``).
Such a parameter is folded into the function, which then keeps only the branches taken (and may stop
needing other helpers: ``make_norm``, ``Norm``), and the argument leaves every call. Helpers the generated
forwards call, or that are used other than by calling them, are left as they are.
"""

from __future__ import annotations

import ast
from typing import Any

from specvit.codegen.fold import Fold, is_flag
from specvit.codegen.specialise import Facts, Renderer, docstring, single_names, specialise_source
from specvit.codegen.tidy import signature, tidy_function

__all__ = ["reachable", "specialise_helpers"]

_MISSING = object()


def _function(source: str) -> ast.FunctionDef | None:
    node = ast.parse(source).body[0]
    return node if isinstance(node, ast.FunctionDef) else None


def _passed(fn: ast.FunctionDef, call: ast.Call) -> dict[str, Any] | None:
    """What a call passes each parameter of ``fn``: a constant, ``_MISSING`` when not a constant; None when
    the call unpacks ``*args`` (its arguments cannot be matched to the parameters)."""
    if any(isinstance(a, ast.Starred) for a in call.args):
        return None
    positional = [a.arg for a in fn.args.args]
    given: dict[str, ast.expr] = dict(zip(positional, call.args, strict=False))
    given |= {k.arg: k.value for k in call.keywords if k.arg is not None}
    spread = any(k.arg is None for k in call.keywords)  # **kwargs: what it holds is not known
    defaults = dict(zip(positional[len(positional) - len(fn.args.defaults) :], fn.args.defaults, strict=True))
    defaults |= {
        a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True) if d is not None
    }
    out: dict[str, Any] = {}
    for name in [*positional, *(a.arg for a in fn.args.kwonlyargs)]:
        node = given.get(name, None if spread else defaults.get(name))
        out[name] = node.value if isinstance(node, ast.Constant) else _MISSING
    return out


def _sites(sources: list[str]) -> tuple[dict[str, list[ast.Call]], set[str]]:
    """Every call of a plain name in ``sources``, by the name; and the names used otherwise than called."""
    calls: dict[str, list[ast.Call]] = {}
    called_ids: set[int] = set()
    names: list[ast.Name] = []
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                calls.setdefault(node.func.id, []).append(node)
                called_ids.add(id(node.func))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                names.append(node)
    return calls, {n.id for n in names if id(n) not in called_ids}


def _folds(definitions: list[str], others: list[str], protected: set[str]) -> dict[str, dict[str, Any]]:
    """Helper -> its parameters every call passes the same constant, and that constant."""
    calls, used = _sites([*definitions, *others])
    out = {}
    for source in definitions:
        fn = _function(source)
        if fn is None or fn.name in protected or fn.name in used or fn.args.vararg or fn.args.kwarg:
            continue
        passed = [_passed(fn, c) for c in calls.get(fn.name, [])]
        if not passed or any(p is None for p in passed):
            continue
        first = passed[0]
        assert first is not None
        same = {
            k: v
            for k, v in first.items()
            if v is not _MISSING and is_flag(v) and all(p is not None and _same(p[k], v) for p in passed)
        }
        if same:
            out[fn.name] = same
    return out


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def specialise_function(
    source: str, folded: dict[str, Any], calls: dict[str, tuple[list[str], set[str]]]
) -> str:
    """A module-level function's source with the parameters ``folded`` substituted and dropped, the calls of
    ``calls`` without their folded arguments."""
    fn = _function(source)
    assert fn is not None
    r = Renderer(source, Facts({}, {}, {}))
    r.fold = Fold(dict(folded), {}, always=frozenset(folded))
    r.fold.functions, r.single = calls, single_names(fn)
    start = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    out = [*r.lines[start - 1 : fn.lineno - 1], *signature(fn, set(folded), r.lines, 0)]
    body = fn.body
    if ast.get_docstring(fn) is not None:
        out += docstring(fn, set(folded), r.lines)
        body = body[1:]
    lines = r.block(body, 0)
    out += [*r.initialisers("    "), *lines] if lines else ["    pass"]
    return tidy_function("\n".join(out) + "\n")


def specialise_helpers(
    definitions: list[str], classes: list[str], others: list[str], protected: set[str], keep: frozenset[str]
) -> tuple[list[str], list[str]]:
    """The definitions and the layer classes with every helper specialised to its calls, until none changes.

    Args:
        definitions: the helper functions, constants and classes the file defines.
        classes: the layer classes' sources.
        others: sources that call helpers but are left as they are (the generated forwards' helpers).
        protected: helpers to leave as they are.
        keep: private methods other code calls (kept whole in the classes rewritten).
    """
    _, used_by_others = _sites(others)
    calls_by_others, _ = _sites(others)
    frozen = protected | used_by_others | set(calls_by_others)
    for _ in range(6):
        folds = _folds(definitions, classes, frozen)
        if not folds:
            break
        params = {
            fn.name: [a.arg for a in [*fn.args.args, *fn.args.kwonlyargs]]
            for d in definitions
            if (fn := _function(d)) is not None and fn.name in folds
        }
        calls = {name: (params[name], set(folds[name])) for name in folds}
        facts = Facts({}, {}, {}, keep=keep, functions=calls)
        definitions = [_rewrite(source, folds, calls, facts) for source in definitions]
        classes = [specialise_source(source, facts) for source in classes]
    return definitions, classes


def _rewrite(
    source: str, folds: dict[str, dict[str, Any]], calls: dict[str, tuple[list[str], set[str]]], facts: Facts
) -> str:
    """One definition with the folds applied: a helper's own parameters, the arguments of its calls."""
    fn = _function(source)
    if fn is not None:
        return specialise_function(source, folds.get(fn.name, {}), calls)
    return specialise_source(source, facts) if source.startswith("class ") else source


def _defined(source: str) -> str:
    node = ast.parse(source).body[0]
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        return node.name
    return ast.unparse(getattr(node, "targets", [node])[0])


def reachable(definitions: list[str], roots: list[str]) -> list[str]:
    """The definitions some root source needs, directly or through other definitions, in their order."""
    by_name = {_defined(d): d for d in definitions}
    seen: set[str] = set()
    todo = [n.id for r in roots for n in ast.walk(ast.parse(r)) if isinstance(n, ast.Name)]
    while todo:
        name = todo.pop()
        if name in by_name and name not in seen:
            seen.add(name)
            todo += [n.id for n in ast.walk(ast.parse(by_name[name])) if isinstance(n, ast.Name)]
    return [d for d in definitions if _defined(d) in seen]
