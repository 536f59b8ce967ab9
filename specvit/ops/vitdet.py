"""ViTDet and SAM's image encoder (Li et al. 2022; Kirillov et al. 2023): attention over the token grid in
padded windows without shift or globally, MViTv2's decomposed relative positions, and the conv neck.

- ``block.window: {size: 14, shift: false, bias: false, pad: true}``: ViTDet's windows; the global blocks
  are written with ``overrides:`` (``window: null``) or a schedule.
- ``position: relative_decomposed``: every self-attention of the stack adds ``q · Rh[i - k] + q · Rw[j - l]``
  to its logits, from two tables of its own sized to its window (or the grid).
- ``head: {kind: neck, channels: 256}``: the tokens as a (B, C, H, W) map through SAM's neck.

Modules: :mod:`specvit.nn.vitdet`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import (
    MAX_VOCAB,
    MAX_WIDTH,
    Dims,
    ModelCtx,
    Op,
    Params,
    Shape,
    fragment,
    linear_flops,
    op,
)
from specvit.ops.embed import LinearParams
from specvit.ops.heads import HeadFragment
from specvit.ops.position import Phase, PositionFragment
from specvit.ops.structure import OutputParams

__all__ = ["NeckParams", "window_problems"]


def window_problems(at: str, block: Any) -> list[Problem]:
    """What a block's ``window`` cannot combine: ViTDet's windows with Swin's shift or bias table, or with
    separate q/k/v biases."""
    window = block.window
    if window is None or (not window.pad and window.bias):
        return []
    out = []
    if isinstance(block.qkv_bias, list):
        out.append(
            Problem(f"{at}.qkv_bias", "ViTDet's windows have one packed qkv projection", "use true or false")
        )
    if window.shift:
        what = "padded windows (pad: true)" if window.pad else "windows without a bias table (bias: false)"
        out.append(Problem(f"{at}.window.shift", f"{what} are ViTDet's, never shifted", "set shift: false"))
    if window.pad and window.bias:
        out.append(
            Problem(
                f"{at}.window.bias",
                "padded windows are ViTDet's, without Swin's bias table",
                "set bias: false (positions: relative_decomposed), or pad: false for Swin's windows",
            )
        )
    return out


# ------------------------------------------------------------------------- decomposed relative positions


@fragment("position")
class DecomposedPosition(PositionFragment):
    """MViTv2's decomposed relative positions (ViTDet, SAM): every self-attention adds, for a query at
    (i, j) and a key at (k, l), ``q · Rh[i - k] + q · Rw[j - l]`` to its logits, from two learned tables of
    its own sized to what it attends over (its window, or the grid)."""

    kind: Literal["relative_decomposed"] = Field(
        description="Discriminator: decomposed 2D relative positions computed in each attention."
    )

    def phase(self) -> Phase:
        return "attention"

    def writes(self) -> str:
        return "rel_pos"

    def attention_parts(self) -> dict[str, Any]:
        return {"relative": "decomposed"}

    def check(self, at: str, stack: Any, spec: Any) -> list[Problem]:
        from specvit.ops.inputs import ImageInput

        if not isinstance(stack.input, ImageInput) or stack.hierarchical or stack.num_prefix:
            return [
                Problem(
                    at,
                    "relative_decomposed positions are over the patch grid of a plain image stack "
                    "without prefix tokens",
                    "use an image input, one number for depth, and no class or register tokens",
                )
            ]
        out = []
        for i, block in enumerate(stack.layer_blocks):
            bad = [
                key
                for key, value in (
                    ("window.bias", block.window is not None and block.window.bias),
                    ("qk_norm", block.qk_norm),
                    ("kv_heads", block.kv_heads),
                    ("head_dim", block.head_dim),
                    ("qkv_bias", isinstance(block.qkv_bias, list)),
                    ("layers", tuple(block.sublayers) != ("self_attention", "mlp")),
                )
                if value
            ]
            if bad:
                out.append(
                    Problem(
                        at,
                        f"layer {i}'s {bad[0]} does not go with relative_decomposed positions (ViTDet's "
                        "attention: self_attention and mlp, all heads of width / heads, no Swin table)",
                        f"remove {bad[0]} (window: set bias: false)",
                    )
                )
                break
        return out


# ---------------------------------------------------------------------------------------------- neck


@dataclass(frozen=True)
class NeckParams(Params):
    """The tokens of a grid as a (B, C, rows, cols) map, through SAM's neck.

    Args:
        dim: token width.
        grid: the token grid.
        channels: the convs' output channels, or None for a LayerNorm2d alone.
        eps: epsilon of the LayerNorm2d layers.
    """

    dim: int
    grid: tuple[int, int]
    channels: int | None
    eps: float


@op
class Neck(Op):
    kind = "neck"
    params_type = NeckParams
    category = "head"
    module = "specvit.nn.vitdet:Neck"

    def shape(self, p: NeckParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return (inputs["x"][0], p.channels or p.dim, *p.grid)

    def params(self, p: NeckParams) -> int:
        if p.channels is None:
            return 2 * p.dim
        return p.dim * p.channels + 2 * p.channels + 9 * p.channels**2 + 2 * p.channels

    def flops(self, p: NeckParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        if p.channels is None:
            return 0
        pixels = inputs["x"][0] * p.grid[0] * p.grid[1]
        return linear_flops(pixels, p.dim, p.channels) + linear_flops(pixels, 9 * p.channels, p.channels)

    def ctor(self, p: NeckParams) -> dict[str, Any]:
        return {"dim": p.dim, "grid": p.grid, "channels": p.channels, "eps": p.eps}

    def label(self, p: NeckParams) -> tuple[str, ...]:
        gh, gw = p.grid
        first = f"tokens → {p.dim}x{gh}x{gw} map"
        if p.channels is None:
            return first, "LayerNorm2d"
        return first, f"1x1 conv → {p.channels} · LayerNorm2d", "3x3 conv · LayerNorm2d"


@dataclass(frozen=True)
class MapPoolParams(Params):
    """The mean of a (B, C, H, W) map over its positions."""


@op
class MapPool(Op):
    kind = "map_pool"
    params_type = MapPoolParams
    category = "head"

    def shape(self, p: MapPoolParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return inputs["x"][:2]

    def code(self, p: MapPoolParams, args: Mapping[str, str]) -> str:
        return f"{args['x']}.mean(dim=(2, 3))"

    def label(self, p: MapPoolParams) -> tuple[str, ...]:
        return ("mean over the map",)


@fragment("head")
class NeckHead(HeadFragment):
    """SAM's image-encoder output: the tokens as a (B, C, H, W) map of the patch grid through a 1x1 conv,
    LayerNorm2d, a 3x3 conv and LayerNorm2d (convs without bias); optionally averaged and classified."""

    kind: Literal["neck"] = Field(description="Discriminator: a (B, C, H, W) feature map (SAM, ViTDet).")
    channels: int | None = Field(
        256,
        ge=1,
        le=MAX_WIDTH,
        description="The convs' output channels; null: no convs, a LayerNorm2d over the width alone "
        "(timm's neck_chans=None).",
    )
    eps: float = Field(1e-6, gt=0.0, lt=1.0, description="Epsilon of the LayerNorm2d layers.")
    pool: Literal["none", "mean"] = Field(
        "none",
        description="none: the map (B, C, H, W); mean: its average over positions (B, C), as timm's "
        "global_pool='avg'.",
    )
    classes: int | None = Field(
        None, ge=1, le=MAX_VOCAB, description="A linear classifier after pool: mean; null: none."
    )

    def check(self, at: str, stack: Any, spec: Any) -> list[Problem]:
        from specvit.ops.inputs import ImageInput

        if not isinstance(stack.input, ImageInput) or stack.hierarchical or stack.num_prefix:
            return [
                Problem(
                    "head.kind",
                    "a neck maps the patch grid of a plain image stack without prefix tokens",
                    "use an image input, one number for depth, no class or register tokens; or another head",
                )
            ]
        if self.classes is not None and self.pool != "mean":
            return [Problem("head.classes", "a classifier reads one vector per image", "set pool: mean")]
        return []

    def lower(self, ctx: ModelCtx, x: str, stack: Any, mask: str | None) -> None:
        p = NeckParams(stack.out_width, stack.input.grid, self.channels, self.eps)
        x = ctx.add("head.neck", "neck", p, {"x": x}, source="head", stack="head", scope="head")
        if self.pool == "mean":
            x = ctx.add("head.pool", "map_pool", MapPoolParams(), {"x": x}, source="head.pool", stack="head")
        if self.classes is not None:
            fc = LinearParams(
                self.channels or stack.out_width, self.classes, zero_init=ctx.spec.init == "vit"
            )
            x = ctx.add("head.fc", "linear", fc, {"x": x}, source="head.classes", stack="head", scope="head")
        ctx.add("output", "output", OutputParams(), {"x": x}, stack="head", scope="")
