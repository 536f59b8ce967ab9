"""The summary table: module path, op, output shape, parameters (and their share), FLOPs (or MACs; and
the useful part where a mask hides some of an attention's work), output memory, with totals at the sizes
they were counted at. Numbers are printed by :mod:`specvit.units`."""

from __future__ import annotations

from specvit.graph.ir import ArchGraph
from specvit.units import FLOPS, FlopUnit, format_count, format_params, format_sizes

__all__ = ["format_table"]


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def format_table(graph: ArchGraph, expand: bool = False, unit: FlopUnit = FLOPS) -> str:
    """The summary of ``graph`` as an aligned text table.

    Columns: path, op, output shape, params, their share of the model's, FLOPs (in ``unit``), the useful
    FLOPs when some attention computes pairs its mask hides, the output's memory in float32, and the repeat
    count of a folded row (whose numbers are per block; totals count every block).

    Args:
        graph: the lowered spec.
        expand: one row per node instead of folding identical blocks.
        unit: :data:`~specvit.units.FLOPS` (a multiply-add counts 2) or :data:`~specvit.units.MACS`.
    """
    useful = graph.masked
    head: tuple[str, ...] = ("path", "op", "output shape", "params", "param %", unit.name)
    head += (f"useful {unit.name}",) * useful + ("output", "x")
    rows = [head]
    total = graph.total_params or 1
    for r in graph.summary(expand=expand):
        shape = "(" + ", ".join(str(d) for d in r.shape) + ")"
        out_bytes = _numel(graph.concrete(r.shape)) * 4 if r.shape else 0
        flops = [format_count(unit.of(n)) if n else "-" for n in (r.flops, r.useful_flops)[: 1 + useful]]
        rows.append(
            (
                r.path,
                r.op,
                shape,
                format_params(r.params) if r.params else "-",
                f"{100 * r.params / total:.1f}%" if r.params else "-",
                *flops,
                f"{format_count(out_bytes)}B" if out_bytes else "-",
                f"x{r.count}" if r.count > 1 else "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    right = set(range(3, len(head) - 1))
    lines = []
    for j, row in enumerate(rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join([*lines, "", *_totals(graph, folded=not expand, unit=unit)])


def _totals(graph: ArchGraph, folded: bool, unit: FlopUnit) -> list[str]:
    """The lines under the table: what folded rows mean, totals exact and short at the sizes they were
    counted at, what the FLOPs count, memory as torchinfo has it."""
    dims = format_sizes(graph.dims)
    activations = (
        sum(_numel(graph.concrete(a["shape"])) for _, a in graph.nx.nodes(data=True) if a["shape"]) * 4
    )
    params = graph.total_params
    lines = []
    if folded and any(r.count > 1 for r in graph.summary()):
        lines.append(
            "xN rows: a run of N identical blocks shown once; their numbers are per block, totals count all"
        )
    flops, useful = unit.of(graph.total_flops), unit.of(graph.total_useful_flops)
    totals = {
        "total params:": f"{params:,} ({format_params(params)}; trainable {params:,}, non-trainable 0)",
        f"total {unit.meaning}:": f"{flops:,} ({format_count(flops)}) at {dims}",
    }
    if graph.masked:
        totals[f"useful {unit.name}:"] = f"{useful:,} ({format_count(useful)}) at {dims}"
    width = max(map(len, totals))
    lines += [f"{label:<{width}} {value}" for label, value in totals.items()]
    notes = dict.fromkeys(n for path in graph.nx if (n := graph.op(path).note(graph[path]["p"])))
    return [
        *lines,
        *(f"  {note}" for note in notes),
        *_outputs(graph),
        f"memory (float32): params {format_count(params * 4)}B, outputs of every node {format_count(activations)}B "
        f"at {dims}",
    ]


def _outputs(graph: ArchGraph) -> list[str]:
    """The line naming each output of a model returning several (a dict), with its shape: the table's
    ``output`` row shows the first one's only."""
    node = graph[graph.output]
    keys = node["p"].keys
    if len(keys) < 2:
        return []
    shapes = {k: "(" + ", ".join(str(d) for d in node["inputs"][k]) + ")" for k in keys}
    return ["outputs: " + ", ".join(f"{k} {s}" for k, s in shapes.items())]
