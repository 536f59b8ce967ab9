"""Perceiver's latents (Jaegle et al. 2021): a decoder whose residual stream starts at N learned vectors.

The encoder of such a model embeds the long input (often with ``depth: 0``: the input is never
self-attended); the decoder's ``input: {kind: latents, count: N}`` puts the latent array in the residual
stream, its first block cross-attends to the embedded input and the rest self-attend among the latents,
so the cost grows linearly with the input's length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import MAX_LEN, Dims, Filler, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.facts import SpecView, StackView
from specvit.ops.inputs import InputFragment

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LatentsInput", "LatentsParams"]


@dataclass(frozen=True)
class LatentsParams(Params):
    """A learned latent array, one row per latent.

    Args:
        count: number of latents N.
        dim: latent width D.
    """

    count: int
    dim: int


@op
class Latents(Op):
    kind = "latents"
    params_type = LatentsParams
    category = "embedding"
    module = "specvit.nn.latents:LatentArray"

    def shape(self, p: LatentsParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return (inputs["x"][0], p.count, p.dim)

    def params(self, p: LatentsParams) -> int:
        return p.count * p.dim

    def init(self, module: nn.Module, p: LatentsParams, fill: Filler) -> None:
        from torch.nn.init import trunc_normal_

        fill(module.weight, lambda t: trunc_normal_(t, std=0.02))  # Perceiver's TruncatedNormal(0.02)

    def label(self, p: LatentsParams) -> tuple[str, ...]:
        return (f"{p.count} learned latents · batch from memory",)


@fragment("input")
class LatentsInput(InputFragment):
    """N learned latent vectors (Perceiver): the decoder's residual stream starts at them, and its
    cross-attention reads the encoder's output (the long input)."""

    kind: Literal["latents"] = Field(description="Discriminator: a learned latent array (a decoder's input).")
    count: int = Field(
        ge=1, le=MAX_LEN, description="Number of latents N; the decoder's cost does not grow with the input."
    )

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        role = at.split(".")[0]
        out = []
        if not (role == "decoder" and spec.model == "encoder_decoder"):
            out.append(
                Problem(
                    f"{at}.kind",
                    "latents are the input of an encoder_decoder's decoder, which cross-attends to the encoder",
                    "use latents only in the decoder of an encoder_decoder model",
                )
            )
        if any(p.kind != "none" for p in stack.positions) or stack.num_prefix:
            out.append(
                Problem(
                    f"{role}.position",
                    "learned latents have no order: they need no positions and no prefix tokens",
                    "set position: none and remove prefix for a latents input",
                )
            )
        return out

    def lower(self, ctx: StackCtx) -> None:
        role = ctx.role
        p = LatentsParams(self.count, ctx.stack.width)
        ctx.x = ctx.add(f"{role}.latents", "latents", p, {"x": ctx.side["memory"]}, source=f"{role}.input")
        ctx.n = self.count
