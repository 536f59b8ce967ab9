"""The summary table: module path, op, output shape, parameters (and their share), FLOPs, output memory,
with totals; and the one number format of every count specvit prints (``1.9K``, ``148.4K``, ``2.4M``)."""

from __future__ import annotations

from specvit.graph.ir import ArchGraph

__all__ = ["format_count", "format_table"]


def format_count(n: int) -> str:
    """One format for every count: exact below 1000, else three significant-ish digits and a unit.

    ``950`` -> ``950``, ``1936`` -> ``1.9K``, ``148_352`` -> ``148.4K``, ``2_362_368`` -> ``2.4M``.

    Args:
        n: the count (parameters, FLOPs, bytes).
    """
    units = (("K", 10**3), ("M", 10**6), ("G", 10**9), ("T", 10**12), ("P", 10**15))
    if abs(n) < 1000:
        return str(n)
    for i, (unit, scale) in enumerate(units):
        shown = round(n / scale, 1)
        if abs(shown) < 1000 or i == len(units) - 1:
            return f"{shown:.1f}{unit}"
    raise AssertionError("unreachable")


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def format_table(graph: ArchGraph, expand: bool = False) -> str:
    """The summary of ``graph`` as an aligned text table.

    Columns: path, op, output shape, params, their share of the model's, FLOPs, the output's memory in
    float32, and the repeat count of a folded row (whose numbers are per block; totals count every block).

    Args:
        graph: the lowered spec.
        expand: one row per node instead of folding identical blocks.
    """
    head = ("path", "op", "output shape", "params", "param %", "FLOPs", "output", "x")
    rows = [head]
    total = graph.total_params or 1
    for r in graph.summary(expand=expand):
        shape = "(" + ", ".join(str(d) for d in r.shape) + ")"
        out_bytes = _numel(graph.concrete(r.shape)) * 4 if r.shape else 0
        rows.append(
            (
                r.path,
                r.op,
                shape,
                format_count(r.params) if r.params else "-",
                f"{100 * r.params / total:.1f}%" if r.params else "-",
                format_count(r.flops) if r.flops else "-",
                f"{format_count(out_bytes)}B" if out_bytes else "-",
                f"x{r.count}" if r.count > 1 else "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    right = {3, 4, 5, 6}
    lines = []
    for j, row in enumerate(rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join([*lines, "", *_totals(graph, folded=not expand)])


def _totals(graph: ArchGraph, folded: bool) -> list[str]:
    """The lines under the table: what folded rows mean, totals exact and short, memory as torchinfo has it."""
    dims = ", ".join(f"{k}={v}" for k, v in graph.dims.items() if "+" not in k)  # S+1 follows from S
    activations = (
        sum(_numel(graph.concrete(a["shape"])) for _, a in graph.nx.nodes(data=True) if a["shape"]) * 4
    )
    params = graph.total_params
    lines = []
    if folded and any(r.count > 1 for r in graph.summary()):
        lines.append(
            "xN rows: a run of N identical blocks shown once; their numbers are per block, totals count all"
        )
    notes = dict.fromkeys(n for path in graph.nx if (n := graph.op(path).note(graph[path]["p"])))
    return [
        *lines,
        f"total params: {params:,} ({format_count(params)}; trainable {params:,}, non-trainable 0)",
        f"total FLOPs:  {graph.total_flops:,} ({format_count(graph.total_flops)}) at {dims}",
        *(f"  {note}" for note in notes),
        f"memory (float32): params {format_count(params * 4)}B, outputs of every node {format_count(activations)}B "
        f"at {dims}",
    ]
