"""Drawing the architecture graph: diagrams (Graphviz, Mermaid) and the summary table."""

from __future__ import annotations

import os
from pathlib import Path
from typing import overload

from specvit.diagram.graphviz import ENGINE_FORMATS, Direction, RenderError, View, draw_dot, plan, to_dot
from specvit.diagram.html import to_html
from specvit.diagram.inline import Diagram
from specvit.diagram.mermaid import to_mermaid
from specvit.diagram.raster import check_raster
from specvit.graph.ir import ArchGraph
from specvit.graph.lower import build_graph
from specvit.io import atomic_write, refuse_inputs, spec_inputs
from specvit.spec.loader import load_spec
from specvit.spec.schema import Spec
from specvit.units import flop_unit

__all__ = [
    "FORMATS",
    "MAX_BOXES",
    "Diagram",
    "RenderError",
    "render",
    "to_dot",
    "to_html",
    "to_mermaid",
    "with_dpi",
]

FORMATS = (*ENGINE_FORMATS, ".dot", ".mmd", ".html")
"""The file extensions :func:`render` writes."""

MAX_BOXES = 1000
"""The most boxes :func:`render` draws: Graphviz lays out a few thousand nodes in tens of seconds, and
nobody reads a diagram of that many. The collapsed view of any preset draws under 200."""


def with_dpi(dot: str, dpi: int | None) -> str:
    """``dot`` with a graph-level ``dpi`` attribute (the resolution of raster output), if one is given.

    Args:
        dot: DOT text starting with ``digraph NAME {``.
        dpi: dots per inch, or None to leave Graphviz's default (96).
    """
    if dpi is None:
        return dot
    head, brace, rest = dot.partition("{")
    return f"{head}{brace}\n\tdpi={int(dpi)}{rest}"


def _pipeline(graph: ArchGraph, pp: int | None, suffix: str | None) -> list[tuple[str, ...]]:
    """The blocks of each of ``pp`` pipeline stages to frame (none without ``pp``)."""
    if pp is None:
        return []
    from specvit.parallel_layout import pipeline_stages

    if suffix in (".mmd", ".html"):
        raise RenderError(f"--pp frames pipeline stages in .svg, .png, .pdf and .dot drawings, not {suffix}")
    return [stage.blocks for stage in pipeline_stages(graph, pp)]


@overload
def render(
    spec_or_graph: Spec | ArchGraph | str | os.PathLike[str],
    path: None = None,
    *,
    view: View = "collapsed",
    direction: Direction = "TB",
    flops: bool = False,
    macs: bool = False,
    plumbing: bool = False,
    pp: int | None = None,
) -> Diagram: ...


@overload
def render(
    spec_or_graph: Spec | ArchGraph | str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    view: View = "collapsed",
    direction: Direction = "TB",
    dpi: int | None = None,
    flops: bool = False,
    macs: bool = False,
    plumbing: bool = False,
    pp: int | None = None,
) -> Path: ...


def render(
    spec_or_graph: Spec | ArchGraph | str | os.PathLike[str],
    path: str | os.PathLike[str] | None = None,
    *,
    view: View = "collapsed",
    direction: Direction = "TB",
    dpi: int | None = None,
    flops: bool = False,
    macs: bool = False,
    plumbing: bool = False,
    pp: int | None = None,
) -> Path | Diagram:
    """Draw a model into a file whose extension picks the format, or, without a path, into a
    :class:`Diagram` that notebooks display inline.

    ``.svg``, ``.png`` and ``.pdf`` are laid out by Graphviz (pygraphviz, else the system ``dot``);
    ``.dot`` is the Graphviz source and ``.mmd`` a Mermaid flowchart for Markdown pages. ``.html`` is the
    interactive view (:mod:`specvit.diagram.html`): one self-contained page in which folded blocks expand,
    a click shows a node's shapes, parameters, FLOPs, settings and spec line, and a search box finds nodes
    by path. The file is written whole or not at all.

    Args:
        spec_or_graph: a lowered graph, a spec, the path of a spec file or a preset's name.
        path: the file to write; None returns a :class:`Diagram` (shown as SVG in Jupyter).
        view: ``collapsed`` draws each run of identical blocks once with its repeat count;
            ``expanded`` draws every block (the ``.html`` view opens with every run expanded).
        direction: ``TB`` (top to bottom) or ``LR`` (left to right).
        dpi: resolution of a ``.png`` (Graphviz's default is 96); only for PNG files.
        flops: write each node's FLOPs beside its parameters (Graphviz formats), and the useful part of
            an attention whose causal mask or sliding window hides pairs.
        macs: print FLOPs as multiply-adds (MACs, half as many): in the title, and on the nodes with ``flops``.
        plumbing: also draw the run-time plumbing (padding masks, the KV cache, the decoding offset) and its
            edges into every attention; by default they are left out (the graph and the model have them).
        pp: frame the blocks of each of ``pp`` pipeline stages as ``summary --pp`` cuts them (not in .mmd, .html).

    Returns:
        The path written, or the Diagram.

    Raises:
        RenderError: an unknown extension, more than :data:`MAX_BOXES` boxes to draw, a failing engine,
            or no engine (the ``.dot`` file is then written beside ``path`` unless a file is there, and the
            message says how to render it).
        FileExistsError: ``path`` is the spec or a file of its extends chain.
        SpecError: the spec file is invalid.
    """
    if path is not None:
        target = Path(path)
        suffix = target.suffix.lower()
        if suffix not in FORMATS:
            raise RenderError(f"cannot write {target}: the extension must be one of {', '.join(FORMATS)}")
        if dpi is not None and (suffix != ".png" or not 1 <= dpi <= 2400):
            raise RenderError(f"dpi {dpi} is for .png files, from 1 to 2400; {target} is {suffix}")
    if isinstance(spec_or_graph, ArchGraph):
        graph = spec_or_graph
    else:
        graph = build_graph(spec_or_graph if isinstance(spec_or_graph, Spec) else load_spec(spec_or_graph))
    if path is not None:
        refuse_inputs(target, spec_inputs(graph.spec))
    shown, nodes = str(path) if path is not None else "the diagram", len(graph.nx)
    if view == "expanded" and nodes > MAX_BOXES:  # before planning: the plan of a huge graph is slow too
        raise RenderError(_too_many(shown, nodes, view))
    unit = flop_unit(macs)
    pipeline = _pipeline(graph, pp, None if path is None else suffix)
    scene = plan(graph, view, unit, plumbing=plumbing, pipeline=pipeline)
    if len(scene.boxes) > MAX_BOXES:
        raise RenderError(_too_many(shown, len(scene.boxes), view))
    dot = to_dot(graph, view, direction, flops=flops, unit=unit, plumbing=plumbing, scene=scene)
    if path is None:
        return Diagram(graph, dot, view, direction, unit, plumbing=plumbing)
    if suffix == ".mmd":
        atomic_write(target, to_mermaid(graph, view, direction, unit, plumbing=plumbing))
    elif suffix == ".html":
        atomic_write(target, to_html(graph, view, direction, unit, limit=MAX_BOXES))
    elif suffix == ".dot":
        atomic_write(target, dot)
    else:
        if dpi is not None:
            check_raster(dot, dpi, target)  # dpi x layout bounded before a pixel is drawn
        draw_dot(with_dpi(dot, dpi), target)
    return target


def _too_many(target: str, boxes: int, view: str) -> str:
    fix = (
        "draw the collapsed view (--view collapsed), where each run of identical blocks is one box"
        if view == "expanded"
        else "the blocks differ along the depth, so few fold; draw a model with fewer layers (--set ...depth=)"
    )
    return (
        f"cannot draw {target}: the {view} view has {boxes:,} boxes, over the limit of {MAX_BOXES:,}; {fix}"
    )
