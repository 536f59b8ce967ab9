"""Drawing the architecture graph: diagrams (Graphviz, Mermaid) and the summary table."""

from __future__ import annotations

import os
from pathlib import Path

from specvit.diagram.graphviz import (
    ENGINE_FORMATS,
    Direction,
    RenderError,
    View,
    draw_dot,
    plan,
    scene_to_dot,
    to_dot,
)
from specvit.diagram.mermaid import scene_to_mermaid, to_mermaid
from specvit.graph.ir import ArchGraph
from specvit.graph.lower import build_graph
from specvit.io import atomic_write, refuse_inputs, spec_inputs
from specvit.spec.loader import load_spec
from specvit.spec.schema import Spec

__all__ = ["FORMATS", "MAX_BOXES", "RenderError", "render", "to_dot", "to_mermaid"]

FORMATS = (*ENGINE_FORMATS, ".dot", ".mmd")
"""The file extensions :func:`render` writes."""

MAX_BOXES = 1000
"""The most boxes :func:`render` draws: Graphviz lays out a few thousand nodes in tens of seconds, and
nobody reads a diagram of that many. The collapsed view of any preset draws under 200."""


def render(
    spec_or_graph: Spec | ArchGraph | str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    view: View = "collapsed",
    direction: Direction = "TB",
) -> Path:
    """Draw a model into a file whose extension picks the format.

    ``.svg``, ``.png`` and ``.pdf`` are laid out by Graphviz (pygraphviz, else the system ``dot``);
    ``.dot`` is the Graphviz source and ``.mmd`` a Mermaid flowchart for Markdown pages. The file is
    written whole or not at all.

    Args:
        spec_or_graph: a lowered graph, a spec, or the path of a spec file.
        path: the file to write.
        view: ``collapsed`` draws each run of identical blocks once with its repeat count;
            ``expanded`` draws every block.
        direction: ``TB`` (top to bottom) or ``LR`` (left to right).

    Returns:
        The path written.

    Raises:
        RenderError: an unknown extension, more than :data:`MAX_BOXES` boxes to draw, a failing engine,
            or no engine (the ``.dot`` file is then written beside ``path`` unless a file is there, and the
            message says how to render it).
        FileExistsError: ``path`` is the spec or a file of its extends chain.
        SpecError: the spec file is invalid.
    """
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in FORMATS:
        raise RenderError(f"cannot write {target}: the extension must be one of {', '.join(FORMATS)}")
    if isinstance(spec_or_graph, ArchGraph):
        graph = spec_or_graph
    else:
        graph = build_graph(spec_or_graph if isinstance(spec_or_graph, Spec) else load_spec(spec_or_graph))
    refuse_inputs(target, spec_inputs(graph.spec))
    nodes = len(graph.nx)
    if view == "expanded" and nodes > MAX_BOXES:  # before planning: the plan of a huge graph is slow too
        raise RenderError(_too_many(target, nodes, view))
    scene = plan(graph, view)
    if len(scene.boxes) > MAX_BOXES:
        raise RenderError(_too_many(target, len(scene.boxes), view))
    if suffix == ".mmd":
        atomic_write(target, scene_to_mermaid(scene, direction))
    elif suffix == ".dot":
        atomic_write(target, scene_to_dot(scene, direction))
    else:
        draw_dot(scene_to_dot(scene, direction), target)
    return target


def _too_many(target: Path, boxes: int, view: str) -> str:
    fix = (
        "draw the collapsed view (--view collapsed), where each run of identical blocks is one box"
        if view == "expanded"
        else "the blocks differ along the depth, so few fold; draw a model with fewer layers (--set ...depth=)"
    )
    return (
        f"cannot draw {target}: the {view} view has {boxes:,} boxes, over the limit of {MAX_BOXES:,}; {fix}"
    )
