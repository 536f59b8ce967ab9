"""The architecture graph: specvit's one IR, drawn by the renderer and built by the compiler.

Each node is named by the module path it becomes (``encoder.blocks.3.attn``) or, for structural
steps that own no module (inputs, residual adds, pooling, outputs), by a path beside them
(``encoder.blocks.3.add1``). Node attributes:

- ``op``: op kind (``patch_embed``, ``self_attention``, ``layernorm``, ``add``, ...)
- ``module``: True when the node is an ``nn.Module`` of the compiled model
- ``hparams``: resolved hyperparameters, concrete ints and strings
- ``shape``: output shape, symbolic dims as strings (``("B", "S_src", 512)``) and ints where known
- ``inputs``: the shape expected on each input port (``{"x": (...), "memory": (...)}``)
- ``params``: parameter count of this module (0 for tied weights and structural nodes)
- ``flops``: FLOPs of one forward at the graph's ``dims`` (a multiply-add counts 2)
- ``source``: the spec file:line:col the node came from
- ``block``: the block path for nodes inside a repeated block (``encoder.blocks.3``), else None
- ``stack``: ``encoder``, ``decoder`` or ``head``

Edges carry tensors: ``port`` says which input of the target they feed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import networkx as nx

if TYPE_CHECKING:
    from specvit.spec.schema import Spec

__all__ = ["ArchGraph", "Dim", "Shape", "SummaryRow"]

Dim = int | str
Shape = tuple[Dim, ...]


@dataclass(frozen=True)
class SummaryRow:
    """One row of :meth:`ArchGraph.summary`: a node, or a node of block 0 standing for all its repeats."""

    path: str
    op: str
    shape: Shape
    params: int
    flops: int
    count: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "op": self.op,
            "shape": list(self.shape),
            "params": self.params,
            "flops": self.flops,
            "count": self.count,
        }


class ArchGraph:
    """A lowered spec: a ``networkx.DiGraph`` plus the spec and the sizes its FLOPs were counted at.

    Args:
        spec: the validated spec this graph was lowered from.
        nx_graph: the graph, nodes in execution order.
        dims: the concrete value of each symbolic dim (``{"B": 1, "S": 128}``).
    """

    def __init__(self, spec: Spec, nx_graph: nx.DiGraph, dims: dict[str, int]):
        self.spec = spec
        self.nx = nx_graph
        self.dims = dims

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
        return sum(int(a["flops"]) for _, a in self.nx.nodes(data=True))

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

    # -- summary --------------------------------------------------------------------------------

    def summary(self, expand: bool = False) -> list[SummaryRow]:
        """Rows of (path, op, output shape, params, FLOPs), in execution order.

        Args:
            expand: one row per node; by default the nodes of identical repeated blocks are folded
                into the rows of the first block with a count (params and FLOPs stay per block).
        """
        rows: list[SummaryRow] = []
        folded = {} if expand else self._fold()
        for path, a in self.nx.nodes(data=True):
            block = a["block"]
            if block is not None and block in folded:
                first, count = folded[block]
                if first != block:
                    continue
                last = int(block.rsplit(".", 1)[1]) + count - 1
                shown = path.replace(block, f"{block}-{last}", 1) if count > 1 else path
                rows.append(SummaryRow(shown, a["op"], a["shape"], a["params"], a["flops"], count))
            else:
                rows.append(SummaryRow(path, a["op"], a["shape"], a["params"], a["flops"]))
        return rows

    def _fold(self) -> dict[str, tuple[str, int]]:
        """block path -> (first block of its run of identical blocks, run length)."""
        out: dict[str, tuple[str, int]] = {}
        for stack in ("encoder", "decoder"):
            run: list[str] = []
            for block in [*self.blocks(stack), None]:
                if run and (block is None or self.signature(block) != self.signature(run[0])):
                    for member in run:
                        out[member] = (run[0], len(run))
                    run = []
                if block is not None:
                    run.append(block)
        return out

    def signature(self, block: str) -> tuple[Any, ...]:
        """What makes two blocks the same drawing: their ops, hyperparameters, shapes and params.

        Stochastic depth rates differ from block to block but do not change what a block is.
        """
        prefix = block + "."
        return tuple(
            (
                n[len(prefix) :],
                a["op"],
                tuple(sorted((k, v) for k, v in a["hparams"].items() if k != "drop_path")),
                a["shape"],
                a["params"],
            )
            for n, a in self.nx.nodes(data=True)
            if n.startswith(prefix)
        )

    def format_summary(self, expand: bool = False) -> str:
        """The summary as an aligned text table with totals."""
        from specvit.diagram.text import format_table

        return format_table(self, expand=expand)
