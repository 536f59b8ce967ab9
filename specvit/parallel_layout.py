"""Know before you launch: what each rank of a (data, tensor, pipeline) layout holds and sends, from the graph.

:func:`pipeline_stages` cuts a model's blocks into pipeline stages balanced by FLOPs, then parameters (an
encoder-decoder's stages never straddle the encoder/decoder boundary). :func:`layout_report` adds, per stage, the parameters a
rank holds under the tensor-parallel plan :func:`specvit.tensor_parallel.plan` derives (a split layer's
parameters over the tensor ranks, a row-wise layer's bias replicated), their gradients and AdamW states
(sharded over the data ranks with FSDP2), the activations a 1F1B schedule keeps in flight, and the bytes a
rank sends per training step. Every figure is read from the graph and a meta-device build; nothing is
allocated or run. The rules behind each column are in :meth:`LayoutReport.table`'s notes.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specvit.errors import Problem, SpecError
from specvit.ops.embed import Ref

if TYPE_CHECKING:
    from specvit.graph import ArchGraph
    from specvit.spec.schema import Spec

__all__ = ["LayoutReport", "StageCost", "layout_report", "pipeline_stages"]

BYTES = 4  # fp32 parameters, gradients, activations
ADAMW = 8  # exp_avg and exp_avg_sq per parameter


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage: its blocks, the graph nodes it runs, its FLOPs at the graph's sizes, and the
    parameters it holds (those it reads from another stage's nodes included: a tied head's embedding)."""

    blocks: tuple[str, ...]
    nodes: tuple[str, ...]
    flops: int
    params: int


@dataclass
class _Block:
    path: str
    stack: str
    nodes: list[str]


def _owners(graph: ArchGraph) -> list[_Block]:
    """Every block of every stack in graph order, each with the nodes it runs: its own, and the nodes outside
    blocks attached to the nearest block of their stack (embeddings to the first, final norms to the last);
    a stack without blocks (the head) goes with the model's last block, or its first if it comes first."""
    blocks: dict[str, _Block] = {}
    last: dict[str, _Block] = {}  # stack -> its last block seen so far
    pending: dict[str, list[str]] = {}  # stack -> nodes before its first block
    for path, a in graph.nx.nodes(data=True):
        stack, block = str(a["stack"]), a["block"]
        if block is not None:
            if block not in blocks:
                blocks[block] = _Block(block, stack, pending.pop(stack, []))
            blocks[block].nodes.append(path)
            last[stack] = blocks[block]
        elif stack in last:
            last[stack].nodes.append(path)
        else:
            pending.setdefault(stack, []).append(path)
    order = list(blocks.values())
    if not order:
        raise SpecError(Problem("", f"{graph.name} has no blocks to cut into pipeline stages", "use --pp 1"))
    for stack, nodes in pending.items():  # stacks without blocks
        (order[0] if not last or stack == "input" else order[-1]).nodes.extend(nodes)
    return order


def _lent(graph: ArchGraph, owned: list[_Block]) -> list[tuple[int, str, int]]:
    """The weights blocks read from other nodes (a tied head's embedding, a shared layer): (the reading
    block, the node lending them, its parameters). A stage holds them too when it does not hold their owner."""
    out = []
    for i, b in enumerate(owned):
        for node in b.nodes:
            for value in graph.op(node).ctor(graph.nx.nodes[node]["p"]).values():
                if isinstance(value, Ref):
                    out.append((i, value.path, int(graph.nx.nodes[value.path]["params"])))
    return out


def _best_cut(
    n: int,
    stages: int,
    cost: Callable[[int, int], int],
    allowed: Callable[[int, int], bool],
    total: Callable[[float, int], float] = max,
) -> tuple[float, list[tuple[int, int]]]:
    """The cut of ``n`` blocks into ``stages`` consecutive runs ``[j, i)`` of only ``allowed`` runs whose
    ``total`` of the runs' ``cost`` (the largest, or with ``operator.add`` the sum) is least: it and the runs."""
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]  # best[k][i]: the first i blocks in k stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] < math.inf and allowed(j, i):
                    value = total(best[k - 1][j], cost(j, i))
                    if value < best[k][i]:
                        best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return best[stages][n], bounds[::-1]


def pipeline_stages(graph: ArchGraph, stages: int) -> list[StageCost]:
    """Cut ``graph``'s blocks into ``stages`` consecutive stages balanced by FLOPs, then parameters; with
    more than one stage, no stage holds blocks of two stacks (an encoder-decoder's boundary is a cut).

    Throughput first: no cut has a lighter heaviest stage in FLOPs. Of the cuts that reach it, the most even
    in FLOPs and parameters (the memory of their values, gradients and optimizer states) together: the least
    sum over the stages of the squares of their shares of the model's FLOPs and of its parameters. A stage
    holds the weights it reads from another stage too (a tied head's embedding, as Megatron-LM does).

    Args:
        graph: the model's graph (its FLOPs at the sizes it was built with).
        stages: the number of pipeline stages (>= 1).

    Raises:
        SpecError: more stages than blocks, or fewer stages than stacks of blocks.
    """
    owned = _owners(graph)
    n, stacks = len(owned), len({b.stack for b in owned})
    if stages > n or (1 < stages < stacks):
        need = f"from {stacks} to {n} stages" if stacks > 1 else f"at most {n} stage{'s' if n > 1 else ''}"
        raise SpecError(
            Problem(
                "",
                f"{stages} pipeline stages for {n} block{'s' if n > 1 else ''} in {stacks} "
                f"stack{'s' if stacks > 1 else ''}",
                f"use --pp 1, or {need} (a stage holds whole blocks of one stack)",
            )
        )
    nodes = graph.nx.nodes
    flops = list(
        itertools.accumulate((sum(int(nodes[v]["flops"]) for v in b.nodes) for b in owned), initial=0)
    )
    own = list(
        itertools.accumulate((sum(int(nodes[v]["params"]) for v in b.nodes) for b in owned), initial=0)
    )
    where = {node: i for i, b in enumerate(owned) for node in b.nodes}
    lent = _lent(graph, owned)

    def params(j: int, i: int) -> int:
        held = {node: count for b, node, count in lent if j <= b < i and not j <= where[node] < i}
        return own[i] - own[j] + sum(held.values())

    whole = lambda j, i: stages == 1 or owned[j].stack == owned[i - 1].stack  # noqa: E731
    fastest, _ = _best_cut(n, stages, lambda j, i: flops[i] - flops[j], whole)
    fast = lambda j, i: whole(j, i) and flops[i] - flops[j] <= fastest  # noqa: E731
    # the shares, both scaled by the product of the totals (exact integers)
    total_f, total_p = max(flops[-1], 1), max(graph.total_params, 1)
    even = lambda j, i: ((flops[i] - flops[j]) * total_p) ** 2 + (params(j, i) * total_f) ** 2  # noqa: E731
    _, bounds = _best_cut(n, stages, even, fast, operator.add)
    return [
        StageCost(
            tuple(b.path for b in owned[lo:hi]),
            tuple(node for b in owned[lo:hi] for node in b.nodes),
            flops[hi] - flops[lo],
            params(lo, hi),
        )
        for lo, hi in bounds
    ]


@dataclass(frozen=True)
class StageLoad:
    """What one rank of a pipeline stage holds and sends in a training step.

    Attributes:
        blocks: the stage's first and last block and their count.
        params: parameters per tensor-parallel rank.
        state_bytes: their fp32 values, gradients and AdamW states (16 bytes each), over the data ranks with
            FSDP2.
        activation_bytes: outputs of the stage's nodes kept for the backward, for the microbatches a 1F1B
            schedule holds in flight on this stage.
        sent: bytes a rank sends per step, by kind: ``tp``, ``pp``, ``dp``.
    """

    blocks: tuple[str, str, int]
    params: int
    state_bytes: int
    activation_bytes: int
    sent: dict[str, int]


@dataclass(frozen=True)
class LayoutReport:
    """Per-stage loads of a (data, tensor, pipeline) layout: see :func:`layout_report`."""

    name: str
    dp: int
    tp: int
    pp: int
    fsdp: bool
    batch: int
    microbatches: int
    stages: list[StageLoad]

    def table(self) -> str:
        """A text table, one row per stage, then the rules behind the figures."""
        rows = [
            ("stage", "blocks", "params/rank", "param+grad+AdamW", "activations", "sent/step (tp, pp, dp)")
        ]
        for i, s in enumerate(self.stages):
            first, last, count = s.blocks
            span = first if count == 1 else f"{first} .. {last.rsplit('.', 1)[-1]} ({count})"
            sent = ", ".join(_mb(s.sent[k]) for k in ("tp", "pp", "dp"))
            rows.append((str(i), span, f"{s.params:,}", _mb(s.state_bytes), _mb(s.activation_bytes), sent))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [
            "  ".join(
                v.rjust(w) if c > 1 else v.ljust(w) for c, (v, w) in enumerate(zip(r, widths, strict=True))
            )
            for r in rows
        ]
        dp = f"dp {self.dp} ({'FSDP2' if self.fsdp else 'DDP'})"
        head = (
            f"{self.name}: tp {self.tp} x pp {self.pp} x {dp} = {self.tp * self.pp * self.dp} ranks; batch "
            f"{self.batch} per data rank in {self.microbatches} microbatch{'es' if self.microbatches > 1 else ''}"
        )
        return "\n".join([head, *lines, *NOTES])


NOTES = (
    "MB = 2^20 bytes, fp32. Params: a split layer's over the tensor ranks (a row-wise layer's bias whole); a",
    "weight two stages use (a tied head's embedding) on both.",
    "Activations: every node's output in the stage, times the microbatches 1F1B keeps in flight there.",
    "Sent: tp, 2 ring all-reduces of each summed layer's output per microbatch (1 for an embedding); pp, the",
    "stage's output forward and its input's gradient backward per microbatch; dp, DDP's all-reduce of the",
    "gradients, or FSDP2's two all-gathers and a reduce-scatter of the parameters.",
)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def _ancestors(path: str) -> list[str]:
    """``a.b.c`` -> ``[a.b.c, a.b, a]``."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _split_rules(split: dict[str, object]) -> Callable[[str], tuple[str, object] | None]:
    """The plan entry (matched path, style) of a module path or its nearest ancestor, or None."""
    from specvit.tensor_parallel import entry_pattern

    keys = [(entry_pattern(k), style) for k, style in split.items()]

    def find(path: str) -> tuple[str, object] | None:
        for anc in _ancestors(path):
            for key, style in keys:
                if key.fullmatch(anc):
                    return anc, style
        return None

    return find


def _is_split(name: str, found: tuple[str, object] | None) -> bool:
    """Whether parameter ``name`` is divided over the tensor ranks by the plan entry ``found`` of its module."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from specvit.parallel_styles import ExpertSplit, TiedHead

    if found is None:
        return False
    at, style = found
    module, _, leaf = name.rpartition(".")
    if isinstance(style, ColwiseParallel | TiedHead):
        return True
    if isinstance(style, RowwiseParallel):
        return leaf != "bias"
    return isinstance(style, ExpertSplit) and module == at and leaf in ("fc1", "fc2")


def _local_numel(name: str, numel: int, tp: int, found: tuple[str, object] | None) -> int:
    """The elements of parameter ``name`` a tensor rank holds: a split one's share (a packed projection's
    key/value heads copied to several ranks count on each), else all."""
    from specvit.parallel_styles import PackedColwise, rank_major

    if not _is_split(name, found):
        return numel
    style = found[1] if found else None
    if isinstance(style, PackedColwise) and style.heads:
        return numel // sum(style.parts) * (len(rank_major(style.parts, tp, style.heads)) // tp)
    return -(-numel // tp)


def layout_report(
    spec: Spec, *, tp: int = 1, pp: int = 1, dp: int = 1, fsdp: bool = False, batch: int = 1, **sizes: int
) -> LayoutReport:
    """What each rank of a tp x pp x dp layout holds and sends per training step, from the graph.

    Args:
        spec: a validated spec.
        tp: tensor-parallel ranks (the plan of :func:`specvit.tensor_parallel.plan`; refused as it refuses).
        pp: pipeline stages (:func:`pipeline_stages`), run 1F1B with ``pp`` microbatches.
        dp: data-parallel ranks.
        fsdp: FSDP2 over the data ranks (else DDP).
        batch: samples per data rank per step.
        sizes: ``seq_len``, ``src_len``, ``tgt_len`` as :func:`specvit.graph.build_graph` takes them.

    Raises:
        SpecError: a count below 1, a plan that cannot split the model over ``tp`` ranks, or stages that
            cannot be cut.
    """
    from torch import nn

    from specvit.compile import build_model
    from specvit.graph import build_graph
    from specvit.nn.layers import lender
    from specvit.tensor_parallel import plan

    for key, value in (("tp", tp), ("pp", pp), ("dp", dp), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(Problem("", f"--{key} must be an integer >= 1, got {value!r}", f"--{key} 1"))
    microbatches = pp
    graph = build_graph(spec, batch=-(-batch // microbatches), **sizes)
    stages = pipeline_stages(graph, pp)
    model = build_model(spec, device="meta")
    find = _split_rules(dict(plan(model, tp)) if tp > 1 else {})
    where = {node: i for i, s in enumerate(stages) for node in s.nodes}
    params = [0] * pp
    per_param: dict[str, int] = {}
    for name, p in model.named_parameters():
        stage = next((where[a] for a in _ancestors(name) if a in where), 0)
        per_param[name] = _local_numel(name, p.numel(), tp, find(name.rpartition(".")[0]))
        params[stage] += per_param[name]
    paths = {id(m): path for path, m in model.named_modules()}
    for node, stage in where.items():  # a tied head's embedding is held by its stage too (Megatron's way)
        source = lender(model.get_submodule(node)) if graph.nx.nodes[node]["module"] else None
        if source is not None and where.get(paths[id(source)]) not in (stage, None):
            params[stage] += sum(per_param[f"{paths[id(source)]}.{k}"] for k, _ in source.named_parameters())
    ring = lambda ranks: 2 * (ranks - 1) / ranks  # noqa: E731  (bytes sent per byte all-reduced, ring)
    out = {n: math.prod(graph.concrete(a["shape"])) * BYTES for n, a in graph.nx.nodes(data=True)}
    handed = [out[[n for n in s.nodes if graph.nx.nodes[n]["block"] == s.blocks[-1]][-1]] for s in stages]
    loads = []
    for i, s in enumerate(stages):
        kept = sum(out[n] for n in s.nodes if graph.nx.nodes[n]["op"] != "input")
        summed = 0
        for n in s.nodes:
            if graph.nx.nodes[n]["module"] and tp > 1 and _sums(find, model, n):
                summed += out[n] * (1 if isinstance(model.get_submodule(n), nn.Embedding) else 2)
        sent = {  # per step: the pipeline hands its last block's output on and receives its gradient back
            "tp": int(summed * ring(tp) * microbatches) if tp > 1 else 0,
            "pp": microbatches * ((handed[i] if i < pp - 1 else 0) + (handed[i - 1] if i > 0 else 0)),
            "dp": int(params[i] * BYTES * (1.5 if fsdp else 1) * ring(dp)) if dp > 1 else 0,
        }
        state = -(-(2 * BYTES + ADAMW) * params[i] // (dp if fsdp else 1))
        inflight = min(microbatches, pp - i)
        loads.append(
            StageLoad((s.blocks[0], s.blocks[-1], len(s.blocks)), params[i], state, kept * inflight, sent)
        )
    return LayoutReport(spec.name, dp, tp, pp, fsdp, batch, microbatches, loads)


def _sums(find: Callable[[str], tuple[str, object] | None], model: object, node: str) -> bool:
    """Whether graph node ``node``'s module, or one inside it, is split so that its outputs are summed over
    the tensor ranks (row-wise, experts, a vocabulary-parallel embedding)."""
    from torch import nn
    from torch.distributed.tensor.parallel import RowwiseParallel

    from specvit.parallel_styles import ExpertSplit

    assert isinstance(model, nn.Module)
    for path, _ in model.get_submodule(node).named_modules(prefix=node):
        found = find(path)
        if found is not None and found[0] == path and isinstance(found[1], RowwiseParallel | ExpertSplit):
            return True
    return False
