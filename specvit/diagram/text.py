"""The summary table: module path, op, output shape, parameters, FLOPs, with totals."""

from __future__ import annotations

from specvit.graph.ir import ArchGraph

__all__ = ["format_count", "format_table"]


def format_count(n: int) -> str:
    """``86567656`` -> ``86.6M``; exact below 10,000."""
    for unit, scale in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale and n >= 10_000:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def format_table(graph: ArchGraph, expand: bool = False) -> str:
    """The summary of ``graph`` as an aligned text table.

    Args:
        graph: the lowered spec.
        expand: one row per node instead of folding identical blocks.
    """
    head = ("path", "op", "output shape", "params", "FLOPs", "x")
    rows = [head]
    for r in graph.summary(expand=expand):
        shape = "(" + ", ".join(str(d) for d in r.shape) + ")"
        count = f"x{r.count}" if r.count > 1 else ""
        rows.append(
            (
                r.path,
                r.op,
                shape,
                f"{r.params:,}" if r.params else "-",
                format_count(r.flops) if r.flops else "-",
                count,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    right = {3, 4}
    lines = []
    for j, row in enumerate(rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    dims = ", ".join(f"{k}={v}" for k, v in graph.dims.items() if "+" not in k)  # S+1 follows from S
    lines.append("")
    lines.append(f"total params: {graph.total_params:,}")
    lines.append(f"total FLOPs:  {graph.total_flops:,} ({format_count(graph.total_flops)}) at {dims}")
    return "\n".join(lines)
