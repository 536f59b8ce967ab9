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

FONT = "DejaVu Sans,Arial,Helvetica,sans-serif"
"""The font: DejaVu Sans where it is installed (every Debian-like system; fontconfig resolves it the same for
Graphviz and for librsvg, so both measure and draw the same glyphs), and the common sans fonts, narrower
than it, elsewhere: a viewer lacking DejaVu draws the labels narrower than Graphviz measured them."""

TEXT, CAPTION, TITLE = "9.5", "11", "14"
"""Font sizes of the box lines, notes and legend; of the captions and the totals; of the title. Pango (the
text layout of the Graphviz that pygraphviz bundles) measures with each glyph's advance rounded to whole
pixels at 96 dpi. At 10 points that comes out up to 4.5% narrower than the text is drawn by a renderer
placing glyphs at their true advances (librsvg, browsers): a 350-point label then overflows its box. At
these sizes the rounding measures every label of the presets at least as wide as it is drawn
(``tests/test_render.py`` checks the text extents against the boxes with DejaVu Sans's own metrics)."""


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


def _caption(title: str, note: str, *, left: bool = False) -> str:
    """An HTML-like label: a bold title and, under it, a smaller grey note.

    Args:
        title: the first line.
        note: the second line, or empty for none.
        left: left-align the lines (for left-justified cluster labels).
    """
    br = '<br align="left"/>' if left else "<br/>"
    text = f"<b>{_esc(title)}</b>"
    if note:
        text += f'{br}<font point-size="{TEXT}" color="#505050">{_esc(note)}</font>'
    return f"<{text}{br if left else ''}>"


_CLUSTER_STYLE: dict[str, dict[str, str]] = {
    "stack": {"style": "rounded", "color": "#7a7a7a", "penwidth": "1.2", "labeljust": "l"},
    # the head's caption goes below it, where no edge passes
    "head": {"style": "rounded", "color": "#8346a0", "penwidth": "1.2", "labelloc": "b"},
    "block": {"style": "rounded,filled", "color": "#b5b5b5", "fillcolor": "#f7f7f7"},
    "folded": {"style": "rounded,filled", "color": "#6f6f6f", "fillcolor": "#f2f2f2", "penwidth": "2"},
    "repeat": {"style": "rounded,dashed", "color": "#6f6f6f", "penwidth": "2"},
    "pipeline": {"style": "dashed", "color": "#c0392b", "penwidth": "2", "labeljust": "r"},
}

BLOCKS_STYLE = {"fillcolor": "#f2f2f2", "color": "#6f6f6f", "penwidth": "2"}
"""A box standing for whole blocks: the look of a folded block's cluster."""


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
    elif box.kind == "blocks":
        dot.node(box.id, _box_label(box), tooltip=tooltip, **BLOCKS_STYLE)
    else:
        dot.node(box.id, _box_label(box), fillcolor=fill, color=border, tooltip=tooltip)


def _first_box(member: str | Cluster) -> str:
    """The first box drawn in a member."""
    return member if isinstance(member, str) else _first_box(member.members[0])


def _add_member(dot: graphviz.Digraph, member: str | Cluster, scene: Scene) -> None:
    """Add a box, or a cluster with everything inside it, to ``dot``."""
    if isinstance(member, str):
        _add_box(dot, scene.boxes[member])
        return
    with dot.subgraph(name=f"cluster_{member.id}") as sub:
        sub.attr(**_CLUSTER_STYLE[member.kind])
        members = member.members
        if member.kind in ("block", "folded", "repeat"):
            # A block's caption is a node beside its first box rather than a cluster label: the edge
            # entering the block would run across a label, while edges go round nodes. A frame's caption
            # stands beside the first box of its first block, outside that block.
            sub.attr(label="")  # DOT clusters inherit their parent's label
            with sub.subgraph() as row:
                row.attr(rank="same")
                row.node(
                    f"{member.id} (caption)",
                    _caption(member.title, member.note, left=True),
                    shape="plaintext",
                    style="",
                    fontsize=CAPTION,
                )
                if member.kind == "repeat":
                    row.node(_first_box(member))
                else:
                    _add_member(row, members[0], scene)
                    members = members[1:]
        else:
            sub.attr(label=_caption(member.title, member.note, left=member.kind == "stack"), fontsize=CAPTION)
        for m in members:
            _add_member(sub, m, scene)


_EDGE_LEGEND = {"residual": "—— residual (skip) into +", "memory": "- - - memory: encoder output"}


def _title(scene: Scene) -> str:
    """The graph's label: the title, the totals, and under them the legend: one row of a swatch per colour
    category in use, then the edge styles in use.

    The legend is part of the title, not a node: a node takes a rank (in a top-to-bottom layout, its height
    would push the model's second rank down) and Graphviz places it where the ranks put it (in a
    left-to-right layout, above the first column, far from the rest); under the title it stays beside the
    graph in both directions.
    """
    cells = [
        f'<TD BGCOLOR="{fill}" COLOR="{border}" STYLE="rounded">{_esc(text)}</TD>'
        for fill, border, text in (CATEGORIES[c] for c in scene.categories)
    ]
    kinds = {link.kind for link in scene.links}
    cells += [
        f'<TD BORDER="0"><FONT COLOR="{LINK_COLORS[k]}">{_esc(text)}</FONT></TD>'
        for k, text in _EDGE_LEGEND.items()
        if k in kinds
    ]
    legend = f"<TR>{''.join(cells)}</TR>"
    return (
        '<<TABLE BORDER="0" CELLSPACING="0" CELLPADDING="1">'
        f"<TR><TD><B>{_esc(scene.title)}</B></TD></TR>"
        f'<TR><TD><FONT POINT-SIZE="{CAPTION}" COLOR="#505050">{_esc(scene.subtitle)}</FONT></TD></TR>'
        f'<TR><TD><FONT POINT-SIZE="{TEXT}"><TABLE ID="legend" BORDER="0" CELLBORDER="1" CELLSPACING="3" '
        f'CELLPADDING="2">{legend}</TABLE></FONT></TD></TR>'
        "</TABLE>>"
    )


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
        label=_title(scene),
        labelloc="t",
        fontname=FONT,
        fontsize=TITLE,
        rankdir=direction,
        newrank="true",
        splines="ortho",
        nodesep="0.3",
        ranksep="0.25",
        bgcolor="white",
    )
    dot.attr("node", shape="box", style="rounded,filled", fontname=FONT, fontsize=TEXT, margin="0.12,0.05")
    dot.attr("edge", color=LINK_COLORS["flow"], arrowsize="0.6")
    for member in scene.members:
        _add_member(dot, member, scene)
    for link in scene.links:
        dot.edge(link.src, link.dst, **_LINK_STYLE[link.kind])
    return dot.source


def to_dot(
    graph: ArchGraph,
    view: View = "collapsed",
    direction: Direction = "TB",
    *,
    flops: bool = False,
    unit: FlopUnit = FLOPS,
    plumbing: bool = False,
    scene: Scene | None = None,
) -> str:
    """The diagram of ``graph`` as Graphviz DOT text.

    Args:
        graph: the lowered spec.
        view: ``collapsed`` (each run of identical blocks drawn once) or ``expanded`` (every block).
        direction: ``TB`` (top to bottom) or ``LR`` (left to right).
        flops: also write each node's FLOPs beside its parameters (per block in a folded run), with the
            useful part of an attention whose mask hides pairs (``654.3M FLOPs (useful 629.3M)``).
        unit: what FLOPs are printed in, in the title and on the nodes.
        plumbing: also draw the run-time plumbing (masks, the KV cache, the decoding offset) and its edges.
        scene: ``plan(graph, view, unit, plumbing=plumbing)`` when the caller has it already.
    """
    if scene is None:
        scene = plan(graph, view, unit, plumbing=plumbing)
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
