"""Python source of the generated forwards: one line per graph node, one loop per run of blocks.

The same text runs inside a compiled model and is what ``specvit eject`` writes: each statement is
``name = self.module(main, port=value, ...)`` for a module node, the op's expression for any other node,
or a call of a child scope; a shape comment follows every tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from specvit.codegen.scopes import Scope, Unit, attr_path, block_container
from specvit.graph.ir import ArchGraph

__all__ = ["Method", "forward_source", "methods", "wrap"]


@dataclass(frozen=True)
class Method:
    """One generated method.

    Args:
        name: ``forward``, ``encode`` or ``decode``.
        source: its text, indented for a class body.
    """

    name: str
    source: str


def _shape(graph: ArchGraph, value: str) -> str:
    shape = graph[value]["shape"]
    return "  # (" + ", ".join(str(d) for d in shape) + ")" if shape else ""


def _call(head: str, main: str, kwargs: list[tuple[str, str]]) -> str:
    args = [main, *(f"{k}={v}" for k, v in kwargs)] if main else [f"{k}={v}" for k, v in kwargs]
    return f"{head}({', '.join(args)})"


def _node(graph: ArchGraph, scope: Scope, path: str) -> str:
    a = graph[path]
    op = graph.op(path)
    args = {d["port"]: scope.names[u] for u, _, d in graph.nx.in_edges(path, data=True)}
    if a["op"] == "output":
        return f"return {op.code(a['p'], args)}"
    if a["module"]:
        rel = path[len(scope.path) + 1 :] if scope.path else path
        main = args.get(op.ports[0], "") if op.ports else ""
        rest = [(port, args[port]) for port in op.ports[1:] if port in args]
        expr = _call(f"self.{attr_path(rel)}", main, rest)
    else:
        expr = op.code(a["p"], args)
    return f"{scope.names[path]} = {expr}{_shape(graph, path)}"


def _child_call(graph: ArchGraph, scope: Scope, child: Scope, unit: Unit, target: str) -> str:
    main, *rest = list(child.params)
    kwargs = [(child.params[v], scope.names[v]) for v in rest]
    outs = ", ".join(scope.names[w] for w in unit.writes)
    return f"{outs} = {_call(target, scope.names[main], kwargs)}{_shape(graph, unit.writes[0])}"


def _runs(graph: ArchGraph, scopes: dict[str, Scope], scope: Scope) -> list[list[Unit]]:
    """The scope's units, consecutive blocks of one container that can run in one loop grouped together, and
    a block with the calls that run it again (shared weights)."""
    runs: list[list[Unit]] = []
    for u in scope.units:
        prev = runs[-1][-1] if runs else None
        if prev is not None and (
            (prev.child and u.child and _continues(scopes, prev, u)) or _again(graph, prev, u)
        ):
            runs[-1].append(u)
        else:
            runs.append([u])
    return runs


def _continues(scopes: dict[str, Scope], prev: Unit, u: Unit) -> bool:
    a, b = block_container(prev.path), block_container(u.path)
    if (
        a is None
        or b is None
        or a[0] != b[0]
        or b[1] != a[1] + 1
        or len(prev.writes) != 1
        or len(u.writes) != 1
    ):
        return False
    pa, pb = scopes[prev.path].params, scopes[u.path].params
    return (
        u.reads[0] == prev.writes[0]
        and u.reads[1:] == prev.reads[1:]
        and list(pa.values()) == list(pb.values())
    )


def _again(graph: ArchGraph, prev: Unit, u: Unit) -> bool:
    """Whether ``u`` runs the block ``prev`` ran (or ran again), on its output, with the same side values."""
    if u.child or graph[u.path]["op"] != "call" or not block_container(scope := graph[u.path]["p"].scope):
        return False
    main = prev.writes[0] if prev.child else prev.path
    if prev.child:
        return prev.path == scope and len(prev.writes) == 1
    edges = {(port, src) for src, _, port in graph.nx.in_edges(u.path, data="port") if port != "x"}
    return (
        graph[prev.path]["op"] == "call"
        and graph[prev.path]["p"].scope == scope
        and edges
        == {(port, src) for src, _, port in graph.nx.in_edges(prev.path, data="port") if port != "x"}
        and any(src == main for src, _ in graph.nx.in_edges(u.path))
    )


def _repeat(graph: ArchGraph, scope: Scope, run: list[Unit]) -> list[str]:
    """A block of shared weights run ``len(run)`` times, as one loop."""
    call = next(u.path for u in run if not u.child)
    args = {port: scope.names[src] for src, _, port in graph.nx.in_edges(call, data="port")}
    first = run[0].reads[0] if run[0].child else args["x"]
    lines = [] if scope.names[first] == "x" else [f"x = {scope.names[first]}"]
    a = graph[call]
    lines.append(f"for _ in range({len(run)}):  # {a['p'].scope}, shared weights")
    lines.append(f"    x = {graph.op(call).code(a['p'], args | {'x': 'x'})}{_shape(graph, run[-1].path)}")
    return lines


def _loop(graph: ArchGraph, scopes: dict[str, Scope], scope: Scope, run: list[Unit]) -> list[str]:
    container, first = block_container(run[0].path)  # type: ignore[misc]
    last = first + len(run) - 1
    size = sum(1 for s in scopes if (c := block_container(s)) is not None and c[0] == container)
    rel = attr_path(container[len(scope.path) + 1 :])
    child = scopes[run[0].path]
    if len(run) == 1:
        return [_child_call(graph, scope, child, run[0], f"self.{rel}[{first}]")]
    lines = []
    start = scope.names[run[0].reads[0]]
    if start != "x":
        lines.append(f"x = {start}")
    window = "" if (first, last) == (0, size - 1) else f"[{first}:{last + 1}]"
    lines.append(f"for block in self.{rel}{window}:  # {container}.{first}-{last}")
    kwargs = [(child.params[v], scope.names[v]) for v in list(child.params)[1:]]
    lines.append("    " + f"x = {_call('block', 'x', kwargs)}{_shape(graph, run[-1].writes[0])}")
    return lines


_TYPES = {"cache": "KVCache", "int": "int"}


def _type(graph: ArchGraph, value: str) -> str:
    """The Python type of a value: ``Tensor``, ``tuple[Tensor, Tensor]`` (rotary tables), ``KVCache``, ``int``."""
    a = graph[value]
    if a["op"] == "input":
        return _TYPES.get(a["p"].dtype, "Tensor")
    return str(graph.op(value).value)


def _param(graph: ArchGraph, name: str, value: str, optional: bool, default: object = None) -> str:
    kind = _type(graph, value)
    if graph[value]["op"] == "input" and default is None:
        default = graph[value]["p"].default  # a model argument keeps its default inside the stacks too
    if not optional:
        return f"{name}: {kind}"
    return f"{name}: {kind} = {default!r}" if default is not None else f"{name}: {kind} | None = None"


def _returns(graph: ArchGraph, scope: Scope) -> str:
    if not scope.path:
        return "dict[str, Tensor]" if graph["output"]["p"].keys else "Tensor"
    kinds = [_type(graph, w) for w in scope.returns]
    return kinds[0] if len(kinds) == 1 else f"tuple[{', '.join(kinds)}]"


def _signature(graph: ArchGraph, scope: Scope) -> str:
    if scope.path:
        (main, name), *rest = scope.params.items()
        params = [_param(graph, name, main, False), *(_param(graph, n, v, True) for v, n in rest)]
        return ", ".join(["self", params[0], *(["*", *params[1:]] if rest else [])])
    positional: list[str] = []
    keyword: list[str] = []
    for n in graph.placeholders():
        p = graph[n]["p"]
        (keyword if p.keyword else positional).append(_param(graph, p.arg, n, not p.required, p.default))
    return ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])


def _body(graph: ArchGraph, scopes: dict[str, Scope], scope: Scope, units: list[Unit]) -> list[str]:
    body: list[str] = []
    for run in _runs(graph, scopes, Scope(scope.path, scope.params, units, scope.returns, scope.names)):
        u = run[0]
        if any(not r.child and graph[r.path]["op"] == "call" for r in run[1:]):
            body += _repeat(graph, scope, run)
        elif not u.child:
            if graph[u.path]["op"] != "input":
                body.append(_node(graph, scope, u.path))
        elif block_container(u.path) is not None:
            body += _loop(graph, scopes, scope, run)
        else:
            rel = u.path[len(scope.path) + 1 :] if scope.path else u.path
            body.append(_child_call(graph, scope, scopes[u.path], u, f"self.{attr_path(rel)}"))
    return body


_WIDTH = 110  # the project's line length, minus the class body's indent


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated parts of an argument list."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def wrap(line: str, indent: str) -> list[str]:
    """``line`` as is when it fits, else its outermost call's arguments one per line (black's style)."""
    if len(indent) + len(line) <= _WIDTH or "(" not in line:
        return [indent + line]
    code, _, comment = line.partition("  # ")
    open_at = code.index("(")
    close_at = code.rindex(")")
    head, args, tail = code[: open_at + 1], code[open_at + 1 : close_at], code[close_at:]
    parts = [f"{indent}    {a}," for a in _split_args(args)]
    return [indent + head, *parts, indent + tail + (f"  # {comment}" if comment else "")]


def _method(name: str, signature: str, body: list[str]) -> Method:
    """A method from its signature (``self, x: Tensor) -> Tensor``) and body lines."""
    lines = wrap(f"def {name}({signature}:", "    ")
    for line in body:
        indent = "        " + " " * (len(line) - len(line.lstrip()))
        lines += wrap(line.lstrip(), indent)
    return Method(name, "\n".join(lines))


def forward_source(graph: ArchGraph, scopes: dict[str, Scope], scope: Scope) -> str:
    """The ``forward`` of one scope, as source text indented for a class body."""
    body = _body(graph, scopes, scope, scope.units)
    if scope.path:
        body.append("return " + ", ".join(scope.names[w] for w in scope.returns))
    return _method("forward", f"{_signature(graph, scope)}) -> {_returns(graph, scope)}", body).source


def _split(graph: ArchGraph, scopes: dict[str, Scope], scope: Scope) -> list[Method]:
    """An encoder-decoder's ``encode`` (the statements up to the encoder's) and ``decode`` (the rest).

    ``decode`` takes the decoder's inputs first, then the encoder's outputs (``memory``), then the optional
    arguments it reads, with their defaults.
    """
    cut = next(i for i, u in enumerate(scope.units) if u.path == "encoder") + 1
    encode, decode = (
        scope.units[:cut],
        [u for u in scope.units[cut:] if graph.nx.nodes.get(u.path, {}).get("op") != "input"],
    )
    written = {w for u in encode if u.child for w in u.writes}
    placeholders = graph.placeholders()

    def params(units: list[Unit], extra: list[str]) -> str:
        read = {r for u in units for r in (u.reads if u.child else [a for a, _ in graph.nx.in_edges(u.path)])}
        args = [n for n in placeholders if n in read]
        p = {n: graph[n]["p"] for n in args}
        required = [_param(graph, p[n].arg, n, False) for n in args if p[n].required]
        optional = [
            _param(graph, p[n].arg, n, True, p[n].default)
            for n in args
            if not p[n].required and not p[n].keyword
        ]
        keyword = [_param(graph, p[n].arg, n, True, p[n].default) for n in args if p[n].keyword]
        memory = [_param(graph, scope.names[w], w, False) for w in extra if w in read]
        return ", ".join(["self", *required, *memory, *optional, *(["*", *keyword] if keyword else [])])

    writes = next(u for u in encode if u.path == "encoder").writes
    outs = ", ".join(scope.names[w] for w in writes)
    encoded = (
        _type(graph, writes[0])
        if len(writes) == 1
        else f"tuple[{', '.join(_type(graph, w) for w in writes)}]"
    )
    return [
        _method(
            "encode",
            f"{params(encode, [])}) -> {encoded}",
            [*_body(graph, scopes, scope, encode), f"return {outs}"],
        ),
        _method(
            "decode",
            f"{params(decode, sorted(written))}) -> {_returns(graph, scope)}",
            _body(graph, scopes, scope, decode),
        ),
    ]


def methods(graph: ArchGraph, scopes: dict[str, Scope], scope: Scope) -> list[Method]:
    """The generated methods of one scope's class: ``forward``, and an encoder-decoder's ``encode``/``decode``."""
    out = [Method("forward", forward_source(graph, scopes, scope))]
    if not scope.path and {"encoder", "decoder"} <= set(scopes):
        out += _split(graph, scopes, scope)
    return out
