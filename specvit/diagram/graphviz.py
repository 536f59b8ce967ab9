"""Diagrams of an architecture graph: the scene (what is drawn), its DOT text and the Graphviz engines.

:func:`plan` reads an :class:`~specvit.graph.ir.ArchGraph` into a :class:`Scene`: the boxes to draw
with their label lines and colour category, the clusters (stacks, blocks, head) and the edges. In the
collapsed view a run of repeated blocks (:meth:`ArchGraph.fold`) is drawn once, its edges entering
the first block and leaving the last. :func:`to_dot` writes the scene as Graphviz DOT and
:func:`draw_dot` lays DOT out into SVG, PNG or PDF with the first engine available: pygraphviz (its
wheel bundles the Graphviz libraries), else the system ``dot`` through the ``graphviz`` package.
"""

from __future__ import annotations

import html
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import graphviz

from specvit.diagram.text import format_count
from specvit.graph.ir import ArchGraph, Shape
from specvit.io import atomic_create, atomic_open

__all__ = [
    "CATEGORIES",
    "ENGINE_FORMATS",
    "LINK_COLORS",
    "Box",
    "Cluster",
    "Direction",
    "Link",
    "RenderError",
    "Scene",
    "View",
    "draw_dot",
    "format_shape",
    "plan",
    "scene_to_dot",
    "to_dot",
]

View = Literal["collapsed", "expanded"]
Direction = Literal["TB", "LR"]
LinkKind = Literal["flow", "residual", "memory"]

ENGINE_FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
"""File extensions a Graphviz engine draws, and the Graphviz format of each."""

CATEGORIES: dict[str, tuple[str, str, str]] = {
    "attention": ("#fbd9bd", "#d9742b", "attention"),
    "mlp": ("#d3ecd1", "#3f8f3f", "MLP"),
    "norm": ("#fff1a8", "#b89b00", "norm / layer scale"),
    "embedding": ("#d6e2f5", "#3d66ad", "embedding / position"),
    "structural": ("#ececec", "#808080", "input / output / add / dropout"),
    "head": ("#e8d5f0", "#8346a0", "head"),
}
"""Colour category -> (fill, border, legend text): the fixed palette, in legend order."""

LINK_COLORS: dict[str, str] = {"flow": "#404040", "residual": "#8c8c8c", "memory": "#1f6fd1"}
"""Edge kind -> colour."""

FONT = "Helvetica,Arial,sans-serif"


class RenderError(RuntimeError):
    """A diagram could not be written: no Graphviz engine, an engine failure or an unknown format."""


# -- the scene ----------------------------------------------------------------------------------


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
        subtitle: total parameters and FLOPs, and the sizes the FLOPs were counted at.
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
    return f"{format_count(n)} params" if n else ""


def plan(graph: ArchGraph, view: View = "collapsed") -> Scene:
    """What a diagram of ``graph`` shows.

    Args:
        graph: the lowered spec.
        view: ``collapsed`` draws each run of identical blocks once, as one cluster with its repeat
            count; ``expanded`` draws every block.

    Returns:
        The scene: boxes, nested clusters and edges.
    """
    if view not in ("collapsed", "expanded"):
        raise ValueError(f"view must be 'collapsed' or 'expanded', not {view!r}")
    g = graph.nx
    fold = graph.fold() if view == "collapsed" else {}

    def drawn(path: str) -> str:
        """The box standing for ``path``: its counterpart in the representative block of its run."""
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
                else:
                    clusters[block] = Cluster(block, block, _params(params[block]), "block")
                members.append(clusters[block])
            members = clusters[block].members
        members.append(path)

    links: dict[tuple[str, str, str], Link] = {}
    for u, v, port in g.edges(data="port"):
        bu, bv = g.nodes[u]["block"], g.nodes[v]["block"]
        if bu != bv and bu in fold and bv in fold and fold[bu].run == fold[bv].run and fold[bv].rep != bv:
            continue  # within a run, into a block that is drawn as its representative: drawn once
        kind: LinkKind = "flow"
        if port == "memory":
            kind = "memory"
        elif port == "x" and g.nodes[v]["op"] == "add":
            kind = "residual"
        src, dst = drawn(u), drawn(v)
        links.setdefault((src, dst, kind), Link(src, dst, kind))

    sizes = ", ".join(f"{k}={v}" for k, v in graph.dims.items() if "+" not in k)  # S+1 follows from S
    total = f"{format_count(graph.total_params)} params · {format_count(graph.total_flops)} FLOPs at {sizes}"
    return Scene(graph.name, total, boxes, top, list(links.values()))


# -- DOT ----------------------------------------------------------------------------------------


def _esc(text: str) -> str:
    """``text`` made safe inside an HTML-like label."""
    return html.escape(text, quote=True)


def _box_label(box: Box) -> str:
    """The HTML-like label of a box: op kind in bold, its hyperparameters, then shape and parameters."""
    lines = [f"<b>{_esc(box.op)}</b>", *(_esc(d) for d in box.details)]
    foot = " · ".join(_esc(p) for p in (box.shape, box.params) if p)
    if foot:  # an empty <font> is a Graphviz syntax error (a cache or an offset has no shape)
        lines.append(f'<font color="#505050">{foot}</font>')
    return "<" + "<br/>".join(lines) + ">"


def _caption(title: str, note: str, size: int, *, left: bool = False) -> str:
    """An HTML-like label: a bold title and, under it, a smaller grey note.

    Args:
        title: the first line.
        note: the second line, or empty for none.
        size: the font size of the title; the note is 2 points smaller.
        left: left-align the lines (for left-justified cluster labels).
    """
    br = '<br align="left"/>' if left else "<br/>"
    text = f"<b>{_esc(title)}</b>"
    if note:
        text += f'{br}<font point-size="{size - 2}" color="#505050">{_esc(note)}</font>'
    return f"<{text}{br if left else ''}>"


_CLUSTER_STYLE: dict[str, dict[str, str]] = {
    "stack": {"style": "rounded", "color": "#7a7a7a", "penwidth": "1.2", "labeljust": "l"},
    # the head's caption goes below it, where no edge passes
    "head": {"style": "rounded", "color": "#8346a0", "penwidth": "1.2", "labelloc": "b"},
    "block": {"style": "rounded,filled", "color": "#b5b5b5", "fillcolor": "#f7f7f7"},
    "folded": {"style": "rounded,filled", "color": "#6f6f6f", "fillcolor": "#f2f2f2", "penwidth": "2"},
}


def _add_box(dot: graphviz.Digraph, box: Box) -> None:
    """Add a box as a node: a labelled rounded box, or a small circle for an add."""
    fill, border, _ = CATEGORIES[box.category]
    tooltip = " · ".join(p for p in (box.id, box.op, box.shape, box.params) if p)
    if box.op == "add":
        dot.node(
            box.id,
            "+",
            shape="circle",
            width="0.3",
            fixedsize="true",
            fontsize="14",
            fillcolor=fill,
            color=border,
            tooltip=tooltip,
        )
    else:
        dot.node(box.id, _box_label(box), fillcolor=fill, color=border, tooltip=tooltip)


def _add_member(dot: graphviz.Digraph, member: str | Cluster, scene: Scene) -> None:
    """Add a box, or a cluster with everything inside it, to ``dot``."""
    if isinstance(member, str):
        _add_box(dot, scene.boxes[member])
        return
    with dot.subgraph(name=f"cluster_{member.id}") as sub:
        sub.attr(**_CLUSTER_STYLE[member.kind])
        members = member.members
        if member.kind in ("block", "folded"):
            # A block's caption is a node beside its first box rather than a cluster label: the edge
            # entering the block would run across a label, while edges go round nodes.
            sub.attr(label="")  # DOT clusters inherit their parent's label
            with sub.subgraph() as row:
                row.attr(rank="same")
                row.node(
                    f"{member.id} (caption)",
                    _caption(member.title, member.note, 11, left=True),
                    shape="plaintext",
                    style="",
                    fontsize="11",
                )
                _add_member(row, members[0], scene)
            members = members[1:]
        else:
            sub.attr(
                label=_caption(member.title, member.note, 12, left=member.kind == "stack"), fontsize="12"
            )
        for m in members:
            _add_member(sub, m, scene)


_EDGE_LEGEND = {"residual": "—— residual (skip) into +", "memory": "- - - memory: encoder output"}


def _legend(dot: graphviz.Digraph, scene: Scene) -> None:
    """The legend: one compact table node, a swatch per colour category in use, then the edge styles in use.

    One node takes one rank, so the legend neither deepens a rank of the model nor stretches beside it.
    """
    rows = ['<TR><TD BORDER="0"><B>legend</B></TD></TR>']
    for category in scene.categories:
        fill, border, text = CATEGORIES[category]
        rows.append(
            f'<TR><TD BGCOLOR="{fill}" COLOR="{border}" STYLE="rounded">{html.escape(text)}</TD></TR>'
        )
    kinds = {link.kind for link in scene.links}
    for kind, text in _EDGE_LEGEND.items():
        if kind in kinds:
            rows.append(
                f'<TR><TD BORDER="0"><FONT COLOR="{LINK_COLORS[kind]}">{html.escape(text)}</FONT></TD></TR>'
            )
    table = '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="3" CELLPADDING="2">' + "".join(rows) + "</TABLE>>"
    with dot.subgraph(name="cluster_legend") as sub:
        sub.attr(label="", style="rounded", color="#c8c8c8")
        sub.node("legend", table, shape="plaintext", style="", fontsize="9", margin="0")


_LINK_STYLE: dict[str, dict[str, str]] = {
    "flow": {},
    "residual": {"color": LINK_COLORS["residual"], "weight": "0"},
    # not a layout constraint: the decoder stands beside the encoder, not below it
    "memory": {"color": LINK_COLORS["memory"], "style": "dashed", "penwidth": "1.5", "constraint": "false"},
}


def scene_to_dot(scene: Scene, direction: Direction = "TB") -> str:
    """The DOT text of a scene.

    Args:
        scene: what to draw, from :func:`plan`.
        direction: ``TB`` (top to bottom) or ``LR`` (left to right).
    """
    if direction not in ("TB", "LR"):
        raise ValueError(f"direction must be 'TB' or 'LR', not {direction!r}")
    dot = graphviz.Digraph(scene.title)
    dot.attr(
        "graph",
        label=_caption(scene.title, scene.subtitle, 14),
        labelloc="t",
        fontname=FONT,
        fontsize="14",
        rankdir=direction,
        newrank="true",
        splines="ortho",
        nodesep="0.3",
        ranksep="0.3",
        bgcolor="white",
    )
    dot.attr("node", shape="box", style="rounded,filled", fontname=FONT, fontsize="10", margin="0.12,0.05")
    dot.attr("edge", color=LINK_COLORS["flow"], arrowsize="0.6")
    for member in scene.members:
        _add_member(dot, member, scene)
    for link in scene.links:
        dot.edge(link.src, link.dst, **_LINK_STYLE[link.kind])
    _legend(dot, scene)
    return dot.source


def to_dot(
    graph: ArchGraph, view: View = "collapsed", direction: Direction = "TB", *, flops: bool = False
) -> str:
    """The diagram of ``graph`` as Graphviz DOT text.

    Args:
        graph: the lowered spec.
        view: ``collapsed`` (each run of identical blocks drawn once) or ``expanded`` (every block).
        direction: ``TB`` (top to bottom) or ``LR`` (left to right).
        flops: also write each node's FLOPs beside its parameters (per block in a folded run).
    """
    scene = plan(graph, view)
    if flops:
        boxes = {k: replace(b, params=" · ".join(p for p in (b.params, _flops(graph[k]["flops"])) if p))
                 for k, b in scene.boxes.items()}  # fmt: skip
        scene = replace(scene, boxes=boxes)
    return scene_to_dot(scene, direction)


def _flops(n: int) -> str:
    return f"{format_count(n)} FLOPs" if n else ""


# -- engines ------------------------------------------------------------------------------------


def _engine() -> Callable[[str, str], bytes] | None:
    """A function laying out DOT text into the bytes of a format: pygraphviz, else the system ``dot``."""
    try:
        import pygraphviz
    except ImportError:
        pass
    else:
        return lambda dot, fmt: bytes(pygraphviz.AGraph(string=dot).draw(format=fmt, prog="dot"))
    if shutil.which("dot"):
        return lambda dot, fmt: graphviz.Source(dot).pipe(format=fmt)
    return None


def draw_dot(dot: str, path: str | Path) -> Path:
    """Lay out DOT text into an SVG, PNG or PDF file, written whole or not at all.

    Args:
        dot: the DOT text.
        path: the file to write; its extension (``.svg``, ``.png``, ``.pdf``) picks the format.

    Returns:
        The path written.

    Raises:
        RenderError: for another extension; when the engine fails; when there is no engine, after
            writing the DOT text beside ``path``, with the commands that draw it.
    """
    path = Path(path)
    fmt = ENGINE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise RenderError(f"cannot draw {path}: the extension must be one of {', '.join(ENGINE_FORMATS)}")
    engine = _engine()
    if engine is None:
        source = path.with_suffix(".dot")
        install = (
            "specvit installs pygraphviz (its wheel bundles Graphviz) where that wheel exists; here, install "
            "Graphviz (`apt-get install graphviz`, `brew install graphviz`) or build pygraphviz "
            "(`pip install pygraphviz`)"
        )
        if not atomic_create(source, dot):  # a file the user did not name is never replaced
            raise RenderError(
                f"no Graphviz to draw {path}; {source} exists, so the Graphviz source was not written there. "
                f"{install}, or write the source elsewhere: specvit render SPEC -o OTHER.dot"
            )
        raise RenderError(
            f"no Graphviz to draw {path}; wrote {source} instead. {install}, then run: "
            f"dot -T{fmt} {source} -o {path}"
        )
    with atomic_open(path) as f:
        try:
            data = engine(dot, fmt)
        except Exception as exc:
            raise RenderError(f"Graphviz failed to draw {path}: {exc}") from exc
        f.write(data)
    return path
