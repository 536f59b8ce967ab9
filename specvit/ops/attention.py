"""The sublayers of a block's ``layers:`` list: the attentions and the MLP.

Every attention sublayer lowers to the one attention op (:mod:`specvit.ops.core`), its parts read from the
block's spec: the heads, biases, QK-norm, scale, soft-cap and sliding window every attention has; windows
and grid-relative tables from the token grid (:func:`~specvit.ops.grid.grid_parts`); talking heads; and
which tokens query. Its side inputs come by name from the stack (``ctx.side``): a padding mask, rotary
tables, an additive bias, DETR's positions, the KV cache; cross-attention also the memory and its mask,
positions and rotary tables. Whatever the stack has is wired; a new position or bias kind only has to put
its node into ``ctx.side``.
"""

from __future__ import annotations

from typing import Any

from specvit.ops.block import BlockCtx, Sublayer, sublayer
from specvit.ops.core import AttentionParams, configuration
from specvit.ops.grid import grid_parts
from specvit.ops.position import block_rope

__all__ = ["attention_params"]

SELF_SIDE = ("mask", "rope", "bias", "pos", "cache", "rel_embed", "rel_index", "global_mask")
CROSS_SIDE = ("memory", "memory_mask", "pos", "memory_pos", "rope", "memory_rope", "cache")


def attention_params(b: BlockCtx, **parts: Any) -> AttentionParams:
    """The attention of block ``b``: the parts every attention reads from the block's spec, then ``parts``
    (which override them: a cross-attention's own heads)."""
    s, spec = b.stack.stack, b.spec
    common: dict[str, Any] = {
        "dim": b.dim,
        "heads": b.heads,
        "kv_heads": b.kv_heads,
        "head_dim": b.head_dim,
        "qkv_bias": (spec.bias_of("q"), spec.bias_of("k"), spec.bias_of("v")),
        "proj_bias": spec.proj_bias,
        "qk_norm": spec.norm.kind if spec.qk_norm else None,
        "qk_norm_bias": spec.norm.bias,
        "qk_norm_affine": spec.norm.affine,
        "qk_norm_unit_offset": spec.norm.unit_offset,
        "qk_norm_scope": "all" if spec.qk_norm == "all" else "head",
        "qk_norm_late": spec.qk_norm_after_rope,
        "eps": spec.norm.eps,
        "attn_drop": s.dropout.attention,
        "proj_drop": s.dropout.projection,
        "scale": spec.attention_scale,
        "softcap": spec.attention_softcap,
        "layer": b.next_layer() if "cache" in b.side else 0,  # only cached layers need an index
    }
    return AttentionParams(**(common | parts))


def _add(b: BlockCtx, name: str, p: AttentionParams, x: str, side: dict[str, str], source: str) -> str:
    return b.add(name, configuration(p), p, {"x": x, **side}, source=source)


LAYER_TABLES = {"bias": "rel_bias"}
"""The node name of an attention layer's own table, by the port it feeds, where it is not the port's."""


@sublayer
class SelfAttentionLayer(Sublayer):
    """Every token attends to every token (or, with ``window``, to its window)."""

    kind = "self_attention"
    name = "attn"
    causal = False

    def lower(self, b: BlockCtx, x: str, name: str, source: str) -> str:
        grid, key = grid_parts(b)
        spec = b.spec
        window = grid.pop("window", spec.sliding_window)
        g = spec.global_tokens  # Longformer's: the global_mask input's tokens, or the first K
        grid |= {"global_tokens": g.first or "mask", "global_projection": g.projections} if g else {}
        p = attention_params(b, causal=self.causal, talking_heads=spec.talking_heads, **grid, window=window)
        side = {k: b.side[k] for k in SELF_SIDE if k in b.side}
        if p.global_tokens != "mask":  # only a layer of the mask's global tokens reads it
            side.pop("global_mask", None)
        if spec.rope is False:  # a block without positions (NoPE)
            side.pop("rope", None)
        elif spec.rope is not None:  # a block of its own theta
            side["rope"] = b.side.get(block_rope(spec.rope.base), side["rope"])
        for position in b.stack.stack.positions:  # a table of the layer's own (BEiT's bias, RoPE-Mixed's)
            port = position.writes()
            own = position.lower_layer(b, x, b.beside(name, "attn", LAYER_TABLES.get(port, port)))
            if own:
                side[port] = own
        return _add(b, name, p, x, side, key or source)


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
        side = {k: b.side[k] for k in CROSS_SIDE if k in b.side}
        if "memory_rope" not in side:
            side.pop("rope", None)  # rotating the queries alone would break RoPE's relative property
        if b.spec.memory_norm:  # a norm of the block's own on the memory (CroCo's norm_y)
            norm = b.beside(name, "cross_attn", "memory_norm")
            side["memory"] = b.norm(norm, side["memory"], f"{b.stack.role}.block.memory_norm")
        memory_dim = b.stack.shape(side["memory"])[-1]
        assert isinstance(memory_dim, int)
        return _add(b, name, attention_params(b, memory_dim=memory_dim, **_cross_heads(b)), x, side, source)


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
        inner |= {"dwconv": b.grid} if spec.mlp.dwconv else {}  # Mix-FFN: a depthwise conv over the grid
        p = MlpParams(b.dim, hidden, spec.mlp.activation, spec.mlp.bias, s.dropout.mlp, **inner)
        return b.add(name, "mlp", p, {"x": x}, source=f"{b.stack.role}.block.mlp")


@sublayer
class ClassAttentionLayer(Sublayer):
    """The class token attends over every token (CaiT); the block updates the class token only. It reads
    the padding mask alone: the rotary tables and biases of the stack are for every token's query."""

    kind = "class_attention"
    name = "attn"
    class_token_only = True  # the residual pattern narrows the block's adds to the class token

    def lower(self, b: BlockCtx, x: str, name: str, source: str) -> str:
        p = attention_params(b, projection="split", queries=1, qk_norm=None)
        side = {"mask": b.side["mask"]} if "mask" in b.side else {}
        return _add(b, name, p, x, side, source)
