"""T5's relative position bias (Raffel et al., 2020): ``position: relative`` gives every self-attention of
the stack one learned bias per head and bucketed key distance, computed once and shared by all layers (T5
keeps the table in its first layer and passes the bias on), or, with ``shared: false``, from a table of each
layer's own (UMT5).

The whole definition: the spec fragment and the node's op; the module is :class:`specvit.nn.relative.RelativeBias`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import Dims, Filler, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.facts import SpecView, StackView
from specvit.ops.position import Phase, PositionFragment

if TYPE_CHECKING:
    from torch import nn

__all__ = ["RelativeParams", "RelativePosition"]


@dataclass(frozen=True)
class RelativeParams(Params):
    """A stack's bucketed relative bias.

    Args:
        heads: heads, one bias each per bucket.
        buckets: distance buckets.
        max_distance: distance of the last bucket.
        bidirectional: keys after the query have buckets of their own (not in a causal stack).
        shared: one table read by every layer of the stack; false: the table of one layer.
    """

    heads: int
    buckets: int
    max_distance: int
    bidirectional: bool
    shared: bool = True


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

    def ctor(self, p: RelativeParams) -> dict[str, Any]:
        return {k: v for k, v in p.as_dict().items() if k != "shared"}  # where the table sits, not what it is

    def init(self, module: nn.Module, p: RelativeParams, fill: Filler) -> None:
        fill(module.get_parameter("embedding.weight"), lambda t: t.normal_(std=0.02))

    def label(self, p: RelativeParams) -> tuple[str, ...]:
        side = "both directions" if p.bidirectional else "keys before"
        whose = "shared by all layers" if p.shared else "this layer's"
        return (f"learned bias · {p.buckets} buckets to {p.max_distance} · {side} · {whose}",)


@fragment("position")
class RelativePosition(PositionFragment):
    """T5's relative bias: every self-attention adds a learned per-head bias of the bucketed key distance."""

    kind: Literal["relative"] = Field(description="Discriminator: T5's bucketed relative position bias.")
    buckets: int = Field(32, ge=2, le=1024, description="Distance buckets (half exact, half log-spaced).")
    max_distance: int = Field(128, ge=2, le=1 << 20, description="Distances from here share the last bucket.")
    shared: bool = Field(
        True, description="One table for all layers of the stack (T5); false: one per layer (UMT5)."
    )

    def phase(self) -> Phase:
        return "attention"

    def writes(self) -> str:
        return "bias"

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
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

    def params(self, ctx: StackCtx) -> RelativeParams:
        return RelativeParams(
            ctx.stack.facts.heads, self.buckets, self.max_distance, not ctx.stack.facts.causal, self.shared
        )

    def lower(self, ctx: StackCtx) -> None:
        if self.shared:
            srcs = {"x": ctx.x, "offset": ctx.side.get("offset", "")}
            ctx.side["bias"] = ctx.add(
                f"{ctx.role}.rel_bias", "relative_bias", self.params(ctx), srcs, source=f"{ctx.role}.position"
            )

    def lower_layer(self, b: Any, x: str, name: str) -> str | None:
        """A table of the attention layer's own (UMT5): its node, read as the layer's bias."""
        if self.shared:
            return None
        srcs = {"x": x, "offset": b.side.get("offset", "")}
        return b.add(name, "relative_bias", self.params(b.stack), srcs, source=f"{b.stack.role}.position")


@dataclass(frozen=True)
class GridRelativeParams(Params):
    """BEiT's relative bias of a patch grid with a class token.

    Args:
        heads: heads, one table column each.
        grid: the patch grid.
    """

    heads: int
    grid: tuple[int, int]

    @property
    def rows(self) -> int:
        return (2 * self.grid[0] - 1) * (2 * self.grid[1] - 1) + 3


@op
class GridRelativeOp(Op):
    kind = "grid_relative_bias"
    params_type = GridRelativeParams
    category = "position"
    module = "specvit.nn.relative:GridRelativeBias"

    def shape(self, p: GridRelativeParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        n = inputs["x"][1]
        return (1, p.heads, n, n)

    def params(self, p: GridRelativeParams) -> int:
        return p.rows * p.heads

    def init(self, module: nn.Module, p: GridRelativeParams, fill: Filler) -> None:
        fill.zeros(module.relative_position_bias_table)

    def label(self, p: GridRelativeParams) -> tuple[str, ...]:
        return (f"learned bias · {p.rows} offsets of a {p.grid[0]}x{p.grid[1]} grid + class token",)


@fragment("position")
class GridRelativePosition(PositionFragment):
    """BEiT's learned relative position bias: every self-attention adds a per-head bias of the 2D offset
    between patches (and three learned entries for the class token), from a table of its own or one
    table shared by all layers."""

    kind: Literal["relative2d"] = Field(description="Discriminator: BEiT's 2D relative position bias.")
    shared: bool = Field(
        False, description="One table for all layers (BEiT's use_shared_rel_pos_bias); false: one per layer."
    )

    def phase(self) -> Phase:
        return "attention"

    def writes(self) -> str:
        return "bias"

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        if stack.input.kind != "image" or stack.hierarchical or not stack.prefix.cls or stack.num_prefix != 1:
            return [
                Problem(
                    at,
                    "relative2d biases the patch grid of a plain image stack with a class token, no other prefix",
                    "use an image input, prefix: {cls: true}, and one number for depth",
                )
            ]
        return []

    def params(self, ctx: StackCtx) -> GridRelativeParams:
        assert ctx.grid is not None
        return GridRelativeParams(ctx.stack.facts.heads, ctx.grid)

    def lower(self, ctx: StackCtx) -> None:
        if self.shared:
            p = self.params(ctx)
            ctx.side["bias"] = ctx.add(
                f"{ctx.role}.rel_bias", "grid_relative_bias", p, {"x": ctx.x}, source=f"{ctx.role}.position"
            )

    def lower_layer(self, b: Any, x: str, name: str) -> str | None:
        """A table of the attention layer's own (not shared): its node, read as the layer's bias."""
        if self.shared:
            return None
        p = self.params(b.stack)
        return b.add(name, "grid_relative_bias", p, {"x": x}, source=f"{b.stack.role}.position")
