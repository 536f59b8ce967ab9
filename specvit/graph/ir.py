"""The architecture graph: specvit's one IR, drawn by the renderer and built by the compiler.

Each node is named by the module path it becomes (``encoder.blocks.3.attn``) or, for structural
steps that own no module (inputs, residual adds, pooling, outputs), by a path beside them
(``encoder.blocks.3.add1``). Node attributes:

- ``op``: op kind, a key of :data:`specvit.ops.OPS` (``patch_embed``, ``self_attention``, ``add``, ...)
- ``p``: its resolved hyper-parameters, the op's frozen :class:`~specvit.ops.Params` dataclass
- ``module``: True when the node is an ``nn.Module`` of the compiled model, at the node's path
- ``shape``: output shape, symbolic dims as strings (``("B", "S_src", 512)``) and ints where known
- ``inputs``: the shape arriving on each input port (``{"x": (...), "memory": (...)}``)
- ``params``: parameter count of this module (0 for tied weights and structural nodes)
- ``flops``: FLOPs of one forward at the graph's ``dims`` (a multiply-add counts 2), as a dense kernel
  computes them (what ``FlopCounterMode`` measures)
- ``useful_flops``: the part of ``flops`` whose results are used: an attention under a causal mask or a
  sliding window less the query-key pairs the mask hides; ``flops`` for every other node
- ``source``: the spec file:line:col the node came from
- ``block``: the block path for nodes inside a repeated block (``encoder.blocks.3``), else None
- ``stack``: ``encoder``, ``decoder`` or ``head``: the part of the diagram it is drawn in
- ``scope``: the module whose generated forward computes it: ``""`` (the model), a stack, ``head``
  or a block

Edges carry values: ``port`` says which input of the target they feed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import networkx as nx

from specvit.ops import OPS
from specvit.ops.base import Dim, Shape
from specvit.ops.facts import StackFacts
from specvit.units import FLOPS, FlopUnit

if TYPE_CHECKING:
    from specvit.spec.schema import Spec

__all__ = ["ArchGraph", "Dim", "Fold", "Shape", "SummaryRow"]


@dataclass(frozen=True)
class Fold:
    """A block's place in a folded run of repeated blocks.

    Args:
        rep: the block drawn (and summarised) for this one.
        count: how many blocks ``rep`` stands for.
        label: how the folded blocks are named in views (``encoder.blocks.0-11``).
        run: the first block of the run, naming the run.
    """

    rep: str
    count: int
    label: str
    run: str


@dataclass(frozen=True)
class SummaryRow:
    """One row of :meth:`ArchGraph.summary`: a node, or a node of block 0 standing for all its repeats.

    Args:
        path: the node's path (a folded run's: ``encoder.blocks.0-11.attn``).
        op: the op kind.
        shape: the output shape.
        params: the node's parameters (per block in a folded run).
        flops: its FLOPs as a dense kernel computes them (per block).
        useful_flops: the part of ``flops`` whose results are used (per block).
        count: how many blocks the row stands for.
    """

    path: str
    op: str
    shape: Shape
    params: int
    flops: int
    useful_flops: int
    count: int = 1

    def as_dict(self, unit: FlopUnit = FLOPS) -> dict[str, Any]:
        """The row as JSON data, its FLOPs in ``unit`` under keys named for it (``flops``, ``useful_flops``;
        ``macs``, ``useful_macs``).

        Args:
            unit: :data:`~specvit.units.FLOPS` or :data:`~specvit.units.MACS`.
        """
        return {
            "path": self.path,
            "op": self.op,
            "shape": list(self.shape),
            "params": self.params,
            unit.key: unit.of(self.flops),
            f"useful_{unit.key}": unit.of(self.useful_flops),
            "count": self.count,
        }


class ArchGraph:
    """A lowered spec: a ``networkx.MultiDiGraph`` plus the spec and the sizes its FLOPs were counted at.

    Args:
        spec: the validated spec this graph was lowered from (carried for checkpoints; the compiler and
            the diagrams read the graph only).
        nx_graph: the graph, nodes in execution order.
        dims: the concrete value of each symbolic dim (``{"B": 1, "S": 128}``).
        kind: the model kind (``encoder``, ``decoder``, ``encoder_decoder``).
        init: the weight-init convention (``vit``, ``xavier``, ``normal``).
        facts: each stack's resolved numbers, by role (``encoder``, ``decoder``): what input checks,
            export, ``generate`` and the importers read of the spec.
    """

    def __init__(
        self,
        spec: Spec,
        nx_graph: nx.MultiDiGraph,
        dims: dict[str, int],
        kind: str,
        init: str,
        facts: Mapping[str, StackFacts],
    ):
        self.spec = spec
        self.nx = nx_graph
        self.dims = dims
        self.kind = kind
        self.init = init
        self.facts = dict(facts)

    # -- access ---------------------------------------------------------------------------------

    def __contains__(self, path: object) -> bool:
        return path in self.nx

    def __getitem__(self, path: str) -> dict[str, Any]:
        return self.nx.nodes[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self.nx.nodes)

    def __len__(self) -> int:
        return int(self.nx.number_of_nodes())

    def module_nodes(self) -> list[str]:
        """Paths of the nodes that are modules of the compiled model, in execution order."""
        return [n for n, a in self.nx.nodes(data=True) if a["module"]]

    def op(self, path: str) -> Any:
        """The :class:`~specvit.ops.Op` of node ``path``."""
        return OPS[self.nx.nodes[path]["op"]]

    def concrete(self, shape: Shape) -> tuple[int, ...]:
        """``shape`` with its symbolic dims replaced by the graph's sizes."""
        return tuple(d if isinstance(d, int) else self.dims[d] for d in shape)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def total_params(self) -> int:
        return sum(int(a["params"]) for _, a in self.nx.nodes(data=True))

    @property
    def total_flops(self) -> int:
        """FLOPs of one forward at :attr:`dims`, as dense kernels compute them (a multiply-add counts 2)."""
        return sum(int(a["flops"]) for _, a in self.nx.nodes(data=True))

    @property
    def total_useful_flops(self) -> int:
        """The part of :attr:`total_flops` whose results are used (attention pairs a static mask keeps)."""
        return sum(int(a["useful_flops"]) for _, a in self.nx.nodes(data=True))

    @property
    def masked(self) -> bool:
        """Some node computes work a static mask hides: its useful FLOPs are fewer than its FLOPs."""
        return any(a["useful_flops"] != a["flops"] for _, a in self.nx.nodes(data=True))

    @property
    def output(self) -> str:
        """The path of the output node."""
        return next(n for n, a in self.nx.nodes(data=True) if a["op"] == "output")

    def blocks(self, stack: str) -> list[str]:
        """Block paths of a stack, in order (``["encoder.blocks.0", ...]``)."""
        seen = dict.fromkeys(
            a["block"] for _, a in self.nx.nodes(data=True) if a["stack"] == stack and a["block"]
        )
        return list(seen)

    def _members(self) -> dict[str | None, list[str]]:
        """Block path -> its nodes in order, indexed once per graph: a lookup per block scanned every node,
        which made the collapsed view of 1,024 blocks of 16 sublayers take minutes (blocks x nodes)."""
        key = self.nx.number_of_nodes()  # O(1); counting edges is O(edges)
        cached = self.__dict__.get("_member_index")
        if cached is None or cached[0] != key:
            index: dict[str | None, list[str]] = {}
            for n, a in self.nx.nodes(data=True):
                index.setdefault(a["block"], []).append(n)
            cached = (key, index)
            self.__dict__["_member_index"] = cached
        return cached[1]

    def shared(self) -> dict[str, list[str]]:
        """Blocks whose weights later layers share: block path -> the ``call`` nodes running it again."""
        blocks = {a["block"] for _, a in self.nx.nodes(data=True)}
        out: dict[str, list[str]] = {}
        for n, a in self.nx.nodes(data=True):
            if a["op"] == "call" and a["p"].scope in blocks:
                out.setdefault(a["p"].scope, []).append(n)
        return out

    # -- summary --------------------------------------------------------------------------------

    def summary(self, expand: bool = False) -> list[SummaryRow]:
        """Rows of (path, op, output shape, params, FLOPs, useful FLOPs), in execution order.

        Args:
            expand: one row per node; by default each folded run of repeated blocks (see :meth:`fold`)
                shows only its representative blocks, with a count (params and FLOPs stay per block).
        """
        rows: list[SummaryRow] = []
        folded = {} if expand else self.fold()
        for path, a in self.nx.nodes(data=True):
            fold = folded.get(a["block"]) if a["block"] is not None else None
            if fold is not None and fold.rep != a["block"]:
                continue
            shown, count = (path.replace(fold.rep, fold.label, 1), fold.count) if fold else (path, 1)
            numbers = (a["params"], a["flops"], a["useful_flops"])
            rows.append(SummaryRow(shown, a["op"], a["shape"], *numbers, count))
        return rows

    def fold(self) -> dict[str, Fold]:
        """How the collapsed views fold repeated blocks: block path -> its :class:`Fold`.

        A run of identical blocks folds into its first block (``encoder.blocks.0-11``, x12); a run that
        repeats a pattern of several blocks (Swin's plain and shifted windows, a local-local-global
        schedule) folds into the pattern's first blocks (``encoder.stages.2.blocks.0,2,4`` and
        ``...1,3,5``, x3 each). Runs never cross a stage. Blocks that repeat nothing are absent.
        """
        return self.fold_in_parts({})

    def fold_in_parts(self, parts: Mapping[str, int]) -> dict[str, Fold]:
        """:meth:`fold` with the blocks cut into parts (pipeline stages) that no run crosses.

        Args:
            parts: block path -> its part (a block not named is in part 0).
        """
        out: dict[str, Fold] = {}
        containers: dict[tuple[str, int], list[str]] = {}
        for stack in ("encoder", "decoder"):
            for block in self.blocks(stack):
                part = parts.get(block, 0)
                containers.setdefault((block.rsplit(".blocks.", 1)[0], part), []).append(block)
        shared = self.shared()  # drawn once already, with the count of its runs
        for blocks in containers.values():
            sigs = [(b,) if b in shared else self.signature(b) for b in blocks]
            i = 0
            while i < len(blocks):
                period, reps = _period(sigs, i)
                if reps < 2:
                    i += 1
                    continue
                prefix = blocks[i].rsplit(".", 1)[0]
                for offset in range(period):
                    members = blocks[i + offset : i + period * reps : period]
                    indexes = [b.rsplit(".", 1)[1] for b in members]
                    label = (
                        f"{prefix}.{indexes[0]}-{indexes[-1]}"
                        if period == 1
                        else f"{prefix}.{','.join(indexes)}"
                    )
                    for b in members:
                        out[b] = Fold(members[0], reps, label, blocks[i])
                i += period * reps
        return out

    def signature(self, block: str, *, sizes: bool = True) -> tuple[Any, ...]:
        """What makes two blocks the same drawing and the same code: their nodes' ops, hyper-parameters,
        shapes and wiring.

        Stochastic-depth rates and KV-cache indexes differ from block to block but do not change what a
        block is (:meth:`~specvit.ops.Params.identity`).

        Args:
            block: the block's path.
            sizes: False leaves the hyper-parameters and shapes out: the block's structure, the same for
                blocks that differ in widths, heads or windows only (the stages of Swin).
        """
        prefix = block + "."
        local = {n: n[len(prefix) :] for n in self._members().get(block, ())}

        stack = block.split(".")[0]

        def source(u: str) -> str:
            """A node of the block by its name; an outside value by what the stack calls it (``mask``)."""
            return local.get(u) or "<" + self.nx.nodes[u].get("sides", {}).get(stack, "in") + ">"

        def wiring(n: str) -> tuple[tuple[str, str], ...]:
            return tuple(sorted((d["port"], source(u)) for u, _, d in self.nx.in_edges(n, data=True)))

        if not sizes:
            return tuple((name, self.nx.nodes[n]["op"], wiring(n)) for n, name in local.items())
        return tuple(
            (
                name,
                self.nx.nodes[n]["op"],
                self.nx.nodes[n]["p"].identity(),
                self.nx.nodes[n]["shape"],
                wiring(n),
            )
            for n, name in local.items()
        )

    def placeholders(self) -> list[str]:
        """The model's forward arguments, in argument order."""
        found = [n for n, a in self.nx.nodes(data=True) if a["op"] == "input"]
        return sorted(
            found, key=lambda n: self.nx.nodes[n]["p"].group
        )  # stable: creation order within a group


_MAX_PERIOD = 16  # longest block pattern the collapsed views look for


def _period(sigs: list[Any], i: int) -> tuple[int, int]:
    """The pattern length and repeat count of the run starting at ``i`` that covers the most blocks
    (the shortest pattern among equals): ``[A, A, A]`` is (1, 3), ``[L, L, G, L, L, G]`` is (3, 2)."""
    best = (1, 1)
    for period in range(1, min(_MAX_PERIOD, (len(sigs) - i) // 2) + 1):
        reps = 1
        while sigs[i + reps * period : i + (reps + 1) * period] == sigs[i : i + period]:
            reps += 1
        if reps >= 2 and period * reps > best[0] * best[1]:
            best = (period, reps)
    return best
