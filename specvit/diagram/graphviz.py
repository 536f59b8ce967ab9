"""Diagrams of an architecture graph: the scene's DOT text and the Graphviz engines.

What is drawn is the :class:`~specvit.diagram.scene.Scene` that :func:`~specvit.diagram.scene.plan`
reads off the graph (re-exported here). :func:`to_dot` writes the scene as Graphviz DOT and
:func:`draw_dot` lays DOT out into SVG, PNG or PDF with the first engine available: pygraphviz (its
wheel bundles the Graphviz libraries), else the system ``dot`` through the ``graphviz`` package.
"""

from __future__ import annotations

import html
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import graphviz

from specvit.diagram.scene import CATEGORIES, Box, Cluster, Link, Scene, View, format_shape, plan
from specvit.graph.ir import ArchGraph
from specvit.io import atomic_create, atomic_open
from specvit.units import FLOPS, FlopUnit, format_flops

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

Direction = Literal["TB", "LR"]

ENGINE_FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
"""File extensions a Graphviz engine draws, and the Graphviz format of each."""

LINK_COLORS: dict[str, str] = {"flow": "#404040", "residual": "#8c8c8c", "memory": "#1f6fd1"}
"""Edge kind -> colour."""

FONT = "Helvetica,Arial,sans-serif"


class RenderError(RuntimeError):
    """A diagram could not be written: no Graphviz engine, an engine failure or an unknown format."""


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
    graph: ArchGraph,
    view: View = "collapsed",
    direction: Direction = "TB",
    *,
    flops: bool = False,
    unit: FlopUnit = FLOPS,
) -> str:
    """The diagram of ``graph`` as Graphviz DOT text.

    Args:
        graph: the lowered spec.
        view: ``collapsed`` (each run of identical blocks drawn once) or ``expanded`` (every block).
        direction: ``TB`` (top to bottom) or ``LR`` (left to right).
        flops: also write each node's FLOPs beside its parameters (per block in a folded run), with the
            useful part of an attention whose mask hides pairs (``654.3M FLOPs (useful 629.3M)``).
        unit: what FLOPs are printed in, in the title and on the nodes.
    """
    scene = plan(graph, view, unit)
    if flops:
        boxes = {k: replace(b, params=" · ".join(p for p in (b.params, _flops(graph[k], unit)) if p))
                 for k, b in scene.boxes.items()}  # fmt: skip
        scene = replace(scene, boxes=boxes)
    return scene_to_dot(scene, direction)


def _flops(node: dict[str, Any], unit: FlopUnit) -> str:
    """A node's FLOPs with their unit (and useful part), or empty for none."""
    return format_flops(node["flops"], unit, useful=node["useful_flops"]) if node["flops"] else ""


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
