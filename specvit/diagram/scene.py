"""What a diagram shows, whatever language draws it: :func:`plan` reads an
:class:`~specvit.graph.ir.ArchGraph` into a :class:`Scene`: the boxes to draw with their label lines and
colour category, the clusters (stacks, blocks, head) and the edges. In the collapsed view a run of repeated
blocks (:meth:`ArchGraph.fold`) is drawn once, its edges entering the first block and leaving the last, a
repeating pattern of blocks is drawn once in execution order inside a frame, a block whose weights later
layers share is drawn once with the number of its runs, and a stage repeating an earlier stage's structure
is one box (:mod:`specvit.diagram.folds`). The run-time plumbing (masks, the KV cache, the decoding offset)
is left out unless asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from specvit.diagram.folds import Grouping, Stage, group_blocks
from specvit.graph.ir import ArchGraph, Shape
from specvit.units import FLOPS, FlopUnit, format_flops, format_params, format_sizes

__all__ = [
    "CATEGORIES",
    "PLUMBING_DTYPES",
    "Box",
    "Cluster",
    "Link",
    "Scene",
    "View",
    "format_shape",
    "plan",
    "plumbing_nodes",
    "subtitle",
]

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
        id: the graph path it stands for (in the collapsed view, the node of its run's first block), or for
            a box standing for whole blocks, their range (``encoder.stages.2.blocks.0-5``).
        op: the op kind, the first line of its label (the block range, for blocks).
        category: its colour category, a key of :data:`CATEGORIES`.
        details: key hyperparameters, one short line each.
        shape: the output shape, ``"B x 197 x 768"``.
        params: the parameter count, ``"2.4M params"``, or empty for none.
        kind: ``op`` (one node) or ``blocks`` (the blocks of a stage drawn as earlier blocks in full;
            its details say which, and what differs).
    """

    id: str
    op: str
    category: str
    details: tuple[str, ...]
    shape: str
    params: str
    kind: Literal["op", "blocks"] = "op"


@dataclass
class Cluster:
    """A group drawn together: a stack, a block (or a run of identical blocks drawn once) or the head.

    Args:
        id: a unique name: the stack or block path, or the block range a ``repeat`` frame spans.
        title: the caption, ``"encoder.blocks.0-11  x12"``.
        note: a second, smaller caption line (parameters), or empty.
        kind: ``stack``, ``block`` (one block), ``folded`` (a run of equal blocks drawn once), ``repeat``
            (a frame around a pattern of blocks drawn once, in order, its title giving the repeat count)
            or ``head``.
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
        drawn: graph node -> the id of the box drawing it; a node not drawn (plumbing) is absent.
    """

    title: str
    subtitle: str
    boxes: dict[str, Box]
    members: list[str | Cluster]
    links: list[Link]
    drawn: dict[str, str] = field(default_factory=dict)

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


PLUMBING_DTYPES = ("bool", "int", "cache")
"""The dtypes of the model arguments that steer a run rather than carry its data: padding and global-token
masks, the decoding offset, the KV cache."""


def plumbing_nodes(graph: ArchGraph) -> set[str]:
    """The run-time plumbing of ``graph``: the arguments of :data:`PLUMBING_DTYPES` and the nodes computed from
    them alone (a mask extended for prefix tokens, a block's share of the KV cache).

    Args:
        graph: the lowered spec.
    """
    g, out = graph.nx, set[str]()
    for n, a in g.nodes(data=True):  # in execution order: a node's inputs come first
        if a["op"] == "input":
            if a["p"].dtype in PLUMBING_DTYPES:
                out.add(n)
        elif g.in_degree(n) and all(u in out for u, _ in g.in_edges(n)):
            out.add(n)
    return out


def plan(
    graph: ArchGraph,
    view: View = "collapsed",
    unit: FlopUnit = FLOPS,
    *,
    plumbing: bool = False,
    stages: bool = True,
    pipeline: Sequence[Sequence[str]] = (),
) -> Scene:
    """What a diagram of ``graph`` shows.

    Args:
        graph: the lowered spec.
        view: ``collapsed`` draws each run of identical blocks once, as one cluster with its repeat
            count, a repeating pattern of blocks once in a frame with its repeat count, and a stage that
            repeats an earlier stage's structure as one box (see :mod:`specvit.diagram.folds`);
            ``expanded`` draws every block.
        unit: what the subtitle's FLOPs are printed in.
        plumbing: also draw the run-time plumbing (:func:`plumbing_nodes`: masks, the KV cache, the decoding
            offset) and its edges; the graph has them either way.
        stages: in the collapsed view, draw a stage that repeats an earlier one as one box.
        pipeline: the blocks of each pipeline stage, each stage framed (:func:`~specvit.diagram.folds.group_blocks`).

    Returns:
        The scene: boxes, nested clusters and edges.
    """
    if view not in ("collapsed", "expanded"):
        raise ValueError(f"view must be 'collapsed' or 'expanded', not {view!r}")
    g = graph.nx
    params: dict[str, int] = {}
    for _, a in g.nodes(data=True):
        for key in (a["stack"], a["block"]):
            if key:
                params[key] = params.get(key, 0) + int(a["params"])
    grouping = group_blocks(
        graph, lambda b: _params(params[b]), collapsed=view == "collapsed", stages=stages, pipeline=pipeline
    )
    hidden = set() if plumbing else plumbing_nodes(graph)
    again = _reruns(graph, graph.shared()) if view == "collapsed" else {}
    drawn: dict[str, str] = {}
    boxes: dict[str, Box] = {}
    clusters: dict[str, Cluster] = {}
    top: list[str | Cluster] = []
    for path, a in g.nodes(data=True):
        if path in hidden:
            continue
        block, stack = a["block"], a["stack"]
        stage = grouping.stages.get(path)
        if path in again:
            drawn[path] = again[path]
        elif stage is not None:
            drawn[path] = stage.id
        elif block in grouping.rep:
            drawn[path] = grouping.rep[block] + path[len(block) :]
        else:
            drawn[path] = path
        box = drawn[path]
        if box in boxes or (box != path and stage is None):
            continue
        boxes[box] = _stage_box(graph, stage) if stage else _box(graph, path, a)
        members = top
        if stack:
            if stack not in clusters:
                role = "head" if stack == "head" else "stack"
                clusters[stack] = Cluster(stack, stack, _params(params[stack]), role)
                top.append(clusters[stack])
            members = clusters[stack].members
        for frame in grouping.frames.get(block, []) if stage is None else []:
            if frame.id not in clusters:
                clusters[frame.id] = Cluster(frame.id, frame.title, frame.note, frame.kind)
                members.append(clusters[frame.id])
            members = clusters[frame.id].members
        members.append(box)
    links = _links(graph, grouping, drawn, set(again))
    return Scene(graph.name, subtitle(graph, unit), boxes, top, links, drawn)


def _box(graph: ArchGraph, path: str, a: dict[str, Any]) -> Box:
    """The box of one node."""
    op = graph.op(path)
    return Box(
        path,
        a["op"],
        _category(op.category, a["stack"]),
        tuple(line for line in op.label(a["p"]) if line),
        format_shape(a["shape"]),
        _params(a["params"]),
    )


def _stage_box(graph: ArchGraph, stage: Stage) -> Box:
    """The box standing for a stage's blocks: which blocks drawn in full they repeat, and what differs."""
    return Box(
        stage.id,
        stage.id,
        "structural",
        tuple(line for line in (stage.lead, stage.summary, *stage.details) if line),
        format_shape(graph[stage.nodes[-1]]["shape"]),
        _params(sum(int(graph[n]["params"]) for n in stage.nodes)),
        kind="blocks",
    )


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


def _links(graph: ArchGraph, grouping: Grouping, drawn: dict[str, str], again: set[str]) -> list[Link]:
    """The edges between the drawn boxes, each once: none from a node not drawn, none inside a box, none
    from a folded run back into its own first blocks, none into a shared block's later runs."""
    g = graph.nx
    links: dict[tuple[str, str, str], Link] = {}
    for u, v, port in g.edges(data="port"):
        if u not in drawn or v not in drawn:
            continue  # plumbing, hidden
        bu, bv = g.nodes[u]["block"], g.nodes[v]["block"]
        run = grouping.run.get(bv)
        if bu != bv and run is not None and grouping.run.get(bu) == run and bv in grouping.rep:
            continue  # within a run, into a block that is drawn as another: drawn once
        if v in again:
            continue  # into a shared block's later run: drawn as the block's own inputs
        src, dst = drawn[u], drawn[v]
        if src == dst:
            continue  # inside a box standing for blocks
        kind: LinkKind = "flow"
        if port == "memory":
            kind = "memory"
        elif port == "x" and g.nodes[v]["op"] == "add" and dst in g:  # not into a box standing for blocks
            kind = "residual"
        links.setdefault((src, dst, kind), Link(src, dst, kind))
    return list(links.values())
