"""Lowering: a validated Spec -> an ArchGraph with shapes, parameters and FLOPs on every node.

The only graph module that reads the spec. Parameter and FLOP rules are written once here, per op,
and follow ``torch.utils.flop_counter.FlopCounterMode``: matmuls and convolutions count
2 x multiply-adds; element-wise work (norms, activations, adds, softmax) counts nothing.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from specvit.errors import Problem, SpecError
from specvit.graph.ir import ArchGraph, Dim, Shape
from specvit.spec.schema import (
    MAX_LEN,
    ClassifierHead,
    DetectionHead,
    FeaturesInput,
    ImageInput,
    LearnedPosition,
    LMHead,
    PatchesHead,
    QueriesInput,
    SiameseInput,
    Spec,
    StackSpec,
    TokensInput,
)

__all__ = ["DEFAULT_SEQ_LEN", "build_graph"]

DEFAULT_SEQ_LEN = 128

_SUBLAYER_MODULE = {
    "self_attention": "attn",
    "masked_self_attention": "attn",
    "cross_attention": "cross_attn",
    "mlp": "mlp",
}


def norm_params(kind: str, dim: int, bias: bool) -> int:
    """Parameters of a norm over ``dim`` features."""
    return dim * (2 if kind == "layernorm" and bias else 1)


def linear_flops(tokens: int, d_in: int, d_out: int) -> int:
    return 2 * tokens * d_in * d_out


class _Lowering:
    def __init__(self, spec: Spec, dims: dict[str, int]):
        self.spec = spec
        self.dims = dims
        self.g = nx.DiGraph()
        self.qk_pos: str | None = None  # node whose output every attention of the current stack adds to q, k
        self.memory_pos: str | None = None  # node added to the memory's keys in cross-attention

    def size(self, d: Dim) -> int:
        return d if isinstance(d, int) else self.dims[d]

    def numel(self, shape: Shape) -> int:
        """Product of all dims but the last: the number of vectors a per-token layer sees."""
        out = 1
        for d in shape[:-1]:
            out *= self.size(d)
        return out

    def add(
        self,
        path: str,
        op: str,
        *,
        shape: Shape,
        srcs: dict[str, str] | None = None,
        expects: dict[str, Shape] | None = None,
        params: int = 0,
        flops: int = 0,
        module: bool = True,
        hparams: dict[str, Any] | None = None,
        source: str = "",
        block: str | None = None,
        stack: str = "",
    ) -> str:
        srcs = srcs or {}
        location = self.spec.locate(source) if source else None
        self.g.add_node(
            path,
            op=op,
            module=module,
            hparams=hparams or {},
            shape=shape,
            inputs=expects if expects is not None else {p: self.g.nodes[s]["shape"] for p, s in srcs.items()},
            params=params,
            flops=flops,
            source=str(location) if location else "",
            spec_key=source,
            block=block,
            stack=stack,
        )
        for port, src in srcs.items():
            self.g.add_edge(src, path, port=port)
        return path

    # -- one stack ------------------------------------------------------------------------------

    def stack(self, role: str, s: StackSpec, seq: Dim, memory: tuple[str, Dim, int] | None) -> str:
        B, D = "B", s.width
        b = s.block
        norm_kind, eps, nbias = b.norm.kind, b.norm.eps, b.norm.bias

        def norm(
            path: str, x: str, source: str, block: str | None = None, dim: int = D, memory: bool = False
        ) -> str:
            shape = self.g.nodes[x]["shape"]
            hparams: dict[str, Any] = {"dim": dim, "eps": eps, "bias": nbias}
            if memory:  # normalises the memory a cross-attention reads (CroCo's norm_y)
                hparams["memory"] = True
            return self.add(
                path,
                norm_kind,
                shape=shape,
                srcs={"x": x},
                expects={"x": (*shape[:-1], dim)},
                params=norm_params(norm_kind, dim, nbias),
                hparams=hparams,
                source=source,
                block=block,
                stack=role,
            )

        inp = s.input
        # -- input and embedding
        if isinstance(inp, ImageInput):
            (ih, iw), (ph, pw), c = inp.size, inp.patch, inp.channels
            x = self.add(
                f"{role}.input",
                "input",
                shape=(B, c, ih, iw),
                module=False,
                hparams={"kind": "image", "size": [ih, iw], "channels": c},
                source=f"{role}.input",
                stack=role,
            )
            n: Dim = inp.num_patches
            x = self.add(
                f"{role}.patch_embed",
                "patch_embed",
                shape=(B, n, D),
                srcs={"x": x},
                expects={"x": (B, c, ih, iw)},
                params=c * ph * pw * D + D * inp.bias,
                flops=linear_flops(self.size(B) * inp.num_patches, c * ph * pw, D),
                hparams={
                    "patch": [ph, pw],
                    "grid": list(inp.grid),
                    "channels": c,
                    "dim": D,
                    "projection": inp.projection,
                    "bias": inp.bias,
                },
                source=f"{role}.input",
                stack=role,
            )
        elif isinstance(inp, TokensInput):
            x = self.add(
                f"{role}.input",
                "input",
                shape=(B, seq),
                module=False,
                hparams={"kind": "tokens", "vocab": inp.vocab},
                source=f"{role}.input",
                stack=role,
            )
            shared = role == "decoder" and self.spec.shared_embeddings
            x = self.add(
                f"{role}.tok_embed",
                "token_embed",
                shape=(B, seq, D),
                srcs={"x": x},
                params=0 if shared else inp.vocab * D,
                hparams={
                    "vocab": inp.vocab,
                    "dim": D,
                    "scale": inp.scale,
                    "padding_idx": inp.padding_idx,
                    "shared_with": "encoder.tok_embed" if shared else None,
                },
                source=f"{role}.input",
                stack=role,
            )
            if inp.type_vocab:
                x = self.add(
                    f"{role}.type_embed",
                    "type_embed",
                    shape=(B, seq, D),
                    srcs={"x": x},
                    params=inp.type_vocab * D,
                    hparams={"type_vocab": inp.type_vocab, "dim": D},
                    source=f"{role}.input.type_vocab",
                    stack=role,
                )
            n = seq
        elif isinstance(inp, QueriesInput):
            # DETR: the decoder starts from zeros; the learned queries are the positions of every attention
            x = self.add(
                f"{role}.input",
                "input",
                shape=(B, seq, D),
                module=False,
                hparams={"kind": "queries", "count": inp.count},
                source=f"{role}.input",
                stack=role,
            )
            self.qk_pos = self.add(
                f"{role}.query_embed",
                "queries",
                shape=(B, seq, D),
                srcs={"x": x},
                params=inp.count * D,
                hparams={"count": inp.count, "dim": D},
                source=f"{role}.input",
                stack=role,
            )
            n = seq
        elif isinstance(inp, SiameseInput):
            # CroCo: the shared encoder runs again on a second image; one linear layer (decoder_embed)
            # projects both its output (the decoder's tokens) and the first image's (the memory)
            enc = self.spec.encoder
            assert enc is not None and isinstance(enc.input, ImageInput) and memory is not None
            (ih, iw), c = enc.input.size, enc.input.channels
            mem_node, mlen, dm = memory
            x = self.add(
                f"{role}.input",
                "input",
                shape=(B, c, ih, iw),
                module=False,
                hparams={"kind": "siamese", "size": [ih, iw], "channels": c},
                source=f"{role}.input",
                stack=role,
            )
            x = self.add(
                f"{role}.encoder",
                "shared_encoder",
                shape=(B, mlen, dm),
                srcs={"x": x},
                expects={"x": (B, c, ih, iw)},
                module=False,  # the encoder's modules, run a second time: their FLOPs again, no parameters
                flops=sum(int(a["flops"]) for _, a in self.g.nodes(data=True) if a["stack"] == "encoder"),
                hparams={"shared_with": "encoder", "grid": list(enc.input.grid), "dim": dm},
                source=f"{role}.input",
                stack=role,
            )
            tokens = self.size(B) * self.size(mlen)
            x = self.add(
                f"{role}.embed",
                "linear",
                shape=(B, mlen, D),
                srcs={"x": x},
                params=dm * D + D,
                flops=linear_flops(tokens, dm, D),
                hparams={"in": dm, "out": D, "bias": True},
                source=f"{role}.input",
                stack=role,
            )
            projected = self.add(
                f"{role}.memory_embed",
                "linear",
                shape=(B, mlen, D),
                srcs={"x": mem_node},
                flops=linear_flops(tokens, dm, D),
                hparams={"in": dm, "out": D, "bias": True, "shared_with": f"{role}.embed"},
                source=f"{role}.input",
                stack=role,
            )
            memory = (projected, mlen, D)
            n = mlen
        else:
            assert isinstance(inp, FeaturesInput)
            x = self.add(
                f"{role}.input",
                "input",
                shape=(B, seq, inp.dim),
                module=False,
                hparams={"kind": "features", "dim": inp.dim, "grid": list(inp.grid) if inp.grid else None},
                source=f"{role}.input",
                stack=role,
            )
            project = inp.project if inp.project is not None else inp.dim != D
            if project:
                x = self.add(
                    f"{role}.feat_proj",
                    "linear",
                    shape=(B, seq, D),
                    srcs={"x": x},
                    expects={"x": (B, seq, inp.dim)},
                    params=inp.dim * D + D,
                    flops=linear_flops(self.numel((B, seq, D)), inp.dim, D),
                    hparams={"in": inp.dim, "out": D, "bias": True},
                    source=f"{role}.input",
                    stack=role,
                )
            n = seq

        # -- prefix tokens and positions (learned tables either side of the prefix, as configured)
        pos = s.position
        P = s.num_prefix
        before_prefix = (
            isinstance(pos, LearnedPosition) and not pos.include_prefix
        ) or pos.kind == "sincos2d"

        def positions(x: str, tokens: Dim) -> str:
            shape = self.g.nodes[x]["shape"]
            hp: dict[str, Any] = {"kind": pos.kind, "dim": D}
            params = 0
            if isinstance(pos, LearnedPosition):
                length = pos.max_len if pos.max_len is not None else self.size(tokens)
                hp["max_len"] = length
                params = length * D
            else:
                hp["base"] = getattr(pos, "base", None)
                if pos.kind == "sincos2d":
                    assert isinstance(inp, ImageInput)
                    hp["grid"] = list(inp.grid)
            return self.add(
                f"{role}.pos_embed",
                f"pos_{pos.kind}",
                shape=shape,
                srcs={"x": x},
                params=params,
                hparams=hp,
                source=f"{role}.position",
                stack=role,
            )

        if pos.kind == "sine2d":  # not added to the tokens: every attention adds it to its queries and keys
            assert s.grid is not None
            self.qk_pos = self.add(
                f"{role}.pos_embed",
                "pos_sine2d",
                shape=(1, n, D),
                srcs={"x": x},
                hparams={"kind": "sine2d", "dim": D, "base": pos.base, "grid": list(s.grid)},
                source=f"{role}.position",
                stack=role,
            )
        has_table = pos.kind in ("learned", "sincos", "sincos2d")
        if has_table and before_prefix:
            x = positions(x, n)
        if P:
            n = n + P if isinstance(n, int) else n
            if not isinstance(n, int):
                n = f"{n}+{P}"
                self.dims.setdefault(n, self.dims[str(seq)] + P)
            x = self.add(
                f"{role}.prefix",
                "prefix",
                shape=(B, n, D),
                srcs={"x": x},
                params=P * D,
                hparams={"cls": s.prefix.cls, "registers": s.prefix.registers, "dim": D},
                source=f"{role}.prefix",
                stack=role,
            )
        if has_table and not before_prefix:
            x = positions(x, n)
        if s.embed_norm:
            x = norm(f"{role}.embed_norm", x, f"{role}.embed_norm")

        # -- blocks, stage by stage (a plain stack is one stage whose blocks are {role}.blocks.i)
        rope = (
            {"kind": pos.kind, "base": getattr(pos, "base", None)} if pos.kind in ("rope", "rope2d") else None
        )
        names = [_SUBLAYER_MODULE[layer] for layer in b.layers]
        names = [f"{nm}{k + 1}" if names.count(nm) > 1 else nm for k, nm in enumerate(names)]
        grid = s.input.grid if isinstance(s.input, ImageInput) else None
        index = 0  # block index over the whole stack, for the stochastic-depth schedule
        for si, (depth, H) in enumerate(zip(s.stage_depths, s.stage_heads, strict=True)):
            D = s.stage_widths[si]
            stage = f"{role}.stages.{si}" if s.hierarchical else role
            if si > 0:
                assert grid is not None
                C, (gh, gw) = D // 2, grid
                n = n // 4 if isinstance(n, int) else n
                x = self.add(
                    f"{stage}.downsample",
                    "patch_merging",
                    shape=(B, n, D),
                    srcs={"x": x},
                    expects={"x": (B, gh * gw, C)},
                    params=norm_params(norm_kind, 4 * C, nbias) + 8 * C * C,
                    flops=linear_flops(self.size(B) * self.size(n), 4 * C, D),
                    hparams={
                        "dim": C,
                        "out": D,
                        "grid": [gh, gw],
                        "norm": norm_kind,
                        "eps": eps,
                        "bias": nbias,
                    },
                    source=f"{role}.depth",
                    stack=role,
                )
                grid = (gh // 2, gw // 2)
            for i in range(depth):
                blk = f"{stage}.blocks.{i}"
                dp = s.drop_path * index / (s.total_depth - 1) if s.total_depth > 1 else 0.0
                shift = 0
                if b.window is not None and grid is not None:
                    m = min(b.window.size, *grid)  # a stage smaller than the window attends over all of it
                    shift = m // 2 if b.window.shift and i % 2 and min(grid) > b.window.size else 0
                x = self._block(role, s, blk, x, n, D, H, names, rope, memory, dp, grid, shift, norm)
                index += 1
        if s.final_norm:
            x = norm(f"{role}.norm", x, f"{role}.final_norm", dim=s.out_width)
        return x

    def _block(
        self,
        role: str,
        s: StackSpec,
        blk: str,
        x: str,
        n: Dim,
        D: int,
        H: int,
        names: list[str],
        rope: dict[str, Any] | None,
        memory: tuple[str, Dim, int] | None,
        dp: float,
        grid: tuple[int, int] | None,
        shift: int,
        norm: Any,
    ) -> str:
        """One residual block's nodes; returns the block's output node."""
        B, b = "B", s.block
        Hkv = s.kv_heads if not s.hierarchical else H
        hd = s.head_dim if not s.hierarchical else D // H
        tokens = self.numel((B, n, D))
        norm_kind, nbias = b.norm.kind, b.norm.bias
        qk_params = 2 * norm_params(norm_kind, hd, nbias) if b.qk_norm else 0
        attn_hp = {
            "dim": D,
            "heads": H,
            "kv_heads": Hkv,
            "head_dim": hd,
            "qkv_bias": b.qkv_bias,
            "proj_bias": b.proj_bias,
            "eps": b.norm.eps,
            "attn_drop": s.dropout.attention,
            "proj_drop": s.dropout.projection,
            "qk_norm": norm_kind if b.qk_norm else None,
        }
        mlp_hidden = int(b.mlp.hidden * D / s.width) if b.mlp.hidden is not None else 4 * D
        fc1_out = 2 * mlp_hidden if b.mlp.activation in ("swiglu", "geglu") else mlp_hidden
        for k, (layer, name) in enumerate(zip(b.layers, names, strict=True), start=1):
            src_key = f"{role}.block.layers.{k - 1}"
            residual = x
            h = norm(f"{blk}.norm{k}", x, f"{role}.block.norm", blk, D) if b.norm.placement == "pre" else x
            if layer == "self_attention" and b.window is not None:
                assert grid is not None
                m = min(b.window.size, *grid)
                h = self.add(
                    f"{blk}.{name}",
                    "window_attention",
                    shape=(B, n, D),
                    srcs={"x": h},
                    expects={"x": (B, n, D)},
                    params=D * 3 * D + 3 * D * b.qkv_bias + D * D + D * b.proj_bias + (2 * m - 1) ** 2 * H,
                    flops=linear_flops(tokens, D, 3 * D)
                    + 4 * tokens * m * m * D
                    + linear_flops(tokens, D, D),
                    hparams={**attn_hp, "window": m, "shift": shift, "grid": list(grid)},
                    source=f"{role}.block.window",
                    block=blk,
                    stack=role,
                )
            elif layer in ("self_attention", "masked_self_attention"):
                srcs: dict[str, str] = {"x": h}
                expects: dict[str, Shape] = {"x": (B, n, D)}
                if self.qk_pos is not None:
                    srcs["pos"], expects["pos"] = self.qk_pos, self.g.nodes[self.qk_pos]["shape"]
                h = self.add(
                    f"{blk}.{name}",
                    layer,
                    shape=(B, n, D),
                    srcs=srcs,
                    expects=expects,
                    params=D * (H + 2 * Hkv) * hd
                    + (H + 2 * Hkv) * hd * b.qkv_bias
                    + H * hd * D
                    + D * b.proj_bias
                    + qk_params,
                    flops=linear_flops(tokens, D, (H + 2 * Hkv) * hd)
                    + 4 * self.size(B) * H * self.size(n) ** 2 * hd
                    + linear_flops(tokens, H * hd, D),
                    hparams={**attn_hp, "causal": layer == "masked_self_attention", "rope": rope},
                    source=src_key,
                    block=blk,
                    stack=role,
                )
            elif layer == "cross_attention":
                assert memory is not None
                mem_node, mlen, dm = memory
                if b.memory_norm:
                    mem_node = norm(
                        f"{blk}.{name.replace('cross_attn', 'memory_norm')}",
                        mem_node,
                        f"{role}.block.memory_norm",
                        blk,
                        dm,
                        memory=True,
                    )
                mem_tokens = self.size("B") * self.size(mlen)
                srcs = {"x": h, "memory": mem_node}
                expects = {"x": (B, n, D), "memory": (B, mlen, dm)}
                for port, node in (("pos", self.qk_pos), ("memory_pos", self.memory_pos)):
                    if node is not None:
                        srcs[port], expects[port] = node, self.g.nodes[node]["shape"]
                h = self.add(
                    f"{blk}.{name}",
                    layer,
                    shape=(B, n, D),
                    srcs=srcs,
                    expects=expects,
                    params=D * H * hd
                    + H * hd * b.qkv_bias
                    + dm * 2 * Hkv * hd
                    + 2 * Hkv * hd * b.qkv_bias
                    + H * hd * D
                    + D * b.proj_bias
                    + qk_params,
                    flops=linear_flops(tokens, D, H * hd)
                    + linear_flops(mem_tokens, dm, 2 * Hkv * hd)
                    + 4 * self.size(B) * H * self.size(n) * self.size(mlen) * hd
                    + linear_flops(tokens, H * hd, D),
                    # a siamese decoder's memory lies on its own patch grid: RoPE rotates queries and keys
                    hparams={
                        **attn_hp,
                        "memory_dim": dm,
                        "rope": rope if isinstance(s.input, SiameseInput) else None,
                    },
                    source=src_key,
                    block=blk,
                    stack=role,
                )
            else:
                h = self.add(
                    f"{blk}.{name}",
                    "mlp",
                    shape=(B, n, D),
                    srcs={"x": h},
                    expects={"x": (B, n, D)},
                    params=D * fc1_out + fc1_out * b.mlp.bias + mlp_hidden * D + D * b.mlp.bias,
                    flops=linear_flops(tokens, D, fc1_out) + linear_flops(tokens, mlp_hidden, D),
                    hparams={
                        "dim": D,
                        "hidden": mlp_hidden,
                        "activation": b.mlp.activation,
                        "bias": b.mlp.bias,
                        "dropout": s.dropout.mlp,
                    },
                    source=f"{role}.block.mlp",
                    block=blk,
                    stack=role,
                )
            if b.layer_scale is not None:
                h = self.add(
                    f"{blk}.ls{k}",
                    "layer_scale",
                    shape=(B, n, D),
                    srcs={"x": h},
                    params=D,
                    hparams={"dim": D, "init": b.layer_scale},
                    source=f"{role}.block.layer_scale",
                    block=blk,
                    stack=role,
                )
            x = self.add(
                f"{blk}.add{k}",
                "add",
                shape=(B, n, D),
                srcs={"x": residual, "branch": h},
                module=False,
                hparams={"drop_path": round(dp, 6)},
                source=src_key,
                block=blk,
                stack=role,
            )
            if b.norm.placement == "post":
                x = norm(f"{blk}.norm{k}", x, f"{role}.block.norm", blk, D)
        return x

    # -- whole model ----------------------------------------------------------------------------

    def model(self) -> None:
        spec = self.spec
        memory: tuple[str, Dim, int] | None = None
        x = ""
        for role, stack in spec.stacks.items():
            inp = stack.input
            fixed = (
                inp.count
                if isinstance(inp, QueriesInput)
                else inp.num_tokens
                if isinstance(inp, FeaturesInput)
                else None
            )
            seq: Dim = (
                memory[1]
                if isinstance(inp, SiameseInput) and memory is not None
                else fixed
                or stack.num_tokens
                or ("S" if spec.model != "encoder_decoder" else ("S_src" if role == "encoder" else "S_tgt"))
            )
            self.qk_pos = None
            x = self.stack(role, stack, seq, memory)
            if role == "encoder":
                memory = (x, self.g.nodes[x]["shape"][1], stack.out_width)
                self.memory_pos = self.qk_pos  # DETR: the encoder's positions go to the memory's keys
        last = spec.stacks[spec.output_stack]
        head = spec.head
        B, D = "B", last.out_width
        shape = self.g.nodes[x]["shape"]
        if isinstance(head, ClassifierHead):
            x = self.add(
                "head.pool",
                "pool",
                shape=(B, D),
                srcs={"x": x},
                module=False,
                hparams={"pool": head.pool, "num_prefix": last.num_prefix},
                source="head.pool",
                stack="head",
            )
            if head.norm:
                x = self.add(
                    "head.norm",
                    last.block.norm.kind,
                    shape=(B, D),
                    srcs={"x": x},
                    params=norm_params(last.block.norm.kind, D, last.block.norm.bias),
                    hparams={"dim": D, "eps": last.block.norm.eps, "bias": last.block.norm.bias},
                    source="head.norm",
                    stack="head",
                )
            x = self.add(
                "head.fc",
                "linear",
                shape=(B, head.classes),
                srcs={"x": x},
                expects={"x": (B, D)},
                params=D * head.classes + head.classes * head.bias,
                flops=linear_flops(self.size(B), D, head.classes),
                hparams={"in": D, "out": head.classes, "bias": head.bias, "dropout": head.dropout},
                source="head",
                stack="head",
            )
        elif isinstance(head, LMHead):
            assert isinstance(last.input, TokensInput)
            vocab = head.vocab or last.input.vocab
            owner = "encoder" if spec.shared_embeddings else spec.output_stack
            x = self.add(
                "head.fc",
                "linear",
                shape=(*shape[:-1], vocab),
                srcs={"x": x},
                expects={"x": shape},
                params=(0 if head.tied else D * vocab) + vocab * head.bias,
                flops=linear_flops(self.numel(shape), D, vocab),
                hparams={
                    "in": D,
                    "out": vocab,
                    "bias": head.bias,
                    "tied_to": f"{owner}.tok_embed" if head.tied else None,
                },
                source="head",
                stack="head",
            )
        elif isinstance(head, PatchesHead):
            image = spec.encoder if isinstance(last.input, SiameseInput) else last
            assert image is not None and isinstance(image.input, ImageInput)
            (ph, pw), c = image.input.patch, image.input.channels
            x = self.add(
                "head.fc",
                "linear",
                shape=(*shape[:-1], ph * pw * c),
                srcs={"x": x},
                expects={"x": shape},
                params=D * ph * pw * c + ph * pw * c * head.bias,
                flops=linear_flops(self.numel(shape), D, ph * pw * c),
                hparams={"in": D, "out": ph * pw * c, "bias": head.bias, "patch": [ph, pw], "channels": c},
                source="head",
                stack="head",
            )
        elif isinstance(head, DetectionHead):
            tokens = self.numel(shape)
            logits = self.add(
                "head.class_embed",
                "linear",
                shape=(*shape[:-1], head.classes + 1),
                srcs={"x": x},
                expects={"x": shape},
                params=(D + 1) * (head.classes + 1),
                flops=linear_flops(tokens, D, head.classes + 1),
                hparams={"in": D, "out": head.classes + 1, "bias": True},
                source="head.classes",
                stack="head",
            )
            hidden = head.box_layers - 1
            boxes = self.add(
                "head.bbox_embed",
                "box_mlp",
                shape=(*shape[:-1], 4),
                srcs={"x": x},
                expects={"x": shape},
                params=hidden * (D * D + D) + 4 * D + 4,
                flops=hidden * linear_flops(tokens, D, D) + linear_flops(tokens, D, 4),
                hparams={"dim": D, "layers": head.box_layers},
                source="head.box_layers",
                stack="head",
            )
            self.add(
                "output",
                "output",
                shape=self.g.nodes[logits]["shape"],
                srcs={"logits": logits, "boxes": boxes},
                module=False,
                stack="head",
                hparams={"model": spec.model, "outputs": {"boxes": (*shape[:-1], 4)}},
            )
            return
        self.add(
            "output",
            "output",
            shape=self.g.nodes[x]["shape"],
            srcs={"x": x},
            module=False,
            stack="head",
            hparams={"model": spec.model},
        )


def _check_sizes(spec: Spec, dims: dict[str, int]) -> None:
    problems = [
        Problem(name, f"{name}={value} is out of range", f"use 1 <= {name} <= {MAX_LEN}")
        for name, value in dims.items()
        if not 1 <= value <= MAX_LEN
    ]
    for role, stack in spec.stacks.items():
        pos = stack.position
        if isinstance(pos, LearnedPosition) and pos.max_len is not None and stack.num_tokens is None:
            symbol = "S" if "S" in dims else ("S_src" if role == "encoder" else "S_tgt")
            needed = dims[symbol] + (stack.num_prefix if pos.include_prefix else 0)
            if needed > pos.max_len:
                problems.append(
                    Problem(
                        f"{role}.position.max_len",
                        f"{symbol}={dims[symbol]} is longer than the {pos.max_len} learned positions",
                        f"use {symbol} <= {pos.max_len - needed + dims[symbol]}, or raise max_len",
                        spec.locate(f"{role}.position.max_len"),
                    )
                )
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
    """
    from specvit.graph.verify import verify

    def default(stack: StackSpec | None) -> int:
        pos = stack.position if stack is not None else None
        if isinstance(pos, LearnedPosition) and pos.max_len is not None:
            return min(pos.max_len, DEFAULT_SEQ_LEN)
        return DEFAULT_SEQ_LEN

    dims = {"B": batch}
    if spec.model == "encoder_decoder":
        dims["S_src"] = src_len or seq_len or default(spec.encoder)
        dims["S_tgt"] = tgt_len or seq_len or default(spec.decoder)
    else:
        dims["S"] = seq_len or default(spec.stacks[spec.output_stack])
    _check_sizes(spec, dims)
    lowering = _Lowering(spec, dims)
    lowering.model()
    used = {d for _, shape in lowering.g.nodes(data="shape") for d in shape if isinstance(d, str)}
    graph = ArchGraph(spec, lowering.g, {k: v for k, v in lowering.dims.items() if k in used})
    verify(graph)
    return graph
