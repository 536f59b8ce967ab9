"""The data of the interactive view (:mod:`specvit.diagram.html`): every node of a lowered graph with its
shapes, parameters, FLOPs, settings and spec line, the folded runs of repeated blocks with their members,
and the edges, as JSON-ready Python values.

:func:`view_data` is the one producer: the HTML page embeds it, and a live editor can send it as it is.
Counts are exact integers; FLOPs are in the unit named by ``data["unit"]`` (see :mod:`specvit.units`).
Every string from the spec (names, descriptions, spec lines) is data, never markup: the page's script
writes it as text.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from specvit.diagram.scene import CATEGORIES, Scene, format_shape, plan, subtitle
from specvit.errors import Location
from specvit.graph.ir import ArchGraph, Fold
from specvit.io import read_regular
from specvit.spec.yamlread import MAX_BYTES
from specvit.units import FLOPS, FlopUnit, format_flops, format_params

__all__ = ["Run", "runs", "view_data"]


@dataclasses.dataclass(frozen=True)
class Run:
    """A run of repeated blocks that the collapsed view draws once, and the interactive view can expand.

    Args:
        id: the run's first block (``encoder.blocks.0``), naming it.
        label: the blocks it covers (``encoder.blocks.0-11``).
        blocks: every block of the run, in order.
        reps: the blocks drawn for it when folded: one, or one per block of a repeated pattern (Swin's
            plain and shifted windows).
    """

    id: str
    label: str
    blocks: tuple[str, ...]
    reps: tuple[str, ...]


def runs(graph: ArchGraph, fold: dict[str, Fold] | None = None) -> list[Run]:
    """The folded runs of ``graph``, in execution order.

    Args:
        graph: the lowered spec.
        fold: its :meth:`~specvit.graph.ir.ArchGraph.fold`, if already computed.
    """
    fold = graph.fold() if fold is None else fold
    members: dict[str, list[str]] = {}
    for block in dict.fromkeys(a["block"] for _, a in graph.nx.nodes(data=True)):  # in execution order
        if block in fold:
            members.setdefault(fold[block].run, []).append(block)
    out = []
    for run, blocks in members.items():
        prefix, first = blocks[0].rsplit(".", 1)
        last = blocks[-1].rsplit(".", 1)[1]
        reps = tuple(dict.fromkeys(fold[b].rep for b in blocks))
        out.append(Run(run, f"{prefix}.{first}-{last}", tuple(blocks), reps))
    return out


def _plain(value: Any) -> Any:
    """``value`` as JSON data: dataclasses as objects, tuples as lists, a non-finite float or anything else
    as its text (``JSON.parse`` takes no ``NaN``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


class _Lines:
    """The text of spec lines, each file read once (at most the size a spec may have); none for a file that
    cannot be read (a spec given as a string, a file gone since)."""

    def __init__(self) -> None:
        self.files: dict[str, list[str] | None] = {}

    def __call__(self, at: Location) -> str | None:
        if at.file not in self.files:
            try:
                text = read_regular(at.file, MAX_BYTES, "spec").decode("utf-8", "replace")
            except (OSError, ValueError):  # specvit.io.Unreadable is a ValueError
                self.files[at.file] = None
            else:
                self.files[at.file] = text.splitlines()
        lines = self.files[at.file]
        return lines[at.line - 1] if lines is not None and 0 < at.line <= len(lines) else None


def _source(graph: ArchGraph, key: str, lines: _Lines) -> dict[str, Any] | None:
    """Where a node came from: the spec key, file, line, column and the line's text."""
    at = graph.spec.locate(key) if key else None
    if at is None:
        return None
    return {
        "key": key,
        "file": at.file,
        "line": at.line,
        "col": at.col,
        "text": lines(at) if at.line else None,
    }


def _boxes(scene: Scene, graph: ArchGraph, fold: dict[str, Fold]) -> dict[str, str]:
    """Each node -> the box that stands for it in the collapsed view (itself, or its counterpart in its
    run's representative block); nodes with no box of their own there (a shared block's later runs) are
    absent."""
    out = {}
    for path, a in graph.nx.nodes(data=True):
        block = a["block"]
        box = fold[block].rep + path[len(block) :] if block in fold else path
        if box in scene.boxes:
            out[path] = box
    return out


def _node(graph: ArchGraph, path: str, unit: FlopUnit, lines: _Lines) -> dict[str, Any]:
    """One node's record."""
    a = graph[path]
    op = graph.op(path)
    category = "embedding" if op.category == "position" else op.category
    return {
        "path": path,
        "op": a["op"],
        "kind": category if category in CATEGORIES else "structural",  # the drawn box's, where it has one
        "label": [line for line in op.label(a["p"]) if line],
        "shape": format_shape(a["shape"]),
        "inputs": {port: format_shape(s) for port, s in a["inputs"].items()},
        "params": int(a["params"]),
        "params_text": format_params(int(a["params"])),
        "flops": unit.of(int(a["flops"])),
        "useful_flops": unit.of(int(a["useful_flops"])),
        "flops_text": format_flops(int(a["flops"]), unit, useful=int(a["useful_flops"])),
        "settings": _plain(a["p"]),
        "source": _source(graph, a.get("spec_key", ""), lines),
        "stack": a["stack"],
        "block": a["block"],
        "module": bool(a["module"]),
    }


def view_data(graph: ArchGraph, unit: FlopUnit = FLOPS, *, scene: Scene | None = None) -> dict[str, Any]:
    """What the interactive view shows of ``graph``, as JSON-ready data.

    Args:
        graph: the lowered spec.
        unit: what FLOPs are counted in (:data:`~specvit.units.FLOPS` or :data:`~specvit.units.MACS`).
        scene: the view's folded scene, ``plan(graph, "collapsed", unit, stages=False)``, when the caller has
            it already (a live editor draws it too); planned here otherwise.

    Returns:
        ``title``, ``description``, ``subtitle`` (the totals); ``unit`` (``name``, ``note``, ``key``);
        ``kinds`` (colour category -> fill, border, legend text); ``nodes`` (path -> ``path``, ``op``,
        ``kind``, ``label`` lines, output ``shape``, ``inputs`` by port, ``params``, ``flops`` and
        ``useful_flops`` in ``unit``, their texts, ``settings``, ``source`` (spec ``key``, ``file``,
        ``line``, ``col``, the line's ``text``), ``stack``, ``block``, ``run``, the collapsed view's ``box``);
        ``order`` (the paths in execution order); ``groups`` (the folded runs: ``id``, ``label``,
        ``count``, ``blocks``, ``reps``, ``members``); ``edges`` (``src``, ``dst``, ``port``).
    """
    fold = graph.fold()
    if scene is None:
        scene = plan(graph, "collapsed", unit, stages=False)  # runs to expand, not stage boxes
    boxes = _boxes(scene, graph, fold)
    lines = _Lines()
    nodes = {path: _node(graph, path, unit, lines) for path in graph}
    run_of = {block: f.run for block, f in fold.items()}
    groups = []
    for run in runs(graph, fold):
        members = [p for p in graph if graph[p]["block"] in run.blocks]
        groups.append(
            {
                "id": run.id,
                "label": run.label,
                "count": len(run.blocks),
                "blocks": list(run.blocks),
                "reps": list(run.reps),
                "members": members,
            }
        )
    for path, record in nodes.items():
        record["run"] = run_of.get(record["block"])
        record["box"] = boxes.get(path)
        if record["box"] is not None:
            record["kind"] = scene.boxes[record["box"]].category
    return {
        "title": graph.name,
        "description": graph.spec.description or "",
        "subtitle": subtitle(graph, unit),
        "unit": {"name": unit.name, "note": unit.note, "key": unit.key},
        "kinds": {k: list(v) for k, v in CATEGORIES.items()},
        "nodes": nodes,
        "order": list(graph),
        "groups": groups,
        "edges": [{"src": u, "dst": v, "port": port} for u, v, port in graph.nx.edges(data="port")],
    }
