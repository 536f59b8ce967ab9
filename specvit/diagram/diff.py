"""``specvit diff A B``: what changes between two models, node by node and setting by setting.

Nodes are matched by path (module paths are node paths, so they are the state_dict's names too). For a
node on both sides the diff compares its op, every resolved setting (each field of its op's frozen
:class:`~specvit.ops.Params`: heads, head_dim, activation, eps, windows, biases, rates ...), its output
shape, parameters and FLOPs, and what it reads; the graph's own settings (the init convention, the model
kind, the sizes FLOPs are counted at) are compared as the row ``model``. Settings are read generically
from the dataclass fields, never from a list of ops, so a field added to an op is compared from then on.
A field declared ``metadata={"setting": False}`` (a KV-cache layer index: a position the lowering counts)
is not a setting and is not compared; a field that ``varies`` along the depth (dropout and
stochastic-depth rates) is one, and a folded run shows its range (``p 0.0091..0.1 -> 0.018..0.2``).

A row's status says where a difference comes from:

- *changed*: the node's own op, settings or parameter count differ (``heads 3 -> 6``);
- *reshaped*: its op and settings are the same, but its output shape or FLOPs differ because what flows
  into it does (every block after a larger image); listed so that the rows account for the totals;
- *rewired*: the same settings, but the node reads other nodes (pre- and post-norm blocks hold the same
  nodes, wired differently), whatever its shape; nodes are named as in their block (``x`` its input,
  ``out`` its output), and a norm's row says ``norm placement``, what it reads and what reads it;
- *added*, *removed*: a node or a whole block present on one side only.

Two models are the same only when there is no row. Runs of blocks that change alike fold into one row
(``encoder.blocks.0-11.attn``), as the summary folds repeats.

``diff -o`` outlines in B's diagram the nodes that differ by themselves: changed, rewired and added ones.
A node reshaped only because of a change upstream is not outlined (a larger image outlines the input, the
patch embedding and the position table, not every block after them); the text lists it. In the collapsed
view a folded run is drawn as its first block, outlined when a block of the run is.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from specvit.diagram.compare import MODEL, Change, DiffRow, diff_graphs
from specvit.diagram.scene import View, plan
from specvit.graph.ir import ArchGraph
from specvit.units import FLOPS, FlopUnit, format_count, format_flops, format_params, format_sizes

__all__ = [
    "Change",
    "DiffRow",
    "change_text",
    "diff_graphs",
    "diff_json",
    "format_diff",
    "highlight",
    "marked",
]

OUTLINED = ("changed", "rewired", "added")
"""The statuses ``diff -o`` outlines."""


def show(v: Any) -> str:
    """A setting's value as a spec writes it: ``none``, ``true``, ``1e-06``, ``(B, 197, 192)``."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, tuple | list):
        return "(" + ", ".join(show(x) for x in v) + ")"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return type(v).__name__ + show(dataclasses.astuple(v))
    return str(v) if v != "" else '""'


def _span(values: tuple[Any, ...]) -> str:
    """Per-block values of a folded run: one value, or the first and the last."""
    first, last = values[0], values[-1]
    return show(first) if all(v == first for v in values) else f"{show(first)}..{show(last)}"


def change_text(c: Change) -> str:
    """One change in words: ``heads 3 -> 6``, ``window 7 -> none``, ``reads add1 -> x``."""
    if c.field in ("inputs", "feeds"):
        verb = "reads" if c.field == "inputs" else "feeds"
        gone = [x for x in c.before if x not in c.after]  # what both sides read is left unsaid
        new = [x for x in c.after if x not in c.before]
        return f"{verb} {', '.join(gone) or 'nothing'} -> {', '.join(new) or 'nothing'}"
    before, after = (_span(c.before), _span(c.after)) if c.per_block else (show(c.before), show(c.after))
    if before == after:  # two floats alike to 6 digits
        before, after = repr(c.before), repr(c.after)
    return f"{c.field} {before} -> {after}"


def _side(v: tuple[Any, int, int, int] | None) -> str:
    if v is None:
        return "-"
    return f"{show(v[0])}, {format_params(v[1])} params"


def row_text(r: DiffRow) -> str:
    """What a row says changed: its changes, or for a node on one side only its shape and parameters."""
    if r.status in ("added", "removed"):
        return _side(r.after if r.status == "added" else r.before) + " each" * (r.count > 1)
    text = "; ".join(change_text(c) for c in r.changes)
    if r.category == "norm" and any(c.field == "inputs" for c in r.changes):
        text = "norm placement: " + text
    return text


def _delta(n: int, fmt: Callable[[int], str] = format_count) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + fmt(abs(n))


def _totals(g: ArchGraph, unit: FlopUnit) -> str:
    """``86.6M params  35.1G FLOPs (2 x MACs) at B=1``: a model's totals, the sizes they were counted at."""
    flops = format_flops(g.total_flops, unit, useful=g.total_useful_flops, define=True)
    return f"{format_params(g.total_params)} params  {flops} at {format_sizes(g.dims)}"


def format_diff(a: ArchGraph, b: ArchGraph, rows: list[DiffRow] | None = None, unit: FlopUnit = FLOPS) -> str:
    """The diff as text: totals with deltas, then one line per (folded) difference.

    Args:
        a: the graph before.
        b: the graph after.
        rows: the differences; default :func:`diff_graphs`.
        unit: what FLOPs are printed in; with a model whose attention masks hide pairs, the useful FLOPs'
            deltas are printed too.
    """
    rows = diff_graphs(a, b) if rows is None else rows
    useful = a.masked or b.masked
    dp, df = b.total_params - a.total_params, unit.of(b.total_flops - a.total_flops)
    du = f" (useful {_delta(unit.of(b.total_useful_flops - a.total_useful_flops))})" * useful
    lines = [
        f"A: {a.name}  {_totals(a, unit)}",
        f"B: {b.name}  {_totals(b, unit)}",
        f"B - A: {_delta(dp, format_params)} params, {_delta(df)} {unit.name}{du}; "
        f"{len(rows)} difference{'s' * (len(rows) != 1)}",
    ]
    if not rows:
        return "\n".join([*lines, "the two models are the same, node for node"])
    table: list[tuple[str, ...]] = [("", "path", "op", "what changed", "params", unit.name)]
    table[0] += (f"useful {unit.name}",) * useful
    for r in rows:
        (_, pa, fa, ua), (_, pb, fb, ub) = r.before or (None, 0, 0, 0), r.after or (None, 0, 0, 0)
        deltas = [_delta(unit.of(d) * r.count) for d in (fb - fa, ub - ua)[: 1 + useful]]
        table.append(
            (
                r.status,
                r.path,
                r.op,
                row_text(r),
                _delta((pb - pa) * r.count, format_params),
                *deltas,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    body = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    return "\n".join([*lines, "", *body])


def _jsonable(v: Any) -> Any:
    """A value as JSON data: tuples as lists, dataclasses as objects, anything else not JSON as text."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, tuple | list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _jsonable(dataclasses.asdict(v))
    return str(v)


def row_json(r: DiffRow, unit: FlopUnit = FLOPS) -> dict[str, Any]:
    """A row as JSON data: status, path, op, the nodes it stands for, its two sides and, per field, the
    value before and after (per block, aligned with ``paths``, for a setting that varies).

    Args:
        r: the row.
        unit: what the sides' FLOPs are given in, under keys named for it (``flops``, ``useful_flops``).
    """

    def side(v: tuple[Any, int, int, int] | None) -> dict[str, Any] | None:
        if v is None:
            return None
        return {
            "shape": _jsonable(v[0]),
            "params": v[1],
            unit.key: unit.of(v[2]),
            f"useful_{unit.key}": unit.of(v[3]),
        }

    changes = {
        c.field: {"before": _jsonable(c.before), "after": _jsonable(c.after), "per_block": c.per_block,
                  "text": change_text(c)}
        for c in r.changes
    }  # fmt: skip
    return {"status": r.status, "path": r.path, "op": r.op, "count": r.count, "paths": r.paths,
            "before": side(r.before), "after": side(r.after), "changes": changes,
            "text": row_text(r)}  # fmt: skip


def diff_json(
    a: ArchGraph, b: ArchGraph, rows: list[DiffRow] | None = None, unit: FlopUnit = FLOPS
) -> dict[str, Any]:
    """The diff as JSON data: what FLOPs count (``unit``), each model's name, totals and the sizes they were
    counted at (``dims``), ``same``, and the rows (:func:`row_json`).

    Args:
        a: the graph before.
        b: the graph after.
        rows: the differences; default :func:`diff_graphs`.
        unit: what FLOPs are given in, under keys named for it (``flops``, ``useful_flops``; ``macs`` ...).
    """
    rows = diff_graphs(a, b) if rows is None else rows
    side = {
        g: {"name": x.name, "params": x.total_params, unit.key: unit.of(x.total_flops),
            f"useful_{unit.key}": unit.of(x.total_useful_flops), "dims": x.dims}
        for g, x in (("a", a), ("b", b))
    }  # fmt: skip
    return {"unit": unit.meaning, **side, "same": not rows, "rows": [row_json(r, unit) for r in rows]}


def marked(rows: list[DiffRow], b: ArchGraph, view: View = "collapsed") -> set[str]:
    """The boxes of B's diagram that ``diff -o`` outlines: the nodes changed, rewired or added (whole
    added blocks: all their nodes), each as the box that draws it in ``view``.

    Args:
        rows: the differences from :func:`diff_graphs`.
        b: the graph after, the one drawn.
        view: ``collapsed`` or ``expanded``, as drawn.
    """
    drawn = plan(b, view).drawn
    out: set[str] = set()
    for r in rows:
        if r.status not in OUTLINED or r.path == MODEL:
            continue
        for p in r.paths:
            for n in [p] if p in b else [n for n in b if b[n]["block"] == p]:
                if n in drawn:
                    out.add(drawn[n])
    return out


_NODE = re.compile(r'^\s*(?:"(?P<q>[^"]+)"|(?P<p>[\w.]+))\s*\[')


def highlight(dot: str, boxes: set[str]) -> str:
    """``dot`` with the given boxes outlined in red.

    Args:
        dot: the DOT text of B's diagram.
        boxes: the box ids to outline, from :func:`marked`.
    """
    out = []
    for line in dot.splitlines():
        m = _NODE.match(line)
        if m and (m["q"] or m["p"]) in boxes and line.rstrip().endswith("]"):
            line = line[: line.rfind("]")] + ' color="#d62728" penwidth=3]'
        out.append(line)
    return "\n".join(out) + ("\n" if dot.endswith("\n") else "")
