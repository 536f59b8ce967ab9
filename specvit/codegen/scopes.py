"""Scopes: how the graph's nodes group into the modules whose forwards are generated.

A scope is a module with a generated forward: the model (``""``), each stack (``encoder``), the head
(``head``) and each block (``encoder.blocks.3``); every node names the scope that computes it. Within a
scope the statements are its own nodes and one call per child scope, in dependency order. A value that
enters a scope is a parameter of its forward, named for what it is (``mask``, ``rope``, ``memory``, the
side inputs of the attention layers) so that every block of one kind has the same signature.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field

import networkx as nx

from specvit.graph.ir import ArchGraph
from specvit.ops.base import attr_path

__all__ = ["Scope", "Unit", "analyse", "attr_path", "block_container"]


@dataclass
class Unit:
    """One statement of a scope: an own node, or a call of a child scope.

    Args:
        path: the node's or the child scope's path.
        child: whether it is a child scope.
        reads: the values (node paths) it reads from outside itself, main one first.
        writes: the values it produces that are read outside it, main one first.
    """

    path: str
    child: bool
    reads: list[str]
    writes: list[str]


@dataclass
class Scope:
    """A scope's forward: its parameters, statements and returned values.

    Args:
        path: the scope's path (``""`` for the model).
        params: value -> parameter name, main parameter first.
        units: the statements, in order.
        returns: the values returned, main one first.
        names: value -> variable name inside the forward.
        children: the child scopes, by path.
    """

    path: str
    params: dict[str, str]
    units: list[Unit]
    returns: list[str]
    names: dict[str, str] = field(default_factory=dict)
    children: list[str] = field(default_factory=list)


def block_container(scope: str) -> tuple[str, int] | None:
    """``encoder.stages.1.blocks.3`` -> (``encoder.stages.1.blocks``, 3); None for a scope that is no block."""
    head, _, index = scope.rpartition(".")
    return (head, int(index)) if index.isdigit() and head.endswith("blocks") else None


def _parent(scope: str, scopes: set[str]) -> str:
    parts = scope.split(".")
    for k in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in scopes:
            return candidate
    return ""


def _local(path: str, scope: str) -> str:
    rel = path[len(scope) + 1 :] if scope and path.startswith(scope + ".") else path
    name = rel.replace(".", "_")
    return name if name.isidentifier() and not keyword.iskeyword(name) else f"v_{name}"


def analyse(graph: ArchGraph) -> dict[str, Scope]:
    """Every scope of ``graph``: its parameters, statements in order and returned values."""
    g = graph.nx
    order = {n: i for i, n in enumerate(g)}
    scopes = {a["scope"] for _, a in g.nodes(data=True)} | {""}
    # a stack with blocks is a scope even when it has no node of its own (a feature map's stack)
    scopes |= {a["stack"] for _, a in g.nodes(data=True) if a["block"]}
    parent = {s: _parent(s, scopes) for s in scopes if s}
    members: dict[str, set[str]] = {s: set() for s in scopes}
    for n, a in g.nodes(data=True):
        s = a["scope"]
        while True:
            members[s].add(n)
            if not s:
                break
            s = parent[s]
    out: dict[str, Scope] = {}
    for s in sorted(scopes, key=lambda x: (x.count("."), x)):
        children = sorted(
            (c for c in scopes if c and parent[c] == s), key=lambda c: min(order[n] for n in members[c])
        )
        own = [n for n in members[s] if g.nodes[n]["scope"] == s]
        units = _order(
            g,
            order,
            [Unit(n, False, [], []) for n in own] + [_unit(g, order, c, members[c]) for c in children],
        )
        for u in units:
            if not u.child:
                u.reads = _reads(g, {u.path}, order)
        inside = members[s]
        reads = _reads(g, inside, order)
        writes = [
            n for n in sorted(inside, key=order.__getitem__) if any(v not in inside for v in g.successors(n))
        ]
        writes.sort(key=lambda n: -order[n])  # the last value produced is the main one
        out[s] = Scope(s, {}, units, writes, children=children)
        out[s].params = dict.fromkeys(reads, "")
    for scope in out.values():  # callers first: a scope may name a parameter after its caller's variable
        _name(graph, scope, out, parent)
    return out


def _unit(g: nx.MultiDiGraph, order: dict[str, int], child: str, inside: set[str]) -> Unit:
    writes = [n for n in inside if any(v not in inside for v in g.successors(n))]
    writes.sort(key=lambda n: -order[n])
    return Unit(child, True, _reads(g, inside, order), writes)


def _reads(g: nx.MultiDiGraph, inside: set[str], order: dict[str, int]) -> list[str]:
    """The values read from outside ``inside``: the one on the main port of the earliest node first."""
    seen: dict[str, tuple[int, int]] = {}
    for n in sorted(inside, key=order.__getitem__):
        for u, _, d in g.in_edges(n, data=True):
            if u not in inside and u not in seen:
                seen[u] = (order[n], 0 if d["port"] == "x" else 1)
    return sorted(seen, key=lambda u: seen[u])


def _order(g: nx.MultiDiGraph, order: dict[str, int], units: list[Unit]) -> list[Unit]:
    """Units in dependency order, ties broken by where they start in the graph."""
    owner: dict[str, Unit] = {}
    for u in units:
        for n in u.writes if u.child else [u.path]:
            owner[n] = u
    dag = nx.DiGraph()
    start = {
        id(u): (order[u.path] if not u.child else min(order[n] for n in [*u.writes, *u.reads] if n in order))
        for u in units
    }
    for u in units:
        dag.add_node(id(u))
        for r in u.reads if u.child else [a for a, _ in g.in_edges(u.path)]:
            if r in owner and owner[r] is not u:
                dag.add_edge(id(owner[r]), id(u))
    by_id = {id(u): u for u in units}
    return [by_id[i] for i in nx.lexicographical_topological_sort(dag, key=lambda i: start[i])]


def _param_name(graph: ArchGraph, value: str, into: set[str], stack: str, block: bool) -> str | None:
    """What a value entering a scope (of nodes ``into``, in ``stack``) is called there, or None to use the
    caller's name."""
    g = graph.nx
    a = g.nodes[value]
    sides = a.get("sides", {})
    if stack in sides:
        return str(sides[stack])
    ports = [d["port"] for _, v, d in g.out_edges(value, data=True) if v in into]
    named = [p for p in ports if p != "x"]
    if named:
        return named[0]
    if block:
        return "x"
    if a["op"] == "input":
        return str(a["p"].local or a["p"].arg)
    return None


def _name(graph: ArchGraph, scope: Scope, scopes: dict[str, Scope], parent: dict[str, str]) -> None:
    """Choose the parameter and variable names of one scope (its caller's names are set first)."""
    g = graph.nx
    taken: set[str] = {"self"}
    inside = {n for n in g if _within(g.nodes[n]["scope"], scope.path, parent)}
    block = block_container(scope.path) is not None
    caller = scopes.get(parent.get(scope.path, "")) if scope.path else None
    for value in scope.params:
        main = block and value == next(iter(scope.params))
        name = _param_name(graph, value, inside, scope.path.split(".")[0], main)
        if name is None:
            name = caller.names.get(value, _local(value, "")) if caller is not None else _local(value, "")
        while name in taken:
            name += "_"
        scope.params[value] = name
        scope.names[value] = name
        taken.add(name)
    if not scope.path:  # the model's forward: its arguments are the placeholders
        for n in graph.placeholders():
            scope.names[n] = g.nodes[n]["p"].arg
            taken.add(scope.names[n])
    for u in scope.units:
        if not u.child and g.nodes[u.path]["op"] == "input":
            continue
        if not u.child and g.nodes[u.path]["op"] == "call" and block_container(g.nodes[u.path]["p"].scope):
            scope.names[u.path] = "x"  # a block run again reassigns the tokens, as every block does
            taken.add("x")
        elif not u.child:
            name = _local(u.path, scope.path)
            while name in taken:
                name += "_"
            scope.names[u.path] = name
            taken.add(name)
        elif block_container(u.path) is not None:  # every block reassigns the same names
            for i, w in enumerate(u.writes):
                scope.names[w] = "x" if i == 0 else _local(w, u.path)  # beside the tokens: router_stats
                taken.add(scope.names[w])
        else:
            local = _local(u.path, scope.path)
            for w in u.writes:
                name = _read_as(g.nodes[w], u.path) or (
                    local if len(u.writes) == 1 else f"{local}_{_local(w, u.path)}"
                )
                while name in taken:
                    name += "_"
                scope.names[w] = name
                taken.add(name)


def _read_as(attrs: dict[str, object], producer: str) -> str | None:
    """The name another stack reads a stack's output by (``memory``), if one does."""
    sides = attrs.get("sides", {})
    assert isinstance(sides, dict)
    return next((str(name) for stack, name in sides.items() if stack != producer), None)


def _within(s: str, scope: str, parent: dict[str, str]) -> bool:
    while True:
        if s == scope:
            return True
        if not s:
            return False
        s = parent[s]
