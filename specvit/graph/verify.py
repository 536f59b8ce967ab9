"""Lint an architecture graph: acyclic, one output, every required input wired, every node used.

Failures are SpecErrors naming the node and the spec line it came from.
"""

from __future__ import annotations

import networkx as nx

from specvit.errors import Problem, SpecError
from specvit.graph.ir import ArchGraph

__all__ = ["verify"]


def verify(graph: ArchGraph) -> None:
    """Check the graph's structure and shapes.

    Args:
        graph: the graph to check.

    Raises:
        SpecError: one problem per broken node, each with the node's path and spec location.
    """
    g = graph.nx
    problems: list[Problem] = []

    def fail(node: str, message: str, hint: str = "") -> None:
        attrs = g.nodes[node]
        where = graph.spec.locate(attrs.get("spec_key", "")) if attrs.get("spec_key") else None
        problems.append(Problem(node, message, hint, where))

    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        fail(
            cycle[0][0],
            "the graph has a cycle: " + " -> ".join(u for u, _ in cycle),
            "lowering bug: report it",
        )
    outputs = [n for n, a in g.nodes(data=True) if a["op"] == "output"]
    if len(outputs) != 1:
        raise SpecError.at(
            f"the graph has {len(outputs)} output nodes, not 1", hint="lowering bug: report it"
        )
    reaches_output = nx.ancestors(g, outputs[0]) | {outputs[0]}
    for node, attrs in g.nodes(data=True):
        ports = {d["port"]: u for u, _, d in g.in_edges(node, data=True)}
        op = graph.op(node)
        if node not in reaches_output and attrs["op"] != "input":
            fail(node, "does not lead to the output")
        required = op.requires(attrs["p"])
        if required and not ports:
            fail(node, "has no input")
        for port in required:
            if ports and port not in ports:
                fail(node, f"input '{port}' is not connected")
        for port, src in ports.items():
            got, expected = g.nodes[src]["shape"], attrs["inputs"].get(port)
            if tuple(got) != tuple(expected or ()):
                fail(
                    node,
                    f"input '{port}' from {src} has shape {_fmt(got)}, expected {_fmt(expected or ())}",
                    "the widths of consecutive parts of the spec disagree",
                )
    if problems:
        raise SpecError(problems)


def _fmt(shape: tuple[object, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"
