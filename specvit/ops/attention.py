"""Attention ops and the sublayers of a block's ``layers:`` list that become them.

Every attention reads its side inputs by name from the stack (``ctx.side``): a padding mask, rotary
tables, an additive bias, DETR's positions, the KV cache; cross-attention also the memory and its mask,
positions and rotary tables. Whatever the stack has is wired; a new position or bias kind only has to
put its node into ``ctx.side``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specvit.ops.base import Dims, Op, Params, Shape, linear_flops, op
from specvit.ops.block import BlockCtx, Sublayer, sublayer
from specvit.ops.core import ATTENTION_MODULE, core_args
from specvit.ops.norm import norm_params

__all__ = ["AttentionParams", "CrossAttentionParams"]

_SELF_SIDE = ("mask", "rope", "bias", "pos", "cache")
_CROSS_SIDE = ("memory", "memory_mask", "pos", "memory_pos", "rope", "memory_rope", "cache")


@dataclass(frozen=True)
class AttentionParams(Params):
    """Multi-head attention with grouped KV heads, optional QK-norm and dropout.

    Args:
        dim: token width.
        heads: query heads.
        kv_heads: key/value heads (fewer for GQA, 1 for MQA).
        head_dim: width per head.
        qkv_bias: biases in the q, k and v projections.
        proj_bias: bias in the output projection.
        qk_norm: ``layernorm`` or ``rmsnorm`` per head on queries and keys, or None.
        qk_norm_bias: the QK LayerNorms have a bias.
        qk_norm_affine: the QK norms have a learned weight.
        qk_norm_unit_offset: the QK norms scale by ``1 + w``.
        qk_norm_scope: ``head`` (each head over head_dim) or ``all`` (a token's heads at once, OLMo 2).
        eps: epsilon of the QK norms.
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
        causal: a query sees only keys at or before its own position.
        scale: factor of q·k, or None for 1/sqrt(head_dim).
        window: keys further than ``window - 1`` positions away are hidden (a sliding window), or None.
        softcap: the logits soft-capped to ``softcap * tanh(logits / softcap)`` before the masks, or None.
        layer: the layer's index in a KV cache.
    """

    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: tuple[bool, bool, bool] = (True, True, True)
    proj_bias: bool = True
    qk_norm: str | None = None
    qk_norm_bias: bool = True
    qk_norm_affine: bool = True
    qk_norm_unit_offset: bool = False
    qk_norm_scope: str = "head"
    eps: float = 1e-6
    attn_drop: float = 0.0
    proj_drop: float = 0.0
    causal: bool = False
    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    layer: int = field(default=0, metadata={"varies": True})

    @property
    def qk_params(self) -> int:
        if not self.qk_norm:
            return 0
        q, k = (self.heads, self.kv_heads) if self.qk_norm_scope == "all" else (1, 1)
        hd, bias, affine = self.head_dim, self.qk_norm_bias, self.qk_norm_affine
        return norm_params(self.qk_norm, q * hd, bias, affine) + norm_params(
            self.qk_norm, k * hd, bias, affine
        )

    def qk_settings(self) -> dict[str, Any]:
        """The QK-norm's constructor arguments beyond kind, bias and eps that differ from the defaults."""
        if not self.qk_norm:
            return {}
        out: dict[str, Any] = {} if self.qk_norm_affine else {"qk_norm_affine": False}
        out |= {"qk_norm_unit_offset": True} if self.qk_norm_unit_offset else {}
        return out | ({"qk_norm_scope": "all"} if self.qk_norm_scope == "all" else {})

    def common(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "num_heads": self.heads,
            "num_kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "qkv_bias": self.qkv_bias if len(set(self.qkv_bias)) > 1 else self.qkv_bias[0],
            "proj_bias": self.proj_bias,
            "qk_norm": self.qk_norm,
            "qk_norm_bias": self.qk_norm_bias,
            **self.qk_settings(),
            "norm_eps": self.eps,
            "attn_drop": self.attn_drop,
            "proj_drop": self.proj_drop,
            "scale": self.scale,
            "softcap": self.softcap,
            "layer_idx": self.layer,
        }

    def bias_rows(self, kv_rows: int) -> int:
        """The q/k/v bias parameters: ``heads * head_dim`` for q, ``kv_rows`` for k and for v."""
        bq, bk, bv = self.qkv_bias
        return self.heads * self.head_dim * bq + kv_rows * (bk + bv)


def _heads_line(p: AttentionParams) -> str:
    return f"heads {p.heads} · kv_heads {p.kv_heads} · head_dim {p.head_dim}"


def _flags(p: AttentionParams) -> list[str]:
    flags = []
    if p.qk_norm:
        flags.append(f"qk {p.qk_norm}" + (" over all heads" if p.qk_norm_scope == "all" else ""))
    if p.attn_drop or p.proj_drop:
        flags.append(f"dropout {p.attn_drop:g}/{p.proj_drop:g}")
    if p.window is not None:
        flags.append(f"sliding window {p.window}")
    if p.scale is not None:
        flags.append(f"scale {p.scale:g}")
    if p.softcap is not None:
        flags.append(f"softcap {p.softcap:g}")
    if len(set(p.qkv_bias)) > 1:
        flags.append("bias " + "".join(c for c, b in zip("qkv", p.qkv_bias, strict=True) if b))
    return flags


def _init_biases(module: Any, fill: Any) -> None:
    """Layers by type, then the separate q/k/v biases of a projection with only some (zeros)."""
    fill.children(module)
    for name in ("q_bias", "k_bias", "v_bias"):
        if hasattr(module, name):
            fill.zeros(getattr(module, name))


@op
class SelfAttention(Op):
    kind = "self_attention"
    params_type = AttentionParams
    category = "attention"
    module = ATTENTION_MODULE
    ports = ("x", *_SELF_SIDE)

    def shape(self, p: AttentionParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        if inputs["x"][-1] != p.dim:
            raise ValueError(f"expects width {p.dim}, got {inputs['x'][-1]}")
        return inputs["x"]

    def params(self, p: AttentionParams) -> int:
        h, hkv, hd, d = p.heads, p.kv_heads, p.head_dim, p.dim
        qkv = (h + 2 * hkv) * hd
        return d * qkv + p.bias_rows(hkv * hd) + h * hd * d + d * p.proj_bias + p.qk_params

    def flops(self, p: AttentionParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        b, n, _ = inputs["x"]
        qkv = (p.heads + 2 * p.kv_heads) * p.head_dim
        scores = 4 * b * p.heads * n * n * p.head_dim  # q @ k^T and attn @ v
        return linear_flops(b * n, p.dim, qkv) + scores + linear_flops(b * n, p.heads * p.head_dim, p.dim)

    def ctor(self, p: AttentionParams) -> dict[str, Any]:
        return core_args(**p.common(), causal=p.causal, window=p.window)

    def init(self, module: Any, p: AttentionParams, fill: Any) -> None:
        _init_biases(module, fill)

    def label(self, p: AttentionParams) -> tuple[str, ...]:
        return _heads_line(p), " · ".join(["causal" if p.causal else "not causal", *_flags(p)])


@dataclass(frozen=True)
class CrossAttentionParams(AttentionParams):
    """Attention from the tokens (queries) to a memory (keys and values) of width ``memory_dim``."""

    memory_dim: int = 0


@op
class CrossAttention(Op):
    kind = "cross_attention"
    params_type = CrossAttentionParams
    category = "attention"
    module = ATTENTION_MODULE
    ports = ("x", *_CROSS_SIDE)
    required = ("x", "memory")

    def params(self, p: CrossAttentionParams) -> int:
        h, hkv, hd, d = p.heads, p.kv_heads, p.head_dim, p.dim
        q, kv = h * hd, 2 * hkv * hd
        return d * q + p.memory_dim * kv + p.bias_rows(hkv * hd) + q * d + d * p.proj_bias + p.qk_params

    def flops(self, p: CrossAttentionParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        b, n, _ = inputs["x"]
        m = inputs["memory"][1]
        hd, h = p.head_dim, p.heads
        return (
            linear_flops(b * n, p.dim, h * hd)
            + linear_flops(b * m, p.memory_dim, 2 * p.kv_heads * hd)
            + 4 * b * h * n * m * hd
            + linear_flops(b * n, h * hd, p.dim)
        )

    def ctor(self, p: CrossAttentionParams) -> dict[str, Any]:
        return core_args(**p.common(), memory_dim=p.memory_dim)

    def init(self, module: Any, p: CrossAttentionParams, fill: Any) -> None:
        _init_biases(module, fill)

    def label(self, p: CrossAttentionParams) -> tuple[str, ...]:
        return _heads_line(p), " · ".join([f"memory dim {p.memory_dim}", *_flags(p)])


def _side(b: BlockCtx, names: tuple[str, ...]) -> dict[str, str]:
    return {k: b.side[k] for k in names if k in b.side}


def _attention_params(b: BlockCtx, cls: type[AttentionParams], **extra: Any) -> Any:
    s, spec = b.stack.stack, b.spec
    heads = {"heads": b.heads, "kv_heads": b.kv_heads, "head_dim": b.head_dim}
    return cls(
        dim=b.dim,
        **(heads | {k: extra.pop(k) for k in heads if k in extra}),
        qkv_bias=(spec.bias_of("q"), spec.bias_of("k"), spec.bias_of("v")),
        proj_bias=spec.proj_bias,
        qk_norm=spec.norm.kind if spec.qk_norm else None,
        qk_norm_bias=spec.norm.bias,
        qk_norm_affine=spec.norm.affine,
        qk_norm_unit_offset=spec.norm.unit_offset,
        qk_norm_scope="all" if spec.qk_norm == "all" else "head",
        eps=spec.norm.eps,
        attn_drop=s.dropout.attention,
        proj_drop=s.dropout.projection,
        scale=spec.attention_scale,
        softcap=spec.attention_softcap,
        layer=b.next_layer() if "cache" in b.side else 0,  # only cached layers need an index
        **extra,
    )


@sublayer
class SelfAttentionLayer(Sublayer):
    """Every token attends to every token (or, with ``window``, to its window)."""

    kind = "self_attention"
    name = "attn"
    causal = False

    def lower(self, b: BlockCtx, x: str, name: str, source: str) -> str:
        from specvit.ops.vitdet import lower_grid_attention

        if (grid := lower_grid_attention(b, x, name)) is not None:  # ViTDet: padded windows, global
            return grid
        if b.window is not None:
            from specvit.ops.window import window_params

            source = f"{b.stack.role}.block.window"
            return b.add(name, "window_attention", window_params(b), {"x": x}, source=source)
        p = _attention_params(b, AttentionParams, causal=self.causal, window=b.spec.sliding_window)
        side = _side(b, _SELF_SIDE)
        for position in b.stack.stack.positions:  # a bias table of the layer's own (BEiT)
            own = position.lower_layer(b, x, b.beside(name, "attn", "rel_bias"))
            side["bias"] = own or side.get("bias", "")
        kind = "talking_heads_attention" if b.spec.talking_heads else "self_attention"  # CaiT (ops/cait.py)
        return b.add(name, kind, p, {"x": x, **side}, source=source)


@sublayer
class MaskedSelfAttentionLayer(SelfAttentionLayer):
    """Every token attends to itself and the tokens before it (causal)."""

    kind = "masked_self_attention"
    causal = True


@sublayer
class CrossAttentionLayer(Sublayer):
    """The tokens attend to the encoder's output (the memory)."""

    kind = "cross_attention"
    name = "cross_attn"

    def lower(self, b: BlockCtx, x: str, name: str, source: str) -> str:
        side = _side(b, _CROSS_SIDE)
        if "memory_rope" not in side:
            side.pop("rope", None)  # rotating the queries alone would break RoPE's relative property
        if b.spec.memory_norm:  # a norm of the block's own on the memory (CroCo's norm_y)
            norm = b.beside(name, "cross_attn", "memory_norm")
            side["memory"] = b.norm(norm, side["memory"], f"{b.stack.role}.block.memory_norm")
        memory_dim = b.stack.shape(side["memory"])[-1]
        assert isinstance(memory_dim, int)
        p = _attention_params(b, CrossAttentionParams, memory_dim=memory_dim, **_cross_heads(b))
        return b.add(name, "cross_attention", p, {"x": x, **side}, source=source)


def _cross_heads(b: BlockCtx) -> dict[str, int]:
    """The cross-attention's own heads and head width, where the block sets them (Perceiver's cross-attend:
    one head as wide as its input)."""
    spec, out = b.spec, {}
    if spec.cross_attention_heads is not None:
        h = spec.cross_attention_heads
        out = {"heads": h, "kv_heads": h, "head_dim": spec.head_dim or b.dim // h}
    if spec.cross_attention_head_dim is not None:
        out["head_dim"] = spec.cross_attention_head_dim
    return out


@sublayer
class MlpLayer(Sublayer):
    """The position-wise feed-forward network."""

    kind = "mlp"
    name = "mlp"

    def lower(self, b: BlockCtx, x: str, name: str, source: str) -> str:
        from specvit.ops.mlp import MlpParams

        spec, s = b.spec, b.stack.stack
        hidden = int(spec.mlp.hidden * b.dim / s.width)  # stages widen the MLP with the width
        n = spec.norm if spec.mlp.norm else None  # the inner norm is of the block's kind (timm's norm_layer)
        inner = {"norm": n.kind, "norm_eps": n.eps, "norm_bias": n.bias} if n else {}
        inner |= {"norm_affine": n.affine, "norm_unit_offset": n.unit_offset} if n else {}
        if spec.mlp.moe is not None:
            from specvit.ops.moe import lower_moe

            return lower_moe(b, x, name, hidden)
        p = MlpParams(b.dim, hidden, spec.mlp.activation, spec.mlp.bias, s.dropout.mlp, **inner)
        return b.add(name, "mlp", p, {"x": x}, source=f"{b.stack.role}.block.mlp")
