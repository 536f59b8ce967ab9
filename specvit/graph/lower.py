"""Lowering: a validated Spec -> an ArchGraph with shapes, parameters and FLOPs on every node.

The driver knows stacks, stages and blocks, never a kind: each input, position and head fragment
lowers itself (``lower``), each sublayer is a registered :class:`~specvit.ops.base.Sublayer`, each node
kind an :class:`~specvit.ops.base.Op` that computes the node's shape, parameters and FLOPs. FLOPs
follow ``torch.utils.flop_counter.FlopCounterMode``: matmuls and convolutions count 2 x multiply-adds;
element-wise work (norms, activations, adds, softmax) counts nothing. A node's useful FLOPs leave out what
a dense kernel computes and a static mask hides (an attention's causal mask or sliding window).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import networkx as nx

from specvit import argcheck
from specvit.errors import Problem, SpecError
from specvit.graph.ir import ArchGraph
from specvit.graph.verify import verify
from specvit.ops import OPS, Params
from specvit.ops.base import MAX_LEN, Dim, Dims, Shape
from specvit.ops.block import BlockCtx
from specvit.ops.embed import LinearParams, PrefixParams
from specvit.ops.grid import lower_downsample
from specvit.ops.norm import NormParams
from specvit.ops.structure import CallParams, DropParams, InputParams, MaskParams, SubCacheParams
from specvit.patterns.residual import expand, lower_steps
from specvit.spec.loader import load_spec, parse_spec
from specvit.spec.schema import Spec, StackSpec

__all__ = ["DEFAULT_SEQ_LEN", "build_graph", "graph_of"]

DEFAULT_SEQ_LEN = 128

# Forward argument names by model kind and role: the input, its padding mask, its token types and which
# of its tokens are global.
_ARGS = {
    ("encoder", "encoder"): ("x", "key_padding_mask", "token_type_ids", "global_attention_mask"),
    ("decoder", "decoder"): ("tokens", "key_padding_mask", "token_type_ids", "global_attention_mask"),
    ("encoder_decoder", "encoder"): (
        "src",
        "src_key_padding_mask",
        "src_token_type_ids",
        "src_global_attention_mask",
    ),
    ("encoder_decoder", "decoder"): (
        "tgt",
        "tgt_key_padding_mask",
        "tgt_token_type_ids",
        "tgt_global_attention_mask",
    ),
}


class _Lowering:
    """The state of one lowering; fragments see it as a :class:`~specvit.ops.base.StackCtx`."""

    def __init__(self, spec: Spec, dims: Dims):
        self.spec, self.dims = spec, dims
        self.g = nx.MultiDiGraph()  # one value may feed several ports of a node (rope and memory_rope)
        self.memory: dict[str, str] = {}  # what the last stack lowered offers a later one: x, mask, pos
        self.layers = [0]  # KV-cache index of the next attention layer
        self.role = ""
        self.stack: Any = None
        self.x = ""
        self.n: Dim = 0
        self.grid: tuple[int, int] | None = None
        self.side: dict[str, str] = {}
        self.outputs: dict[str, tuple[str, str, Params]] = {}  # the model's outputs beside the head's

    # -- what fragments call ----------------------------------------------------------------------

    def shape(self, node: str) -> Shape:
        return self.g.nodes[node]["shape"]

    def arg(self, what: str) -> str:
        names = _ARGS[(self.spec.model, self.role)]
        return {"input": names[0], "mask": names[1], "types": names[2], "global": names[3]}[what]

    def total_flops(self, scope: str, useful: bool = False) -> int:
        key = "useful_flops" if useful else "flops"
        return sum(int(a[key]) for _, a in self.g.nodes(data=True) if a["stack"] == scope)

    def add(
        self,
        path: str,
        kind: str,
        p: Params,
        srcs: Mapping[str, str] | None = None,
        *,
        source: str = "",
        stack: str = "",
        block: str | None = None,
        scope: str | None = None,
    ) -> str:
        """Add node ``path`` of op ``kind``; its shape, parameters and FLOPs come from the op."""
        op = OPS[kind]
        wired = {port: src for port, src in (srcs or {}).items() if src}
        unknown = set(wired) - set(op.ports)
        if (unknown and not op.any_ports) or set(op.requires(p)) - set(wired):
            raise AssertionError(f"{path}: op {kind} takes {op.ports}, got {sorted(wired)}")
        inputs = {port: self.shape(src) for port, src in wired.items()}
        stack = stack or self.role
        try:
            shape = op.shape(p, inputs, self.dims)
        except ValueError as exc:
            raise SpecError(
                Problem(path, str(exc), "the widths of consecutive parts of the spec disagree")
            ) from None
        concrete = {port: self.dims.concrete(s) for port, s in inputs.items()}
        location = self.spec.locate(source) if source else None
        self.g.add_node(
            path,
            op=kind,
            p=p,
            module=op.module_for(p) is not None,
            shape=shape,
            inputs=inputs,
            params=op.params(p),
            flops=op.flops(p, concrete),
            useful_flops=op.useful_flops(p, concrete),
            source=str(location) if location else "",
            spec_key=source,
            block=block,
            stack=stack,
            scope=scope if scope is not None else (block or (stack if stack != "head" else "head")),
        )
        for port, src in wired.items():
            self.g.add_edge(src, path, port=port)
        return path

    def placeholder(
        self,
        path: str,
        arg: str,
        shape: Shape,
        *,
        dtype: str = "float",
        required: bool = True,
        keyword: bool = False,
        default: Any = None,
        vocab: int | None = None,
        source: str = "",
        stack: str = "",
        group: int = 0,
        what: str = "",
        local: str = "",
    ) -> str:
        """Add a forward argument of the model, drawn in ``stack``."""
        p = InputParams(arg, shape, dtype, required, keyword, default, vocab, group, what, local)
        return self.add(path, "input", p, source=source or path, stack=stack, scope="")

    # -- the driver -------------------------------------------------------------------------------

    def lower_stack(self, role: str, s: StackSpec) -> None:
        """The nodes of one stack: input, positions, prefix, stages of blocks, final norm."""
        incoming, self.memory = self.memory, {}
        self.role, self.stack, self.grid = role, s, None
        self.side = {f"memory_{k}" if k != "x" else "memory": v for k, v in incoming.items()}
        self.n = _symbol(self.spec, role)
        self.tag_sides()
        s.input.lower(self)
        f = s.facts
        if any(b.global_tokens and b.global_tokens.first is None for b in s.layer_blocks):
            self.side["global_mask"] = self.placeholder(  # which tokens are global, per sample (Longformer)
                f"{role}.global_mask",
                self.arg("global"),
                ("B", self.n),
                dtype="bool",
                required=False,
                keyword=True,
                what="global tokens",
                stack=role,
                group=3,
            )
        if f.causal:  # decoding token by token: the KV cache and the position of the first new token
            for arg, dtype, default in (("cache", "cache", None), ("offset", "int", 0)):
                path = f"{role}.{arg}"
                self.side[arg] = self.placeholder(
                    path,
                    arg,
                    (),
                    dtype=dtype,
                    default=default,
                    required=False,
                    keyword=True,
                    stack=role,
                    group=3,
                )
        self.positions(s, "before_prefix")
        if s.masking is not None:  # after the patches' positions, before the prefix tokens (MAE)
            s.masking.lower(self)
        if not f.prefix_at:
            self.prefix(s)
        self.positions(s, "tokens")
        if s.embed_norm:
            self.x = self.norm(f"{role}.embed_norm", s, f.embedding_width, f"{role}.embed_norm")
        if s.dropout.embedding:
            p = DropParams(s.dropout.embedding)
            self.x = self.add(
                f"{role}.pos_drop", "dropout", p, {"x": self.x}, source=f"{role}.dropout.embedding"
            )
        if f.embedding_width != f.width:  # the embeddings mapped to the blocks' width (ALBERT)
            proj = LinearParams(f.embedding_width, f.width)
            self.x = self.add(
                f"{role}.embed_proj", "linear", proj, {"x": self.x}, source=f"{role}.embed_width"
            )
        self.positions(s, "attention")
        self.blocks(s)
        if f.prefix_at and f.prefix_at == f.total_depth:  # after the last block
            self.prefix(s, f.out_width)
        if s.final_norm:
            self.x = self.norm(f"{role}.norm", s, f.out_width, f"{role}.final_norm")
        self.tag_sides()
        self.memory.update({"x": self.x} | ({"mask": self.side["mask"]} if "mask" in self.side else {}))

    def tag_sides(self) -> None:
        """Record on each side value the name the stack reads it by (``mask``, ``memory``): the generated
        forwards name their parameters so."""
        for name, node in self.side.items():
            self.g.nodes[node].setdefault("sides", {}).setdefault(self.role, name)

    def positions(self, s: StackSpec, phase: str) -> None:
        for p in s.positions:
            if p.phase() == phase:
                p.lower(self)

    def prefix(self, s: StackSpec, width: int | None = None) -> None:
        """The prefix tokens in front of the tokens, ``width`` wide (the stage's they enter; the first's)."""
        f = s.facts
        if not f.num_prefix:
            return
        role = self.role
        p = PrefixParams(width or f.width, s.prefix.cls, s.prefix.registers, s.prefix.distillation)
        self.x = self.add(f"{role}.prefix", "prefix", p, {"x": self.x}, source=f"{role}.prefix")
        self.n = self.dims.plus(self.n, f.num_prefix)
        if "mask" in self.side:
            mask = MaskParams(f.num_prefix)
            self.side["mask"] = self.add(
                f"{role}.prefix_mask", "extend_mask", mask, {"x": self.side["mask"]}, source=f"{role}.prefix"
            )

    def norm(self, path: str, s: StackSpec, dim: int, source: str) -> str:
        n = s.block.norm
        return self.add(path, n.kind, NormParams.of(n, dim), {"x": self.x}, source=source)

    def blocks(self, s: StackSpec) -> None:
        """The blocks, stage by stage (a plain stack is one stage whose blocks are ``{role}.blocks.i``)."""
        role, index, f = self.role, 0, s.facts  # index over the whole stack: the stochastic-depth schedule
        # a set of shared weights (share:) -> the block that holds it and that block's input
        applied: dict[int, tuple[str, str]] = {}
        for si, stage in enumerate(f.stages):
            container = f"{role}.stages.{si}" if s.hierarchical else role
            if si > 0:
                assert self.grid is not None
                self.x, self.grid = lower_downsample(self, f"{container}.downsample", self.grid, si)
                self.n = self.grid[0] * self.grid[1]
            for i in range(stage.depth):
                if index == f.prefix_at and index:  # the prefix enters late (CaiT's; PVT's in its last stage)
                    self.prefix(s, stage.width)
                w = s.weight_set(index)
                if w in applied:  # a later layer of shared weights: its block again
                    self.x = self.call_block(index, *applied[w])
                    index += 1
                    continue
                applied[w] = f"{container}.blocks.{w}", self.x
                spec = s.layer(index)
                b = BlockCtx(
                    self,
                    spec,
                    f"{container}.blocks.{w if s.share else i}",
                    dim=stage.width,
                    heads=stage.heads,
                    kv_heads=stage.kv_heads,
                    head_dim=stage.head_dim,
                    layers=self.layers,
                    index=i,
                    grid=self.grid,
                    stage=si,
                )
                rate = round(s.drop_path * index / (f.total_depth - 1), 6) if f.total_depth > 1 else 0.0
                self.x = lower_steps(b, expand(spec, role), b.enter(self.x), rate if s.drop_path else None)
                index += 1

    def call_block(self, index: int, block: str, first: str) -> str:
        """A node running ``block`` again on the tokens, with the side values its first run read; a KV cache
        of its own for the run (``sub_cache``), whose entries the block's attention indexes fill again.

        Args:
            index: the run's layer index in the stack.
            block: the block's path.
            first: the tokens its first run read.
        """
        inside = {n for n, a in self.g.nodes(data=True) if a["block"] == block}
        side: dict[str, str] = {}  # node -> the name its block reads it by
        for name, node in self.side.items():  # the block's parameter names, as the scopes name them
            side.setdefault(node, name)
        srcs = {"x": self.x}
        for u, _, port in self.g.in_edges(inside, data="port"):
            if u not in inside and u != first:
                srcs.setdefault(side.get(u, port), u)
        role, source = self.role, f"{self.role}.share"
        if "cache" in srcs:
            p_cache = SubCacheParams(index)
            srcs["cache"] = self.add(
                f"{role}.cache_{index}", "sub_cache", p_cache, {"x": srcs["cache"]}, source=source
            )
        flops, useful = (sum(int(self.g.nodes[n][k]) for n in inside) for k in ("flops", "useful_flops"))
        p = CallParams(block, self.shape(self.x), flops, role, tuple(k for k in srcs if k != "x"), useful)
        return self.add(f"{role}.shared.{index}", "call", p, srcs, source=source)

    def model(self) -> None:
        outputs: dict[str, dict[str, str]] = {}
        for role, stack in self.spec.stacks.items():
            self.lower_stack(role, stack)
            outputs[role] = dict(self.memory)
        last = self.spec.output_stack
        self.role = "head"
        self.spec.head.lower(self, outputs[last]["x"], self.spec.stacks[last], outputs[last].get("mask"))


def _symbol(spec: Spec, role: str) -> str:
    """The symbolic length of a stack's sequence input: ``S``, or ``S_src`` / ``S_tgt`` in an encoder-decoder."""
    if spec.model != "encoder_decoder":
        return "S"
    return "S_src" if role == "encoder" else "S_tgt"


def _check_sizes(dims: dict[str, int]) -> None:
    problems = [
        Problem(name, f"{name}={value} is out of range", f"use 1 <= {name} <= {MAX_LEN}")
        for name, value in dims.items()
        if not 1 <= value <= MAX_LEN
    ]
    if problems:
        raise SpecError(problems)


def build_graph(
    spec: Spec,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    src_len: int | None = None,
    tgt_len: int | None = None,
) -> ArchGraph:
    """Lower a spec into its architecture graph, with FLOPs counted at the given sizes.

    Args:
        spec: a validated spec.
        batch: the batch size ``B`` FLOPs are counted at.
        seq_len: the sequence length ``S`` of a token or features input (encoder-only or decoder-only).
        src_len: the encoder's length ``S_src`` in an encoder-decoder.
        tgt_len: the decoder's length ``S_tgt`` in an encoder-decoder.

    Returns:
        The graph; ``graph.dims`` holds the sizes used. Image inputs fix their own token counts.

    Raises:
        TypeError, ValueError: a size that is not an integer >= 1 (``batch=2.5``, ``seq_len=0``), naming it.
    """

    def default(stack: StackSpec | None) -> int:
        return min(stack.facts.max_len, DEFAULT_SEQ_LEN) if stack is not None else DEFAULT_SEQ_LEN

    batch = argcheck.integer(batch, "batch", low=1)
    seq_len, src_len, tgt_len = (
        None if n is None else argcheck.integer(n, name, low=1, hint="None for the default")
        for n, name in ((seq_len, "seq_len"), (src_len, "src_len"), (tgt_len, "tgt_len"))
    )
    dims = {"B": batch}
    if spec.model == "encoder_decoder":
        dims["S_src"] = src_len or seq_len or default(spec.encoder)
        dims["S_tgt"] = tgt_len or seq_len or default(spec.decoder)
    else:
        dims["S"] = seq_len or default(spec.stacks[spec.output_stack])
    _check_sizes(dims)
    lowering = _Lowering(spec, Dims(dims))
    lowering.model()
    used = {d for _, shape in lowering.g.nodes(data="shape") for d in shape if isinstance(d, str)}
    sizes = {k: v for k, v in lowering.dims.sizes.items() if k in used}
    facts = {role: stack.facts for role, stack in spec.stacks.items()}
    graph = ArchGraph(spec, lowering.g, sizes, spec.model, spec.init or "vit", facts)
    verify(graph)
    return graph


def graph_of(
    source: Spec | ArchGraph | str | os.PathLike[str], overrides: Mapping[str, Any] | None = None
) -> ArchGraph:
    """The graph of a spec, a spec file (with overrides) or a graph itself.

    Args:
        source: a Spec, an ArchGraph, or the path of a spec file.
        overrides: dotted-key overrides for a spec or spec file, e.g. ``{"encoder.depth": 2}``.
    """
    if isinstance(source, ArchGraph):
        if overrides:
            raise ValueError("overrides apply to specs; lower the overridden spec into a new graph instead")
        return source
    if isinstance(source, Spec):
        spec = (
            parse_spec(source.model_dump(), source=source.name, overrides=overrides) if overrides else source
        )
    else:
        spec = load_spec(source, overrides=overrides)
    return build_graph(spec)
