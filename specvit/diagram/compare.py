"""The comparison behind ``specvit diff``: two graphs, node by node and setting by setting, as rows.

:func:`diff_graphs` matches nodes by path and reports each node whose op, resolved settings (every field
of its :class:`~specvit.ops.Params` that is a setting), output shape, parameters, FLOPs or inputs differ,
folded over runs of blocks. What the statuses mean, and what the diagram outlines, is said in
:mod:`specvit.diagram.diff`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from specvit.graph.ir import ArchGraph

__all__ = ["MODEL", "Change", "DiffRow", "diff_graphs", "settings"]

Status = Literal["changed", "reshaped", "rewired", "added", "removed"]
Side = tuple[Any, int, int, int]
MODEL = "model"
"""The path of the row of the graph's own settings (init convention, model kind, sizes)."""

_BLOCK = re.compile(r"^(?P<head>.*\.blocks\.)(?P<i>\d+)(?P<tail>(\..*)?)$")
_GRAPH_SETTINGS = ("init", "kind", "dims")


@dataclass(frozen=True)
class Change:
    """One field that differs: a setting of the node's op, or its ``op``, ``shape`` or ``inputs``.

    Attributes:
        field: the setting's name as its op's params dataclass spells it (``heads``, ``eps``), or ``op``,
            ``shape``, ``inputs`` (what the node reads: names inside its block, ``x`` for the block's input).
        before: the value in A.
        after: the value in B.
        per_block: the setting varies along the depth: ``before`` and ``after`` hold one value per block of
            the row (:attr:`DiffRow.paths`).
    """

    field: str
    before: Any
    after: Any
    per_block: bool = False


@dataclass
class DiffRow:
    """One difference: a node (or a block, or a run of them) and its before and after.

    Attributes:
        status: changed, reshaped, rewired, added or removed (see the module's docstring).
        path: the node's or block's path; a folded run reads ``encoder.blocks.0-11.attn``.
        op: the op kind (``block`` for a whole block, ``model`` for the graph's own settings).
        before: (shape, params, FLOPs, useful FLOPs) in A, or None.
        after: (shape, params, FLOPs, useful FLOPs) in B, or None.
        changes: the fields that differ, settings in their dataclass's order.
        count: how many nodes or blocks the row stands for.
        paths: the node paths it stands for (in B where present, else in A).
        category: the colour category of the op (``norm``, ``attention`` ...), or empty.
    """

    status: Status
    path: str
    op: str
    before: Side | None
    after: Side | None
    changes: list[Change] = field(default_factory=list)
    count: int = 1
    paths: list[str] = field(default_factory=list)
    category: str = ""


def settings(p: Any) -> dict[str, tuple[Any, bool]]:
    """The settings of a node's params: field name -> (value, whether it varies along the depth).

    Args:
        p: a frozen :class:`~specvit.ops.Params` dataclass.
    """
    return {
        f.name: (getattr(p, f.name), bool(f.metadata.get("varies", False)))
        for f in dataclasses.fields(p)
        if f.metadata.get("setting", True)
    }


def _setting_changes(pa: Any, pb: Any) -> list[Change]:
    """The settings that differ; for params of two types (another op), those both have."""
    sa, sb = settings(pa), settings(pb)
    out = []
    for name, (va, varies) in sa.items():
        if name not in sb:
            continue
        vb = sb[name][0]
        if va != vb:
            out.append(Change(name, (va,) if varies else va, (vb,) if varies else vb, varies))
    return out


def _side(g: ArchGraph, n: str) -> Side:
    a = g[n]
    return (tuple(a["shape"]), int(a["params"]), int(a["flops"]), int(a["useful_flops"]))


def _block_totals(g: ArchGraph, block: str) -> Side:
    nodes = [n for n in g if g[n]["block"] == block]
    params, flops, useful = (sum(int(g[n][k]) for n in nodes) for k in ("params", "flops", "useful_flops"))
    return (g[nodes[-1]]["shape"], params, flops, useful)


def _reads(g: ArchGraph, n: str) -> tuple[str, ...]:
    """What the node reads: ``port=source``, sources inside its block by their names there, the block's
    input as ``x`` (a side value as what its stack calls it, ``mask``), others by path, block indices
    starred (the last block feeding the final norm is no rewiring)."""
    block, out = g[n]["block"], []
    for u, _, port in g.nx.in_edges(n, data="port"):
        if block is not None and g[u]["block"] == block:
            src = u[len(block) + 1 :]
        elif block is not None:
            src = g[u].get("sides", {}).get(g[n]["stack"], "x")
        else:
            src = re.sub(r"\.blocks\.\d+", ".blocks.*", u)
        out.append(src if port == "x" else f"{port}={src}")
    return tuple(sorted(out))


def _feeds(g: ArchGraph, n: str) -> tuple[str, ...]:
    """What reads the node: nodes of its block by their names there, ``out`` for the block's output (a
    node outside blocks: by path, block indices starred)."""
    block = g[n]["block"]
    if block is None:
        return tuple(sorted({re.sub(r"\.blocks\.\d+", ".blocks.*", v) for v in g.nx.successors(n)}))
    return tuple(
        sorted({v[len(block) + 1 :] if g[v]["block"] == block else "out" for v in g.nx.successors(n)})
    )


def _compare(a: ArchGraph, b: ArchGraph, n: str) -> DiffRow | None:
    """The row of a node on both sides, or None when it is the same in every setting."""
    na, nb = a[n], b[n]
    changes = [Change("op", na["op"], nb["op"])] if na["op"] != nb["op"] else []
    changes += _setting_changes(na["p"], nb["p"])
    before, after = _side(a, n), _side(b, n)
    own = bool(changes) or before[1] != after[1]
    if before[0] != after[0] and Change("shape", before[0], after[0]) not in changes:  # an input's own
        name = "output shape" if any(c.field == "shape" for c in changes) else "shape"
        changes.append(Change(name, before[0], after[0]))
    reads_a, reads_b = _reads(a, n), _reads(b, n)
    if reads_a != reads_b:
        changes.append(Change("inputs", reads_a, reads_b))
        feeds_a, feeds_b = _feeds(a, n), _feeds(b, n)
        if b.op(n).category == "norm" and feeds_a != feeds_b:  # where a norm sits: what it reads and feeds
            changes.append(Change("feeds", feeds_a, feeds_b))
    if not changes and before == after:
        return None
    status: Status = "changed" if own else "rewired" if reads_a != reads_b else "reshaped"
    return DiffRow(status, n, nb["op"], before, after, changes, category=b.op(n).category)


def _graph_row(a: ArchGraph, b: ArchGraph) -> DiffRow | None:
    """The graph's own settings: the init convention, the model kind, the sizes FLOPs are counted at."""
    changes = [
        Change(k, getattr(a, k), getattr(b, k)) for k in _GRAPH_SETTINGS if getattr(a, k) != getattr(b, k)
    ]
    return DiffRow("changed", MODEL, MODEL, None, None, changes, paths=[MODEL]) if changes else None


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
    for n in _merged_order(a, b):
        in_a, in_b = n in a, n in b
        g = b if in_b else a
        block = g[n]["block"]
        if block and (block in blocks_a) != (block in blocks_b):  # a block on one side only
            if block not in done:
                done.add(block)
                side = _block_totals(g, block)
                status: Status = "added" if in_b else "removed"
                rows.append(DiffRow(status, block, "block", None if in_b else side, side if in_b else None))
            continue
        if in_a and in_b:
            row = _compare(a, b, n)
            if row is not None:
                rows.append(row)
        else:
            status = "added" if in_b else "removed"
            before, after = (None, _side(b, n)) if in_b else (_side(a, n), None)
            rows.append(DiffRow(status, n, g[n]["op"], before, after, category=g.op(n).category))
    for r in rows:
        r.paths = [r.path]
    return rows


def _fold_key(r: DiffRow) -> tuple[Any, ...]:
    """What must be equal for two rows to fold: everything but the values of settings that vary."""
    changes = tuple((c.field, c.per_block or repr((c.before, c.after))) for c in r.changes)  # hashable
    return (r.status, r.op, r.before, r.after, changes)


def _fold(rows: list[DiffRow]) -> list[DiffRow]:
    """Rows of one node's template that differ alike, in blocks at a constant step, become one row:
    ``blocks.0-11`` (every block), ``blocks.0,2,4`` (every second, as Swin's shifted windows alternate)."""
    out: list[DiffRow] = []
    for r in rows:
        m = _BLOCK.match(r.path)
        prev = out[-1] if out else None
        if m and prev is not None and _fold_key(prev) == _fold_key(r):
            indexes = [int(_index(p)) for p in prev.paths]
            step = indexes[1] - indexes[0] if len(indexes) > 1 else int(m["i"]) - indexes[0]
            if step > 0 and int(m["i"]) == indexes[-1] + step:
                prev.paths.append(r.path)
                prev.count += 1
                shown = f"{indexes[0]}-{m['i']}" if step == 1 else ",".join(map(str, [*indexes, m["i"]]))
                prev.path = f"{m['head']}{shown}{m['tail']}"
                prev.changes = [
                    Change(c.field, c.before + d.before, c.after + d.after, True) if c.per_block else c
                    for c, d in zip(prev.changes, r.changes, strict=True)
                ]
                continue
        out.append(r)
    return out


def _index(path: str) -> str:
    m = _BLOCK.match(path)
    assert m is not None
    return m["i"]


def diff_graphs(a: ArchGraph, b: ArchGraph) -> list[DiffRow]:
    """The differences from ``a`` to ``b``, folded over runs of blocks, in execution order.

    Args:
        a: the graph before.
        b: the graph after.

    Returns:
        The rows; empty when the two graphs are equal in every setting, shape, count and wire.
    """
    rows = _node_rows(a, b)
    by_template: dict[tuple[Any, ...], list[DiffRow]] = {}
    singles: list[DiffRow] = []
    for r in rows:  # gather each node's rows across blocks, so that a run folds whatever lies between
        m = _BLOCK.match(r.path)
        if m:
            by_template.setdefault((m["head"], m["tail"], _fold_key(r)), []).append(r)
        else:
            singles.append(r)
    folded = [f for group in by_template.values() for f in _fold(group)]
    position = {id(r): i for i, r in enumerate(rows)}
    out = sorted([*singles, *folded], key=lambda r: position[id(r)])
    model = _graph_row(a, b)
    return [model, *out] if model is not None else out
