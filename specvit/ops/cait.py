"""CaiT's ops (Touvron et al. 2021): talking-heads self-attention and the class-attention stage.

- ``talking_heads_attention``: the node a ``self_attention`` sublayer becomes in a block with
  ``talking_heads: true``: the scores are mixed across heads before and after the softmax.
- ``class_attention`` (a sublayer of ``layers:``): only the class token forms a query, over every token;
  its branch and every sublayer after it in the block update the class token alone. The residual
  pattern (:mod:`specvit.patterns.residual`) takes the class token out of the block's input for the adds
  (``class_token``) and puts the updated one back in front of the other tokens (``join_class_token``).

The class token itself enters where the stack's ``prefix.at`` says (CaiT: after the self-attention blocks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specvit.ops.attention import (
    AttentionParams,
    SelfAttention,
    _attention_params,
    _flags,
    _heads_line,
    _side,
)
from specvit.ops.base import Dims, Op, Params, Shape, linear_flops, op
from specvit.ops.block import BlockCtx, Sublayer, sublayer
from specvit.ops.core import ATTENTION_MODULE, core_args

__all__ = ["TALKING_SIDE", "ClassTokenParams"]

TALKING_SIDE = ("mask", "rope", "bias")
"""The side values talking-heads attention reads (no KV cache, no DETR positions)."""


_SELF = SelfAttention()  # the plain self-attention op: talking heads add their two head maps to it


@op
class TalkingHeadsAttention(Op):
    kind = "talking_heads_attention"
    params_type = AttentionParams
    category = "attention"
    module = ATTENTION_MODULE
    ports = ("x", *TALKING_SIDE)

    def shape(self, p: AttentionParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return _SELF.shape(p, inputs, dims)

    def params(self, p: AttentionParams) -> int:
        return _SELF.params(p) + 2 * (p.heads * p.heads + p.heads)  # proj_l and proj_w, with biases

    def flops(self, p: AttentionParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        b, n, _ = inputs["x"]
        return _SELF.flops(p, inputs) + 2 * linear_flops(b * n * n, p.heads, p.heads)

    def ctor(self, p: AttentionParams) -> dict[str, Any]:
        args = p.common()
        del args["layer_idx"]
        return core_args(**args, talking_heads=True)

    def label(self, p: AttentionParams) -> tuple[str, ...]:
        return _heads_line(p), " · ".join(["talking heads (mixed before and after softmax)", *_flags(p)])


@op
class ClassAttention(Op):
    kind = "class_attention"
    params_type = AttentionParams
    category = "attention"
    module = ATTENTION_MODULE
    ports = ("x", "mask")

    def shape(self, p: AttentionParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, _, d = inputs["x"]
        if d != p.dim:
            raise ValueError(f"expects width {p.dim}, got {d}")
        return (b, 1, d)

    def params(self, p: AttentionParams) -> int:
        inner = p.heads * p.head_dim
        return 4 * p.dim * inner + p.bias_rows(inner) + p.dim * p.proj_bias

    def flops(self, p: AttentionParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        b, n, _ = inputs["x"]
        inner = p.heads * p.head_dim
        q = linear_flops(b, p.dim, inner)
        kv = 2 * linear_flops(b * n, p.dim, inner)
        return q + kv + 4 * b * inner * n + linear_flops(b, inner, p.dim)  # q·k and attn @ v: 1 query

    def ctor(self, p: AttentionParams) -> dict[str, Any]:
        args = p.common()
        for unused in ("num_kv_heads", "layer_idx", "qk_norm", "qk_norm_bias", "norm_eps"):
            del args[unused]
        return core_args(**args, projection="split", queries=1)

    def label(self, p: AttentionParams) -> tuple[str, ...]:
        return _heads_line(p), " · ".join(["class token queries all tokens", *_flags(p)])


@dataclass(frozen=True)
class ClassTokenParams(Params):
    """The class token taken out of the tokens, or put back in front of them."""


@op
class ClassToken(Op):
    kind = "class_token"
    params_type = ClassTokenParams
    helpers = ("specvit.nn.cait:class_token",)

    def shape(self, p: ClassTokenParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, _, d = inputs["x"]
        return (b, 1, d)

    def code(self, p: ClassTokenParams, args: Mapping[str, str]) -> str:
        return f"class_token({args['x']})"

    def label(self, p: ClassTokenParams) -> tuple[str, ...]:
        return ("class token · x[:, :1]",)


@op
class JoinClassToken(Op):
    kind = "join_class_token"
    params_type = ClassTokenParams
    helpers = ("specvit.nn.cait:join_class_token",)
    ports = ("x", "cls")
    required = ("x", "cls")

    def shape(self, p: ClassTokenParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        if inputs["cls"][-1] != inputs["x"][-1]:
            raise ValueError(f"puts a {inputs['cls']} class token in front of {inputs['x']}")
        return inputs["x"]

    def code(self, p: ClassTokenParams, args: Mapping[str, str]) -> str:
        return f"join_class_token({args['x']}, {args['cls']})"

    def label(self, p: ClassTokenParams) -> tuple[str, ...]:
        return ("updated class token · other tokens unchanged",)


@sublayer
class ClassAttentionLayer(Sublayer):
    """The class token attends over every token (CaiT); the block updates the class token only."""

    kind = "class_attention"
    name = "attn"
    class_token_only = True  # the residual pattern narrows the block's adds to the class token

    def lower(self, b: BlockCtx, x: str, name: str, source: str) -> str:
        p = _attention_params(b, AttentionParams)
        return b.add(name, "class_attention", p, {"x": x, **_side(b, ("mask",))}, source=source)
