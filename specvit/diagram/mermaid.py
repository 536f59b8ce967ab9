"""The diagram as a Mermaid flowchart, for Markdown pages (GitHub renders ```mermaid blocks).

It draws the same :class:`~specvit.diagram.scene.Scene` as the Graphviz diagram: ``subgraph`` per
stack, block and head, one ``classDef`` colour per op category, memory edges dotted (``-.->``).
"""

from __future__ import annotations

import re

from specvit.diagram.graphviz import CATEGORIES, LINK_COLORS, Box, Cluster, Direction, Scene, View, plan
from specvit.graph.ir import ArchGraph
from specvit.units import FLOPS, FlopUnit

__all__ = ["scene_to_mermaid", "to_mermaid"]

_ARROWS = {"flow": "-->", "residual": "-->", "memory": "-.->|memory|"}


def _text(text: str) -> str:
    """``text`` made safe inside a quoted Mermaid label."""
    return text.replace("&", "#amp;").replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")


class _Ids:
    """Mermaid ids for graph paths: letters, digits and ``_`` only, never two paths on one id."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}
        self.taken: set[str] = set()

    def __call__(self, path: str, prefix: str) -> str:
        key = prefix + path
        if key not in self.ids:
            base = prefix + re.sub(r"\W", "_", path)
            out, k = base, 1
            while out in self.taken:
                k += 1
                out = f"{base}_{k}"
            self.ids[key] = out
            self.taken.add(out)
        return self.ids[key]


def _node(box: Box, ident: str) -> str:
    """The node statement of a box: a circle for an add, else a box with the short label."""
    if box.op == "add":
        return f'{ident}(("+"))'
    foot = " · ".join(p for p in (box.shape, box.params) if p)
    lines = [f"<b>{_text(box.op)}</b>", *(_text(d) for d in box.details), _text(foot)]
    return f'{ident}["{"<br/>".join(lines)}"]'


def scene_to_mermaid(scene: Scene, direction: Direction = "TB") -> str:
    """The Mermaid flowchart text of a scene.

    Args:
        scene: what to draw, from :func:`~specvit.diagram.scene.plan`.
        direction: ``TB`` (top to bottom) or ``LR`` (left to right).
    """
    if direction not in ("TB", "LR"):
        raise ValueError(f"direction must be 'TB' or 'LR', not {direction!r}")
    ids = _Ids()
    title = _text(f"{scene.title} · {scene.subtitle}")
    lines = ["---", f'title: "{title}"', "---", f"flowchart {direction}"]

    def member(m: str | Cluster, indent: str) -> None:
        if isinstance(m, str):
            lines.append(indent + _node(scene.boxes[m], ids(m, "n_")))
            return
        caption = "<br/>".join(t for t in (f"<b>{_text(m.title)}</b>", _text(m.note)) if t)
        lines.append(f'{indent}subgraph {ids(m.id, "sg_")}["{caption}"]')
        for inner in m.members:
            member(inner, indent + "  ")
        lines.append(f"{indent}end")

    for m in scene.members:
        member(m, "  ")
    styled: dict[str, list[str]] = {}
    for i, link in enumerate(scene.links):
        lines.append(f"  {ids(link.src, 'n_')} {_ARROWS[link.kind]} {ids(link.dst, 'n_')}")
        if link.kind != "flow":
            styled.setdefault(link.kind, []).append(str(i))
    for kind, indices in styled.items():
        lines.append(f"  linkStyle {','.join(indices)} stroke:{LINK_COLORS[kind]}")
    for category in scene.categories:
        fill, border, _ = CATEGORIES[category]
        members = [ids(b.id, "n_") for b in scene.boxes.values() if b.category == category]
        lines.append(f"  classDef {category} fill:{fill},stroke:{border},color:#000")
        lines.append(f"  class {','.join(members)} {category}")
    return "\n".join(lines) + "\n"


def to_mermaid(
    graph: ArchGraph,
    view: View = "collapsed",
    direction: Direction = "TB",
    unit: FlopUnit = FLOPS,
    *,
    plumbing: bool = False,
) -> str:
    """The diagram of ``graph`` as a Mermaid flowchart.

    Args:
        graph: the lowered spec.
        view: ``collapsed`` (each run of identical blocks drawn once) or ``expanded`` (every block).
        direction: ``TB`` (top to bottom) or ``LR`` (left to right).
        unit: what the title's FLOPs are printed in.
        plumbing: also draw the run-time plumbing (masks, the KV cache, the decoding offset) and its edges.
    """
    return scene_to_mermaid(plan(graph, view, unit, plumbing=plumbing), direction)
