"""Layers a ``classifier`` or ``lm`` head runs before its final linear layer, written as a list under ``ops:``.

Each item is one layer over the features of every token (an ``lm`` head) or of the pooled vector (a
``classifier``):

- ``{kind: linear, width: 768, bias: true}``: a dense layer (``width`` null: as wide as its input);
- ``{kind: act, fn: tanh}``: an activation (the map ops' ``act``: gelu, gelu_tanh, quick_gelu, relu, relu2,
  silu, tanh);
- ``{kind: norm}``: the blocks' norm over the features (``eps`` null: the blocks' eps);
- ``{kind: dropout, p: 0.1}``: dropout while training (BART's and T5's classification heads drop out before
  their dense layer, as before their output layer).

BERT's pooler is ``[linear, {act, fn: tanh}]`` before a classifier on the first token; its masked-LM head is
``[linear, {act, fn: gelu}, norm]`` before the tied decoder. The nodes are ``head.ops.{i}``, so the weights
are ``head.ops.0.weight`` and so on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import Field

from specvit.ops.base import MAX_WIDTH, Fragment, ModelCtx, Params
from specvit.ops.conv import ActLayer
from specvit.ops.embed import LinearParams
from specvit.ops.facts import StackView
from specvit.ops.fields import Probability
from specvit.ops.norm import NormParams
from specvit.ops.structure import DropParams

__all__ = [
    "DropoutLayer",
    "FeatureNorm",
    "HeadOp",
    "HeadOps",
    "LinearLayer",
    "head_ops_width",
    "lower_head_ops",
]


class LinearLayer(Fragment):
    """A dense layer on the features."""

    kind: Literal["linear"] = Field(description="Discriminator: a dense layer.")
    width: int | None = Field(None, ge=1, le=MAX_WIDTH, description="Output features; null: the input's.")
    bias: bool = Field(True, description="A learned bias.")

    def out(self, width: int) -> int:
        """The features after this layer, from ``width`` in."""
        return self.width or width


class FeatureNorm(Fragment):
    """The blocks' norm (its kind, bias and affine settings) over the features."""

    kind: Literal["norm"] = Field(description="Discriminator: a norm over the features.")
    eps: float | None = Field(None, gt=0.0, lt=1.0, description="Added to the variance; null: the blocks'.")


class DropoutLayer(Fragment):
    """Dropout on the features while training."""

    kind: Literal["dropout"] = Field(description="Discriminator: dropout.")
    p: Probability = Field(description="The probability of zeroing each feature.")


Layer = LinearLayer | ActLayer | FeatureNorm | DropoutLayer
HeadOp = Annotated[Layer, Field(discriminator="kind")]
HeadOps = Annotated[list[HeadOp], Field(max_length=16)]


def head_ops_width(ops: Sequence[Layer], width: int) -> int:
    """The features ``ops`` leave, from ``width`` in."""
    for layer in ops:
        width = layer.out(width) if isinstance(layer, LinearLayer) else width
    return width


def _node(layer: Layer, width: int, stack: StackView) -> tuple[str, Params]:
    """The op kind and params of one layer over ``width`` features."""
    if isinstance(layer, LinearLayer):
        return "linear", LinearParams(width, layer.out(width), layer.bias)
    if isinstance(layer, DropoutLayer):
        return "dropout", DropParams(layer.p)
    if isinstance(layer, FeatureNorm):
        n = stack.block.norm
        p = NormParams.of(n, width)
        return n.kind, p if layer.eps is None else NormParams(
            width, layer.eps, p.bias, p.affine, p.unit_offset
        )
    return layer.node(width, 0)


def lower_head_ops(ctx: ModelCtx, x: str, ops: Sequence[Layer], stack: StackView) -> str:
    """Add a node ``head.ops.{i}`` per layer of ``ops`` after ``x`` (features last); returns the last.

    Args:
        ctx: the lowering.
        x: the tokens (B, N, D) or the pooled features (B, D).
        ops: the layers.
        stack: the stack the head reads (its blocks' norm).
    """
    for i, layer in enumerate(ops):
        width = ctx.shape(x)[-1]
        assert isinstance(width, int)
        kind, p = _node(layer, width, stack)
        x = ctx.add(f"head.ops.{i}", kind, p, {"x": x}, source=f"head.ops.{i}", stack="head", scope="head")
    return x
