"""Proof that what is drawn is what is built, read off the running model rather than off the generator.

- :func:`executed_graph`: the data flow the compiled forward executes, traced with ``torch.fx`` (every
  module node a leaf; a stack run a second time recorded as one call), named as the ArchGraph's nodes.
- :func:`differences`: how that graph differs from the ArchGraph, node for node and edge for edge.
- :func:`meta_shapes`: every node's output shape, propagated through the traced graph on the meta device.
- :func:`module_flops`: ``FlopCounterMode``'s FLOPs per module node, for comparison with the graph's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.utils.flop_counter import FlopCounterMode

from specvit.codegen.build import helper_names
from specvit.graph.ir import ArchGraph

__all__ = ["differences", "executed_graph", "meta_shapes", "module_flops", "trace"]


class _Tracer(fx.Tracer):
    """Module nodes are leaves; a scope called a second time (a shared stack) is recorded as one call."""

    def __init__(self, graph: ArchGraph):
        super().__init__(autowrap_functions=tuple(helper_names(graph).values()))
        self.leaves = set(graph.module_nodes())
        self.repeatable = {graph[n]["p"].scope for n in graph if graph[n]["op"] == "call"}
        self.entered: set[str] = set()

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        name = self.path_of_module(m)
        if name in self.repeatable:
            if name in self.entered:
                return self.create_proxy("call_module", name, args, kwargs)
            self.entered.add(name)
        return super().call_module(m, forward, args, kwargs)


def trace(model: nn.Module) -> fx.GraphModule:
    """``model`` (a compiled SpecModel) traced with torch.fx, its module nodes and helpers as leaves."""
    graph: ArchGraph = model.graph  # type: ignore[assignment]
    return fx.GraphModule(model, _Tracer(graph).trace(model))


def _scope_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _names(graph: ArchGraph, gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each traced node -> the ArchGraph node it executes."""
    by_arg = {graph[n]["p"].arg: n for n in graph.placeholders()}
    calls: dict[str, list[str]] = {}  # scope -> the nodes calling it again, in order
    for n in graph:
        if graph[n]["op"] == "call":
            calls.setdefault(graph[n]["p"].scope, []).append(n)
    expressions: dict[str, list[str]] = {}  # scope -> its expression nodes, in order
    for n, a in graph.nx.nodes(data=True):
        if not a["module"] and a["op"] not in ("input", "output", "call"):
            expressions.setdefault(a["scope"], []).append(n)
    seen: Counter[str] = Counter()  # expressions per scope
    called: Counter[str] = Counter()  # calls per scope run again
    out: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            out[node] = by_arg[node.target]
        elif node.op == "call_module":
            again = calls.get(str(node.target), [])
            out[node] = again[called[node.target]] if again else str(node.target)
            called[str(node.target)] += 1
        elif node.op == "call_function":
            scope = _scope_of(node)
            queue = expressions.get(scope, [])
            out[node] = (
                queue[seen[scope]] if seen[scope] < len(queue) else f"<extra {node.target} in {scope!r}>"
            )
            seen[scope] += 1
        elif node.op == "output":
            out[node] = "output"
    return out


def executed_graph(model: nn.Module) -> nx.MultiDiGraph:
    """The data flow ``model``'s forward executes: nodes named as the ArchGraph's, edges between them.

    Edges into module nodes carry their port (the keyword, or ``x`` for the first argument); edges into
    other nodes carry the port ``*`` (their arguments are positional).
    """
    graph: ArchGraph = model.graph  # type: ignore[assignment]
    gm = trace(model)
    names = _names(graph, gm)
    out = nx.MultiDiGraph()
    for node in gm.graph.nodes:
        v = names[node]
        out.add_node(v)
        kwargs = dict(node.kwargs)
        if node.op == "output":
            value = node.args[0]
            kwargs = value if isinstance(value, dict) else {"x": value}
            positional: list[Any] = []
        elif node.op == "call_module":
            positional, kwargs = [], {"x": node.args[0], **kwargs} if node.args else kwargs
        else:
            positional = list(node.args)
        for port, arg in [*(("*", a) for a in positional), *kwargs.items()]:
            if isinstance(arg, fx.Node):
                out.add_edge(names[arg], v, port=port)
    return out


def differences(graph: ArchGraph, executed: nx.MultiDiGraph) -> list[str]:
    """How the executed data flow differs from the ArchGraph (empty when they are the same)."""
    found: list[str] = []
    drawn_nodes, run_nodes = set(graph), set(executed)
    found += [f"drawn, not executed: {n}" for n in sorted(drawn_nodes - run_nodes)]
    found += [f"executed, not drawn: {n}" for n in sorted(run_nodes - drawn_nodes)]

    def edges(g: nx.MultiDiGraph, module: Callable[[str], bool]) -> Counter[tuple[str, str, str]]:
        return Counter((u, v, p if module(v) else "*") for u, v, p in g.edges(data="port"))

    is_module = {n: bool(a["module"]) or a["op"] in ("output", "call") for n, a in graph.nx.nodes(data=True)}
    drawn = edges(graph.nx, lambda v: is_module.get(v, False))
    run = edges(executed, lambda v: is_module.get(v, False))
    found += [f"drawn edge not executed: {u} -> {v} ({p})" for u, v, p in sorted(drawn - run)]
    found += [f"executed edge not drawn: {u} -> {v} ({p})" for u, v, p in sorted(run - drawn)]
    return found


def meta_shapes(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, tuple[int, ...]]:
    """Each traced node's output shape (the first tensor of a tuple), propagated on the meta device.

    Args:
        model: a compiled model, built on the meta device.
        inputs: its forward arguments, on the meta device.
    """
    graph: ArchGraph = model.graph  # type: ignore[assignment]
    gm = trace(model)
    names = _names(graph, gm)
    ShapeProp(gm).propagate(*inputs)
    out: dict[str, tuple[int, ...]] = {}
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        while isinstance(meta, tuple | list) and not isinstance(meta, TensorMetadata) and meta:
            meta = meta[0]  # a tuple of tensors (rotary tables): the first
        if isinstance(meta, TensorMetadata) and node.op != "output":
            out[names[node]] = tuple(meta.shape)
    return out


def module_flops(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """FLOPs ``FlopCounterMode`` attributes to each module node in one forward of ``model`` on ``inputs``."""
    graph: ArchGraph = model.graph  # type: ignore[assignment]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    counts = counter.get_flop_counts()
    prefix = type(model).__name__ + "."
    out = {n: sum(counts.get(prefix + n, {}).values()) for n in graph.module_nodes()}
    for n in graph.module_nodes():  # a shared module's work is counted for its source too: once is enough
        source = getattr(graph[n]["p"], "shared_with", None)
        if source:
            out[source] -= out[n]
    return out
