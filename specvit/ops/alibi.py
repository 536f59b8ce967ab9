"""ALiBi positions (Press et al., 2022; BLOOM): ``position: alibi`` biases every self-attention by key
distance, one slope per head, instead of adding positions to the tokens.

The whole definition: the spec fragment (its kind, its check, its lowering: one node whose output every
self-attention of the stack reads as its ``bias``) and the node's op (shape, label, module).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import Dims, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.facts import SpecView, StackView
from specvit.ops.position import Phase, PositionFragment

__all__ = ["AlibiParams", "AlibiPosition"]


@dataclass(frozen=True)
class AlibiParams(Params):
    """The ALiBi bias of a stack.

    Args:
        heads: heads, one slope each.
        causal: the stack's self-attention is causal (``slope * j``), else ``-slope * |i - j|``.
    """

    heads: int
    causal: bool = True


@op
class AlibiOp(Op):
    kind = "alibi"
    params_type = AlibiParams
    category = "position"
    module = "specvit.nn.alibi:Alibi"
    ports = ("x", "offset", "mask")

    def shape(self, p: AlibiParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, n = inputs["x"][0], inputs["x"][1]
        return (b, p.heads, 1 if p.causal else n, n)

    def label(self, p: AlibiParams) -> tuple[str, ...]:
        form = "slope · key position" if p.causal else "-slope · |i - j|"
        return (f"linear bias · {p.heads} slopes · {form}",)


@fragment("position")
class AlibiPosition(PositionFragment):
    """ALiBi: every self-attention adds a per-head linear penalty on the distance to each key (BLOOM)."""

    kind: Literal["alibi"] = Field(
        description="Discriminator: attention with linear biases, no position table."
    )

    def phase(self) -> Phase:
        return "attention"

    def writes(self) -> str:
        return "bias"

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        if stack.input.kind not in ("tokens", "features"):
            return [
                Problem(
                    at,
                    f"alibi biases a 1D sequence; a {stack.input.kind} input is not one",
                    "use rope2d or sincos2d for images",
                )
            ]
        return []

    def lower(self, ctx: StackCtx) -> None:
        srcs = {"x": ctx.x, "offset": ctx.side.get("offset", ""), "mask": ctx.side.get("mask", "")}
        p = AlibiParams(ctx.stack.facts.heads, ctx.stack.facts.causal)
        ctx.side["bias"] = ctx.add(f"{ctx.role}.alibi", "alibi", p, srcs, source=f"{ctx.role}.position")
