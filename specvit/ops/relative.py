"""T5's relative position bias (Raffel et al., 2020): ``position: relative`` gives every self-attention of
the stack one learned bias per head and bucketed key distance, computed once and shared by all layers (T5
keeps the table in its first layer and passes the bias on).

The whole definition: the spec fragment and the node's op; the module is :class:`specvit.nn.relative.RelativeBias`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import Dims, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.position import Phase, PositionFragment

__all__ = ["RelativeParams", "RelativePosition"]


@dataclass(frozen=True)
class RelativeParams(Params):
    """A stack's bucketed relative bias.

    Args:
        heads: heads, one bias each per bucket.
        buckets: distance buckets.
        max_distance: distance of the last bucket.
        bidirectional: keys after the query have buckets of their own (not in a causal stack).
    """

    heads: int
    buckets: int
    max_distance: int
    bidirectional: bool


@op
class RelativeOp(Op):
    kind = "relative_bias"
    params_type = RelativeParams
    category = "position"
    module = "specvit.nn.relative:RelativeBias"
    ports = ("x", "offset")

    def shape(self, p: RelativeParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        n = inputs["x"][1]
        return (1, p.heads, n, n)

    def params(self, p: RelativeParams) -> int:
        return p.buckets * p.heads

    def init(self, module: Any, p: RelativeParams, fill: Any) -> None:
        fill(module.embedding.weight, lambda t: t.normal_(std=0.02))

    def label(self, p: RelativeParams) -> tuple[str, ...]:
        side = "both directions" if p.bidirectional else "keys before"
        return (f"learned bias · {p.buckets} buckets to {p.max_distance} · {side} · shared by all layers",)


@fragment("position")
class RelativePosition(PositionFragment):
    """T5's relative bias: every self-attention adds a learned per-head bias of the bucketed key distance."""

    kind: Literal["relative"] = Field(description="Discriminator: T5's bucketed relative position bias.")
    buckets: int = Field(32, ge=2, le=1024, description="Distance buckets (half exact, half log-spaced).")
    max_distance: int = Field(128, ge=2, le=1 << 20, description="Distances from here share the last bucket.")

    def phase(self) -> Phase:
        return "attention"

    def writes(self) -> str:
        return "bias"

    def check(self, at: str, stack: Any, spec: Any) -> list[Problem]:
        exact = self.buckets // (2 if not stack.causal else 1) // 2
        if exact < 1 or self.max_distance <= exact:
            return [
                Problem(
                    f"{at}.max_distance",
                    f"{self.buckets} buckets hold distances up to {exact} exactly; max_distance must exceed it",
                    "use more buckets or a larger max_distance (T5: 32 and 128)",
                )
            ]
        return []

    def lower(self, ctx: StackCtx) -> None:
        p = RelativeParams(ctx.stack.heads, self.buckets, self.max_distance, not ctx.stack.causal)
        srcs = {"x": ctx.x, "offset": ctx.side.get("offset", "")}
        ctx.side["bias"] = ctx.add(
            f"{ctx.role}.rel_bias", "relative_bias", p, srcs, source=f"{ctx.role}.position"
        )
