"""``specvit diff A B``: what changes between two models, node by node, with parameter and FLOP deltas.

Nodes are matched by path (module paths are node paths, so they are the state_dict's names too). A
node is *changed* when its op, output shape, parameters or FLOPs differ, *rewired* when only its inputs
do (pre- and post-norm blocks hold the same nodes, wired differently); whole blocks present on one
side only are reported as blocks; runs of blocks that change alike fold into one row
(``encoder.blocks.0-11.attn``), as the summary folds repeats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from specvit.diagram.text import format_count
from specvit.graph.ir import ArchGraph

__all__ = ["DiffRow", "diff_graphs", "format_diff", "highlight"]

Status = Literal["changed", "rewired", "added", "removed"]
_BLOCK = re.compile(r"^(?P<head>.*\.blocks\.)(?P<i>\d+)(?P<tail>(\..*)?)$")


@dataclass
class DiffRow:
    """One difference: a node (or a block, or a run of them) and its before and after.

    Attributes:
        status: changed, rewired (same node, other inputs), added (in B only) or removed (in A only).
        path: the node's or block's path; a folded run reads ``encoder.blocks.0-11.attn``.
        op: the op kind (``block`` for a whole block).
        before: (shape, params, FLOPs) in A, or None.
        after: (shape, params, FLOPs) in B, or None.
        count: how many nodes or blocks the row stands for.
        paths: the node paths it stands for (in B where present, else in A).
    """

    status: Status
    path: str
    op: str
    before: tuple[Any, int, int] | None
    after: tuple[Any, int, int] | None
    count: int = 1
    paths: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON-ready data."""

        def side(v: tuple[Any, int, int] | None) -> dict[str, Any] | None:
            return None if v is None else {"shape": list(v[0]), "params": v[1], "flops": v[2]}

        return {"status": self.status, "path": self.path, "op": self.op, "count": self.count,
                "before": side(self.before), "after": side(self.after)}  # fmt: skip


def _info(g: ArchGraph, n: str) -> tuple[Any, int, int]:
    a = g[n]
    return (tuple(a["shape"]), int(a["params"]), int(a["flops"]))


def _block_totals(g: ArchGraph, block: str) -> tuple[Any, int, int]:
    nodes = [n for n in g if g[n]["block"] == block]
    return (g[nodes[-1]]["shape"], sum(g[n]["params"] for n in nodes), sum(g[n]["flops"] for n in nodes))


def _inputs(g: ArchGraph, n: str) -> list[str]:
    """The node's inputs, block indices left out: the last block feeding the final norm is no rewiring."""
    return sorted(re.sub(r"\.blocks\.\d+", ".blocks.*", p) for p in g.nx.predecessors(n))


def _merged_order(a: ArchGraph, b: ArchGraph) -> list[str]:
    """A's nodes in execution order, each node of B alone placed after its predecessor in B."""
    order = list(a)
    where = {n: i for i, n in enumerate(order)}
    previous = None
    inserts: dict[str | None, list[str]] = {}
    for n in b:
        if n in where:
            previous = n
        else:
            inserts.setdefault(previous, []).append(n)
    out = inserts.get(None, [])[:]
    for n in order:
        out.append(n)
        out.extend(inserts.get(n, []))
    return out


def _node_rows(a: ArchGraph, b: ArchGraph) -> list[DiffRow]:
    """Every difference, one row per node, whole one-sided blocks as one row each, in execution order."""
    blocks_a = {a[n]["block"] for n in a if a[n]["block"]}
    blocks_b = {b[n]["block"] for n in b if b[n]["block"]}
    rows: list[DiffRow] = []
    done: set[str] = set()
    order = _merged_order(a, b)
    for n in order:
        in_a, in_b = n in a, n in b
        block = (b[n] if in_b else a[n])["block"]
        if block and (block in blocks_a) != (block in blocks_b):  # a block on one side only
            if block not in done:
                done.add(block)
                side = _block_totals(b if in_b else a, block)
                status: Status = "added" if in_b else "removed"
                rows.append(DiffRow(status, block, "block", None if in_b else side, side if in_b else None))
            continue
        if in_a and in_b:
            before, after = _info(a, n), _info(b, n)
            if before != after or a[n]["op"] != b[n]["op"]:
                rows.append(DiffRow("changed", n, b[n]["op"], before, after))
            elif _inputs(a, n) != _inputs(b, n):
                rows.append(DiffRow("rewired", n, b[n]["op"], before, after))
        elif in_b:
            rows.append(DiffRow("added", n, b[n]["op"], None, _info(b, n)))
        else:
            rows.append(DiffRow("removed", n, a[n]["op"], _info(a, n), None))
    for r in rows:
        r.paths = [r.path]
    return rows


def _fold(rows: list[DiffRow]) -> list[DiffRow]:
    """Runs of consecutive blocks that differ alike become one row with a block range."""
    out: list[DiffRow] = []
    for r in rows:
        m = _BLOCK.match(r.path)
        prev = out[-1] if out else None
        if m and prev is not None:
            pm = _BLOCK.match(prev.paths[-1])
            same = (prev.status, prev.op, prev.before, prev.after) == (r.status, r.op, r.before, r.after)
            if (pm and same and pm["head"] == m["head"] and pm["tail"] == m["tail"]
                    and int(m["i"]) == int(pm["i"]) + 1):  # fmt: skip
                first = _BLOCK.match(prev.paths[0])
                assert first is not None
                prev.paths.append(r.path)
                prev.count += 1
                prev.path = f"{m['head']}{first['i']}-{m['i']}{m['tail']}"
                continue
        out.append(r)
    return out


def diff_graphs(a: ArchGraph, b: ArchGraph) -> list[DiffRow]:
    """The differences from ``a`` to ``b``, folded over runs of blocks, in execution order.

    Args:
        a: the graph before.
        b: the graph after.
    """
    rows = _node_rows(a, b)
    by_template: dict[tuple[Any, ...], list[DiffRow]] = {}
    singles: list[DiffRow] = []
    for r in rows:  # gather each node's rows across blocks, so that a run folds whatever lies between
        m = _BLOCK.match(r.path)
        if m:
            key = (m["head"], m["tail"], r.status, r.op, r.before, r.after)
            by_template.setdefault(key, []).append(r)
        else:
            singles.append(r)
    folded = [f for group in by_template.values() for f in _fold(group)]
    position = {id(r): i for i, r in enumerate(rows)}
    return sorted([*singles, *folded], key=lambda r: position[id(r)])


def _side(v: tuple[Any, int, int] | None) -> str:
    if v is None:
        return "-"
    shape = "(" + ", ".join(str(d) for d in v[0]) + ")"
    return f"{shape} {format_count(v[1])} params"


def _delta(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + format_count(abs(n))


def format_diff(a: ArchGraph, b: ArchGraph, rows: list[DiffRow] | None = None) -> str:
    """The diff as text: totals with deltas, then one line per (folded) difference.

    Args:
        a: the graph before.
        b: the graph after.
        rows: the differences; default :func:`diff_graphs`.
    """
    rows = diff_graphs(a, b) if rows is None else rows
    dp, df = b.total_params - a.total_params, b.total_flops - a.total_flops
    lines = [
        f"A: {a.name}  {format_count(a.total_params)} params  {format_count(a.total_flops)} FLOPs",
        f"B: {b.name}  {format_count(b.total_params)} params  {format_count(b.total_flops)} FLOPs",
        f"B - A: {_delta(dp)} params, {_delta(df)} FLOPs; {len(rows)} difference{'s' * (len(rows) != 1)}",
    ]
    if not rows:
        return "\n".join([*lines, "the two models are the same, node for node"])
    table = [("", "path", "op", "A", "B", "params", "FLOPs")]
    for r in rows:
        before = r.before or (None, 0, 0)
        after = r.after or (None, 0, 0)
        table.append((r.status, r.path, r.op, _side(r.before), _side(r.after),
                      _delta((after[1] - before[1]) * r.count),
                      _delta((after[2] - before[2]) * r.count)))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    body = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    return "\n".join([*lines, "", *body])


_NODE = re.compile(r'^\s*(?:"(?P<q>[^"]+)"|(?P<p>[\w.]+))\s*\[')


def highlight(dot: str, rows: list[DiffRow]) -> str:
    """``dot`` (a diagram of B) with the nodes that changed or were added outlined in red.

    In the collapsed view, a folded run of blocks is drawn as its first block; it is marked when any
    block of the run differs. Removed nodes are not in B's diagram; the text diff lists them.

    Args:
        dot: the DOT text of B's diagram.
        rows: the differences from :func:`diff_graphs`.
    """
    marked: set[str] = set()
    for r in rows:
        if r.status == "removed":
            continue
        for p in r.paths:
            marked.add(p)
            m = _BLOCK.match(p)
            if m:
                marked.add(f"{m['head']}0{m['tail']}")
    out = []
    for line in dot.splitlines():
        m = _NODE.match(line)
        if m and (m["q"] or m["p"]) in marked and line.rstrip().endswith("]"):
            line = line[: line.rfind("]")] + ' color="#d62728" penwidth=3]'
        out.append(line)
    return "\n".join(out) + ("\n" if dot.endswith("\n") else "")
