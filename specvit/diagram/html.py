"""The interactive view of a diagram: one self-contained HTML file (``specvit render SPEC -o model.html``).

The page is the static diagram itself, laid out by Graphviz from the same
:class:`~specvit.diagram.scene.Scene`, with behaviour attached by node name: folded runs of repeated blocks
expand and collapse, hovering a box shows its shapes, parameters and FLOPs, clicking it shows everything
(settings and the spec line it came from), and a search box finds any node by path, revealing it inside a
folded run. Three parts, each reusable (a live editor embeds the same view beside its text):

- :func:`~specvit.diagram.viewdata.view_data`: the model as JSON data;
- :func:`layouts`: the picture of each expanded state, as SVG text;
- ``view.js`` and ``view.css`` beside this module: ``specvitView(element, data)`` draws it.

Expanding a run shows a layout drawn beforehand with that run expanded, not one computed in the page: the
browser has no Graphviz, and a second layout engine would draw a picture other than the static diagram's.
Every combination of expanded runs is laid out for up to :data:`COMBINED` runs; beyond that, each run
alone and all of them. A state whose diagram would exceed the box limit is not laid out, nor one Graphviz
cannot lay out within the time left of :data:`BUDGET` (a side input wired into every block, a mask or a
rotary table, can make ``dot`` take minutes): its run stays folded, the page says why, and the search still
shows each of its nodes. The folded picture is the static diagram's, laid out as it is, without a limit.

Nothing is fetched: the data, the SVG, the script and the style are inline, and the page's Content
Security Policy allows no other source and no script but its own.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from itertools import combinations
from typing import Any

import specvit.diagram.graphviz as drawing
from specvit.diagram.graphviz import Direction, RenderError, View, scene_to_dot
from specvit.diagram.scene import Scene, plan
from specvit.diagram.viewdata import Run, runs, view_data
from specvit.graph.ir import ArchGraph, Fold
from specvit.units import FLOPS, FlopUnit

__all__ = [
    "BUDGET",
    "COMBINED",
    "Pictures",
    "asset",
    "draw_svg",
    "folded_dot",
    "folded_scene",
    "key",
    "layouts",
    "page",
    "to_html",
    "variants",
]

COMBINED = 3
"""Up to this many folded runs, every combination of expanded runs is laid out (8 layouts at most)."""

BUDGET = 30.0
"""Seconds that laying out the expanded pictures of one page may take, all together."""

_CHILD = (
    "import sys, pygraphviz\n"
    "sys.stdout.buffer.write(pygraphviz.AGraph(string=sys.stdin.read()).draw(format='svg', prog='dot'))\n"
)
"""A child process drawing DOT read from its input: pygraphviz runs in C and cannot be stopped in-process."""


class _Partial(ArchGraph):
    """A graph whose collapsed view folds only some of its runs."""

    def __init__(self, graph: ArchGraph, fold: dict[str, Fold], folded: set[str]):
        self.__dict__.update(graph.__dict__)
        self._fold = {block: f for block, f in fold.items() if f.run in folded}

    def fold(self) -> dict[str, Fold]:
        return dict(self._fold)


def key(expanded: list[str]) -> str:
    """The name of a layout: the ids of its expanded runs, in execution order, one per line.

    Args:
        expanded: run ids (their first block's path), in execution order.
    """
    return "\n".join(expanded)


def variants(found: list[Run]) -> list[list[str]]:
    """The sets of expanded runs laid out: every combination for up to :data:`COMBINED` runs, else none,
    each one alone, and all.

    Args:
        found: the graph's folded runs, in execution order.
    """
    ids = [r.id for r in found]
    if len(ids) <= COMBINED:
        return [list(c) for k in range(len(ids) + 1) for c in combinations(ids, k)]
    return [[], *([i] for i in ids), ids]


def _svg(text: str) -> str:
    """Graphviz's SVG without its XML declaration and DOCTYPE (which name outside addresses)."""
    start = text.find("<svg")
    return text[start:] if start >= 0 else text


@dataclass
class Pictures:
    """The laid-out states of a view.

    Args:
        svg: the SVG picture of each state, by :func:`key` of its expanded runs.
        skipped: the states left out, each with the reason (``"over 1,000 boxes"``).
    """

    svg: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _draw(dot: str, timeout: float) -> str | None:
    """``dot`` laid out into SVG by a child process, or None when it takes more than ``timeout`` seconds.

    Raises:
        RenderError: no Graphviz engine, or the engine failed.
    """
    try:
        import pygraphviz  # noqa: F401
    except ImportError:
        found = shutil.which("dot")
        if found is None:
            raise RenderError("no Graphviz to lay out the diagram: install pygraphviz or Graphviz") from None
        command = [found, "-Tsvg"]
    else:
        command = [sys.executable, "-c", _CHILD]
    try:
        run = subprocess.run(command, input=dot.encode(), capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # the child is killed
        return None
    if run.returncode != 0:
        detail = run.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        raise RenderError(f"Graphviz failed to lay out the diagram: {' '.join(detail) or run.returncode}")
    return run.stdout.decode("utf-8")


def layouts(
    graph: ArchGraph,
    direction: Direction = "TB",
    unit: FlopUnit = FLOPS,
    *,
    limit: int = 1000,
    budget: float = BUDGET,
) -> Pictures:
    """The SVG picture of each laid-out state of the view (:func:`variants`), by :func:`key`.

    Args:
        graph: the lowered spec.
        direction: ``TB`` or ``LR``.
        unit: what the title's FLOPs are printed in.
        limit: the most boxes an expanded picture may draw; a state over it is left out.
        budget: the seconds all the expanded pictures may take to lay out; those not done by then are left
            out (the folded one is always laid out, as the static diagram is).

    Raises:
        RenderError: no Graphviz engine, or the engine failed.
    """
    engine = drawing._engine()
    if engine is None:
        raise RenderError(
            "no Graphviz to lay out the diagram: install pygraphviz (its wheel bundles Graphviz) or Graphviz"
        )
    fold = graph.fold()
    found = runs(graph, fold)
    deadline = time.monotonic() + budget
    out = Pictures()
    for expanded in variants(found):
        name = key(expanded)
        # a stage's blocks drawn as runs the reader expands, not as the static diagram's one stage box
        scene = plan(
            _Partial(graph, fold, {r.id for r in found} - set(expanded)), "collapsed", unit, stages=False
        )
        dot = scene_to_dot(scene, direction)
        if not expanded:
            try:
                svg: str | None = engine(dot, "svg").decode("utf-8")
            except Exception as exc:
                raise RenderError(f"Graphviz failed to lay out the diagram: {exc}") from exc
        elif len(scene.boxes) > limit:
            svg, out.skipped[name] = None, f"over {limit:,} boxes"
        else:
            left = deadline - time.monotonic()
            svg = _draw(dot, left) if left > 0 else None
            if svg is None:
                out.skipped[name] = f"not laid out within {budget:g} s"
        if svg is not None:
            out.svg[name] = _svg(svg)
    return out


def folded_scene(graph: ArchGraph, unit: FlopUnit = FLOPS) -> Scene:
    """The view's folded scene (every run folded, a stage's blocks as runs): what :func:`layouts` lays out
    first and :func:`~specvit.diagram.viewdata.view_data` maps nodes onto.

    Args:
        graph: the lowered spec.
        unit: what the title's FLOPs are printed in.
    """
    return plan(graph, "collapsed", unit, stages=False)


def folded_dot(scene: Scene, direction: Direction = "TB") -> str:
    """The DOT source of the folded picture; a live editor lays out only this one while the user types,
    caching it by its text.

    Args:
        scene: :func:`folded_scene`.
        direction: ``TB`` or ``LR``.
    """
    return scene_to_dot(scene, direction)


def draw_svg(dot: str) -> str:
    """DOT text laid out into the SVG the view shows (its ``layouts`` values), in this process.

    Args:
        dot: the Graphviz source (:func:`folded_dot`).

    Raises:
        RenderError: no Graphviz engine, or the engine failed.
    """
    engine = drawing._engine()
    if engine is None:
        raise RenderError(
            "no Graphviz to lay out the diagram: install pygraphviz (its wheel bundles Graphviz) or Graphviz"
        )
    try:
        return _svg(engine(dot, "svg").decode("utf-8"))
    except Exception as exc:
        raise RenderError(f"Graphviz failed to lay out the diagram: {exc}") from exc


def asset(name: str) -> str:
    """The text of a file shipped beside this module (``view.js``, ``view.css``).

    Args:
        name: the file name.
    """
    return resources.files("specvit.diagram").joinpath(name).read_text(encoding="utf-8")


def _json(data: Any) -> str:
    """``data`` as JSON that cannot end the ``<script>`` element holding it: ``<``, ``>``, ``&`` and the two
    line separators JavaScript source once refused are written as ``\\u`` escapes, which JSON reads back as
    the same characters (they only occur in strings)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


def _hash(script: str) -> str:
    """The CSP source expression allowing exactly this inline script."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode() + "'"


def page(data: dict[str, Any]) -> str:
    """The HTML page showing ``data`` (:func:`~specvit.diagram.viewdata.view_data` with ``layouts``).

    Args:
        data: the view's data: its ``title`` names the page.
    """
    start = 'specvitView(document.getElementById("specvit-view"), JSON.parse(document.getElementById("specvit-data").textContent));'
    script = f"\n{asset('view.js')}\n{start}\n"  # the element's whole text: what the hash covers
    policy = f"default-src 'none'; script-src {_hash(script)}; style-src 'unsafe-inline'; img-src data:"
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{html.escape(str(data['title']))} · specvit</title>\n"
        f"<style>\n{asset('view.css')}</style>\n</head>\n<body>\n"
        '<div id="specvit-view"></div>\n'
        f'<script type="application/json" id="specvit-data">{_json(data)}</script>\n'
        f"<script>{script}</script>\n</body>\n</html>\n"
    )


def to_html(
    graph: ArchGraph,
    view: View = "collapsed",
    direction: Direction = "TB",
    unit: FlopUnit = FLOPS,
    *,
    limit: int = 1000,
    budget: float = BUDGET,
) -> str:
    """The interactive view of ``graph`` as one self-contained HTML page.

    Args:
        graph: the lowered spec.
        view: the state it opens in: ``collapsed`` (every run folded) or ``expanded`` (every run
            expanded, where that layout is within ``limit``).
        direction: ``TB`` or ``LR``.
        unit: what FLOPs are counted in.
        limit: the most boxes an expanded picture may draw.
        budget: the seconds all expanded pictures may take to lay out (see :func:`layouts`).

    Raises:
        RenderError: no Graphviz engine, or the engine failed.
    """
    data = view_data(graph, unit)
    pictures = layouts(graph, direction, unit, limit=limit, budget=budget)
    data["layouts"] = pictures.svg
    every = key([g["id"] for g in data["groups"]])
    data["initial"] = every if view == "expanded" and every in pictures.svg else ""
    for group in data["groups"]:
        alone = key([group["id"]])
        group["expandable"] = alone in pictures.svg
        group["why"] = pictures.skipped.get(alone, "")
    return page(data)
