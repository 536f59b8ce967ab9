"""What a diagram shows, whatever language draws it: :func:`plan` reads an
:class:`~specvit.graph.ir.ArchGraph` into a :class:`Scene`: the boxes to draw with their label lines and
colour category, the clusters (stacks, blocks, head) and the edges. In the collapsed view a run of repeated
blocks (:meth:`ArchGraph.fold`) is drawn once, its edges entering the first block and leaving the last, and
a block whose weights later layers share is drawn once with the number of its runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from specvit.graph.ir import ArchGraph, Fold, Shape
from specvit.units import FLOPS, FlopUnit, format_flops, format_params, format_sizes

__all__ = ["CATEGORIES", "Box", "Cluster", "Link", "Scene", "View", "format_shape", "plan", "subtitle"]

View = Literal["collapsed", "expanded"]
LinkKind = Literal["flow", "residual", "memory"]

CATEGORIES: dict[str, tuple[str, str, str]] = {
    "attention": ("#fbd9bd", "#d9742b", "attention"),
    "mlp": ("#d3ecd1", "#3f8f3f", "MLP"),
    "norm": ("#fff1a8", "#b89b00", "norm / layer scale"),
    "embedding": ("#d6e2f5", "#3d66ad", "embedding / position"),
    "structural": ("#ececec", "#808080", "input / output / add / dropout"),
    "head": ("#e8d5f0", "#8346a0", "head"),
}
"""Colour category -> (fill, border, legend text): the fixed palette, in legend order."""


@dataclass(frozen=True)
class Box:
    """One drawn node.

    Args:
        id: the graph path it stands for (in the collapsed view, the node of its run's first block).
        op: the op kind, the first line of its label.
        category: its colour category, a key of :data:`CATEGORIES`.
        details: key hyperparameters, one short line each.
        shape: the output shape, ``"B x 197 x 768"``.
        params: the parameter count, ``"2.4M params"``, or empty for none.
    """

    id: str
    op: str
    category: str
    details: tuple[str, ...]
    shape: str
    params: str


@dataclass
class Cluster:
    """A group drawn together: a stack, a block (or a run of identical blocks drawn once) or the head.

    Args:
        id: a unique name: the stack or block path.
        title: the caption, ``"encoder.blocks.0-11  x12"``.
        note: a second, smaller caption line (parameters), or empty.
        kind: ``stack``, ``block`` (one block), ``folded`` (a run of blocks drawn once) or ``head``.
        members: the ids of the boxes and the clusters directly inside, in execution order.
    """

    id: str
    title: str
    note: str
    kind: str
    members: list[str | Cluster] = field(default_factory=list)


@dataclass(frozen=True)
class Link:
    """A drawn edge.

    Args:
        src: the box it leaves.
        dst: the box it enters.
        kind: ``flow`` (the main path), ``residual`` (the skip into an add) or ``memory`` (the
            encoder output into a cross-attention).
    """

    src: str
    dst: str
    kind: LinkKind


@dataclass(frozen=True)
class Scene:
    """Everything a diagram shows, whatever language draws it.

    Args:
        title: the spec name.
        subtitle: total parameters and FLOPs (their unit defined, and the useful part where a mask hides some
            attention pairs), and the sizes the FLOPs were counted at.
        boxes: the drawn nodes by id, in execution order.
        members: the top-level clusters (stacks and head) and any box outside them, in execution order.
        links: the drawn edges, each once, in execution order.
    """

    title: str
    subtitle: str
    boxes: dict[str, Box]
    members: list[str | Cluster]
    links: list[Link]

    @property
    def categories(self) -> list[str]:
        """The colour categories in use, in palette order."""
        used = {b.category for b in self.boxes.values()}
        return [c for c in CATEGORIES if c in used]


def format_shape(shape: Shape) -> str:
    """``("B", 197, 768)`` -> ``"B x 197 x 768"``.

    Args:
        shape: a node's output shape, symbolic dims as strings.
    """
    return " x ".join(str(d) for d in shape)


def _category(op_category: str, stack: str) -> str:
    """The colour category of a node: its op's, with the head's own colour for what is not structural."""
    if op_category == "position":
        return "embedding"
    if stack == "head" and op_category not in ("structural", "norm"):
        return "head"
    return op_category if op_category in CATEGORIES else "structural"


def _params(n: int) -> str:
    """``"2.4M params"``, or empty for none."""
    return f"{format_params(n)} params" if n else ""


def subtitle(graph: ArchGraph, unit: FlopUnit = FLOPS) -> str:
    """``124.4M params · 32.2G FLOPs (2 x MACs; useful 31.9G) at B=1, S=128``: a diagram's totals.

    Args:
        graph: the lowered spec.
        unit: what its FLOPs are printed in.
    """
    flops = format_flops(graph.total_flops, unit, useful=graph.total_useful_flops, define=True)
    return f"{format_params(graph.total_params)} params · {flops} at {format_sizes(graph.dims)}"


def plan(graph: ArchGraph, view: View = "collapsed", unit: FlopUnit = FLOPS) -> Scene:
    """What a diagram of ``graph`` shows.

    Args:
        graph: the lowered spec.
        view: ``collapsed`` draws each run of identical blocks once, as one cluster with its repeat
            count; ``expanded`` draws every block.
        unit: what the subtitle's FLOPs are printed in.

    Returns:
        The scene: boxes, nested clusters and edges.
    """
    if view not in ("collapsed", "expanded"):
        raise ValueError(f"view must be 'collapsed' or 'expanded', not {view!r}")
    g = graph.nx
    fold = graph.fold() if view == "collapsed" else {}
    shared = graph.shared() if view == "collapsed" else {}
    again = _reruns(graph, shared)

    def drawn(path: str) -> str:
        """The box standing for ``path``: its counterpart in the representative block of its run."""
        if path in again:
            return again[path]
        block = g.nodes[path]["block"]
        if block in fold and fold[block].rep != block:
            return fold[block].rep + path[len(block) :]
        return path

    params: dict[str, int] = {}
    for _, a in g.nodes(data=True):
        for key in (a["stack"], a["block"]):
            if key:
                params[key] = params.get(key, 0) + int(a["params"])

    boxes: dict[str, Box] = {}
    clusters: dict[str, Cluster] = {}
    top: list[str | Cluster] = []
    for path, a in g.nodes(data=True):
        if drawn(path) != path:
            continue
        op, stack, block = graph.op(path), a["stack"], a["block"]
        boxes[path] = Box(
            path,
            a["op"],
            _category(op.category, stack),
            tuple(line for line in op.label(a["p"]) if line),
            format_shape(a["shape"]),
            _params(a["params"]),
        )
        members = top
        if stack:
            if stack not in clusters:
                role = "head" if stack == "head" else "stack"
                clusters[stack] = Cluster(stack, stack, _params(params[stack]), role)
                top.append(clusters[stack])
            members = clusters[stack].members
        if block is not None:
            if block not in clusters:
                if block in fold:
                    note = f"{_params(params[block])} per block"
                    label = f"{fold[block].label}  x{fold[block].count}"
                    clusters[block] = Cluster(block, label, note, "folded")
                elif block in shared:
                    note = f"{_params(params[block])} · shared weights"
                    clusters[block] = Cluster(block, f"{block}  x{len(shared[block]) + 1}", note, "folded")
                else:
                    clusters[block] = Cluster(block, block, _params(params[block]), "block")
                members.append(clusters[block])
            members = clusters[block].members
        members.append(path)

    links = _links(graph, fold, set(again), drawn)
    return Scene(graph.name, subtitle(graph, unit), boxes, top, links)


def _reruns(graph: ArchGraph, shared: dict[str, list[str]]) -> dict[str, str]:
    """The ``shared`` blocks' later runs, and the KV caches made for them alone -> the block's output, the
    box that stands for them in the collapsed view."""
    g, again = graph.nx, dict[str, str]()
    for calls in shared.values():
        out = next(u for u, _, port in g.in_edges(calls[0], data="port") if port == "x")
        for call in calls:
            caches = [
                u
                for u, _, port in g.in_edges(call, data="port")
                if port == "cache" and g.nodes[u]["op"] != "input"
            ]
            again |= dict.fromkeys([call, *caches], out)
    return again


def _links(
    graph: ArchGraph, fold: dict[str, Fold], again: set[str], drawn: Callable[[str], str]
) -> list[Link]:
    """The edges between the drawn boxes, each once: none inside a folded run or into a shared block's
    later runs."""
    g = graph.nx
    links: dict[tuple[str, str, str], Link] = {}
    for u, v, port in g.edges(data="port"):
        bu, bv = g.nodes[u]["block"], g.nodes[v]["block"]
        if bu != bv and bu in fold and bv in fold and fold[bu].run == fold[bv].run and fold[bv].rep != bv:
            continue  # within a run, into a block that is drawn as its representative: drawn once
        if v in again:
            continue  # into a shared block's later run: drawn as the block's own inputs
        kind: LinkKind = "flow"
        if port == "memory":
            kind = "memory"
        elif port == "x" and g.nodes[v]["op"] == "add":
            kind = "residual"
        src, dst = drawn(u), drawn(v)
        links.setdefault((src, dst, kind), Link(src, dst, kind))
    return list(links.values())
