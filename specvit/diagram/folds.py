"""How the collapsed view draws a stack's blocks, in execution order.

- A run of identical blocks (:meth:`~specvit.graph.ir.ArchGraph.fold`) is one ``folded`` cluster captioned
  ``x N``, and a block whose weights later layers share is drawn once with the number of its runs.
- A run repeating a pattern of P blocks (a local/global schedule, Swin's plain and shifted windows) is a
  ``repeat`` frame captioned ``x N`` around the P blocks of its first period, in the order they run;
  equal blocks next to each other inside the pattern fold again (five sliding-window layers, one global).
  Whatever follows the last whole period is drawn after the frame, as a run or blocks of its own.
- A stage whose blocks repeat the structure of an earlier stage of the stack, sizes aside (Swin's stages
  1-3 after stage 0), is one box naming the blocks drawn in full that it repeats, and what differs.

The expanded view draws every block in a cluster of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specvit.graph.ir import ArchGraph

__all__ = ["Frame", "Grouping", "Stage", "group_blocks"]


@dataclass(frozen=True)
class Frame:
    """A cluster drawn around blocks.

    Args:
        id: a unique name: the block's path, or the block range a frame spans.
        title: the caption, ``"decoder.blocks.0-8  x3"``.
        note: the smaller second caption line (parameters).
        kind: ``block`` (one block), ``folded`` (equal blocks drawn once), ``repeat`` (a pattern of blocks
            drawn once, in order) or ``pipeline`` (the blocks of one pipeline stage).
    """

    id: str
    title: str
    note: str
    kind: str


@dataclass(frozen=True)
class Stage:
    """A stage drawn as one box: its blocks repeat blocks drawn in full earlier in the stack, sizes aside.

    Args:
        id: the box's id: the stage's path (``encoder.stages.2``) when the box also draws the nodes before
            its blocks, else the blocks' range (``encoder.stages.1.blocks.0-1``).
        nodes: the graph nodes it draws, in execution order.
        blocks: the blocks it draws, in order.
        like: the range of the blocks drawn in full that they repeat (``encoder.stages.0.blocks.0-1``).
        lead: what the box says of the nodes before the blocks (``downsample as in encoder.stages.1``),
            or empty when they are drawn as boxes of their own (or there are none).
        details: what differs from the nodes drawn in full, one ``node: label line`` each
            (``attn: heads 12 · kv_heads 12 · head_dim 32``).
    """

    id: str
    nodes: tuple[str, ...]
    blocks: tuple[str, ...]
    like: tuple[str, ...]
    lead: str
    details: tuple[str, ...]

    @property
    def summary(self) -> str:
        """``6 blocks: encoder.stages.0.blocks.0-1 x3``: how many blocks, and which drawn blocks they repeat."""
        n, k = len(self.blocks), len(self.like)
        count = f"{n} block{'s' * (n > 1)}"
        if n == k == 1:
            return f"as {self.like[0]}"
        if n == k:
            return f"{count} as {_span(list(self.like))}"
        if n % k == 0:
            return f"{count}: {_span(list(self.like))} x{n // k}"
        return f"{count} like {_span(list(self.like))}"


@dataclass
class Grouping:
    """How each block is drawn.

    Args:
        rep: block -> the block drawn for it, for a block drawn as another.
        run: block -> the run it folds into (blocks of one run share it).
        frames: drawn block -> the clusters around it, outermost first, its own last.
        stages: graph node -> the box drawing it, for the nodes of a stage drawn as an earlier one.
    """

    rep: dict[str, str] = field(default_factory=dict)
    run: dict[str, str] = field(default_factory=dict)
    frames: dict[str, list[Frame]] = field(default_factory=dict)
    stages: dict[str, Stage] = field(default_factory=dict)


def _index(block: str) -> str:
    return block.rsplit(".", 1)[1]


def _span(blocks: list[str]) -> str:
    """``["d.blocks.0", ..., "d.blocks.8"]`` -> ``"d.blocks.0-8"``; one block is its own path."""
    if len(blocks) == 1:
        return blocks[0]
    return f"{blocks[0].rsplit('.', 1)[0]}.{_index(blocks[0])}-{_index(blocks[-1])}"


def group_blocks(
    graph: ArchGraph,
    params: Callable[[str], str],
    *,
    collapsed: bool = True,
    stages: bool = True,
    pipeline: Sequence[Sequence[str]] = (),
) -> Grouping:
    """How the blocks of ``graph`` are drawn.

    Args:
        graph: the lowered spec.
        params: a block path -> its parameters as captions print them (``"7.1M params"``).
        collapsed: fold repeated blocks; False draws every block in its own cluster.
        stages: draw a stage repeating an earlier one's structure as one box (collapsed view only).
        pipeline: the blocks of each pipeline stage, in order: each stage's blocks are drawn inside a frame
            of their own, and no run folds across two stages.
    """
    out = _group(graph, params, collapsed, stages and not pipeline, pipeline)
    for i, part in enumerate(pipeline):
        frame = Frame(
            f"pipeline.{i}", f"pipeline stage {i}: {_span(list(part))}", f"{len(part)} blocks", "pipeline"
        )
        for b in part:
            if b in out.frames:
                out.frames[b].insert(0, frame)
    return out


def _group(
    graph: ArchGraph,
    params: Callable[[str], str],
    collapsed: bool,
    stages: bool,
    pipeline: Sequence[Sequence[str]],
) -> Grouping:
    """:func:`group_blocks` without the pipeline's frames."""
    out = Grouping()
    blocks = [
        b
        for stack in dict.fromkeys(a["stack"] for _, a in graph.nx.nodes(data=True))
        for b in graph.blocks(stack)
    ]
    if not collapsed:
        out.frames = {b: [Frame(b, b, params(b), "block")] for b in blocks}
        return out
    if stages:
        out.stages = _stages(graph)
    staged = {b for stage in out.stages.values() for b in stage.blocks}
    fold = (
        graph.fold_in_parts({b: i for i, part in enumerate(pipeline) for b in part})
        if pipeline
        else graph.fold()
    )
    shared = graph.shared()
    runs: dict[str, list[str]] = {}
    for b in blocks:
        if b in staged:
            continue
        if b in fold:
            out.run[b] = fold[b].run
            runs.setdefault(fold[b].run, []).append(b)
        elif b in shared:
            title = f"{b}  x{len(shared[b]) + 1}"
            out.frames[b] = [Frame(b, title, f"{params(b)} · shared weights", "folded")]
        else:
            out.frames[b] = [Frame(b, b, params(b), "block")]
    for run in runs.values():
        reps = list(dict.fromkeys(fold[b].rep for b in run))
        count = fold[run[0]].count
        if len(reps) == 1:
            out.frames[reps[0]] = [
                Frame(reps[0], f"{fold[reps[0]].label}  x{count}", f"{params(reps[0])} per block", "folded")
            ]
        else:
            _pattern(graph, reps, run, count, params, out)
        for b in run:
            out.rep[b] = out.rep.get(fold[b].rep, fold[b].rep)
    out.rep = {b: r for b, r in out.rep.items() if r != b}
    return out


def _pattern(
    graph: ArchGraph, reps: list[str], run: list[str], count: int, params: Callable[[str], str], out: Grouping
) -> None:
    """The frame of a run repeating ``reps`` ``count`` times; equal neighbours inside it fold again."""
    span = _span(run)
    frame = Frame(span, f"{span}  x{count}", f"a pattern of {len(reps)} blocks, in order", "repeat")
    groups: list[list[str]] = []
    for r in reps:
        if groups and graph.signature(groups[-1][0]) == graph.signature(r):
            groups[-1].append(r)
        else:
            groups.append([r])
    for group in groups:
        first = group[0]
        if len(group) == 1:
            out.frames[first] = [frame, Frame(first, first, params(first), "block")]
        else:
            title = f"{_span(group)}  x{len(group)}"
            out.frames[first] = [frame, Frame(first, title, f"{params(first)} per block", "folded")]
        for r in group[1:]:
            out.rep[r] = first


def _structure(graph: ArchGraph, nodes: list[str], prefix: str) -> tuple[Any, ...]:
    """The ops and wiring of ``nodes`` named below ``prefix``, their sizes aside."""
    local = {n: n[len(prefix) :] for n in nodes}
    return tuple(
        (
            local[n],
            graph[n]["op"],
            tuple(sorted((d, local.get(u, "<in>")) for u, _, d in graph.nx.in_edges(n, data="port"))),
        )
        for n in nodes
    )


def _period(sigs: list[Any]) -> int:
    """The shortest pattern ``sigs`` repeats (the last repeat may be cut short)."""
    n = len(sigs)
    return next(p for p in range(1, n + 1) if sigs == sigs[:p] * (n // p) + sigs[: n % p])


def _stages(graph: ArchGraph) -> dict[str, Stage]:
    """The nodes drawn as boxes standing for blocks, in a stack of several stages: a stage whose pattern of
    block structures an earlier stage has drawn in full (with the nodes before its blocks when an earlier
    stage has drawn their structure too), and in a stage drawn in full, a block of the structure of an
    earlier block of it (Swin's shifted-window block after the plain one)."""
    out: dict[str, Stage] = {}
    shared = graph.shared()
    for stack in dict.fromkeys(a["stack"] for _, a in graph.nx.nodes(data=True)):
        containers: dict[str, list[str]] = {}
        for block in graph.blocks(stack):
            containers.setdefault(block.rsplit(".blocks.", 1)[0], []).append(block)
        if len(containers) < 2 or any(b in shared for b in graph.blocks(stack)):
            continue
        drawn: dict[Any, list[str]] = {}  # pattern of block structures -> one period of it drawn in full
        leads: dict[Any, str] = {}  # structure of the nodes before a stage's blocks -> the stage drawing them
        for container, blocks in containers.items():
            lead = [n for n in graph.nx if graph[n]["block"] is None and n.startswith(container + ".")]
            lead = [] if container == stack else lead
            shapes = [graph.signature(b, sizes=False) for b in blocks]
            key, lead_key = tuple(shapes[: _period(shapes)]), _structure(graph, lead, container + ".")
            seen = leads.get(lead_key) if lead else None
            if lead and seen is None:
                leads[lead_key] = container
            if key not in drawn:
                sigs = [graph.signature(b) for b in blocks]
                drawn[key] = blocks[: _period(sigs)]
                if _period(sigs) == len(blocks):  # drawn block by block: a block like an earlier one is a box
                    for i, b in enumerate(blocks):
                        if (j := shapes.index(shapes[i])) < i:
                            out |= _stage(graph, b, [b], [blocks[j]], [], container, None)
                continue
            out |= _stage(graph, container, blocks, drawn[key], lead, container, seen)
    return out


def _stage(
    graph: ArchGraph,
    ident: str,
    blocks: list[str],
    like: list[str],
    lead: list[str],
    container: str,
    seen: str | None,
) -> dict[str, Stage]:
    """Each node drawn by the box standing for ``blocks`` (repeating ``like``), and for the nodes before
    them (``lead``) when an earlier stage (``seen``) has drawn theirs."""
    nodes = [n for n in graph.nx if graph[n]["block"] in blocks]
    pairs = [
        ([n for n in nodes if graph[n]["block"] == b], b, like[i % len(like)])
        for i, b in enumerate(blocks[: len(like)])
    ]
    text = ""
    if seen is not None:
        pairs.insert(0, (lead, container, seen))
        nodes = lead + nodes
        names = {n[len(container) + 1 :].split(".")[0] for n in lead}
        text = f"{names.pop() if len(names) == 1 else 'its first nodes'} as in {seen}"
    else:
        ident = _span(blocks)
    stage = Stage(ident, tuple(nodes), tuple(blocks), tuple(like), text, _differences(graph, pairs))
    return dict.fromkeys(nodes, stage)


def _differences(graph: ArchGraph, pairs: list[tuple[list[str], str, str]]) -> tuple[str, ...]:
    """For each (nodes, prefix, other prefix) of ``pairs``: the label lines of the nodes that their
    counterparts below the other prefix do not have, as ``local name: line``."""
    lines: dict[str, None] = {}
    for nodes, mine, theirs in pairs:
        for n in nodes:
            local = n[len(mine) + 1 :]
            other = f"{theirs}.{local}"
            if other not in graph:
                continue
            known = set(graph.op(other).label(graph[other]["p"]))
            for line in graph.op(n).label(graph[n]["p"]):
                if line and line not in known:
                    lines[f"{local}: {line}"] = None
    return tuple(lines)
