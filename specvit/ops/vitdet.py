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
from specvit.ops.block import BlockCtx
from specvit.ops.core import ATTENTION_MODULE, core_args
from specvit.ops.embed import LinearParams
from specvit.ops.heads import HeadFragment
from specvit.ops.position import Phase, PositionFragment
from specvit.ops.structure import OutputParams

__all__ = ["GridAttentionParams", "NeckParams", "lower_grid_attention"]

# ----------------------------------------------------------------------------------- grid attention


@dataclass(frozen=True)
class GridAttentionParams(Params):
    """Self-attention over a (rows, cols) token grid: global, or within padded M x M windows.

    Args:
        dim: width.
        heads: heads.
        grid: the token grid.
        window: the window side M, or None for global attention.
        rel_pos: decomposed relative positions, with tables sized to the window (or the grid).
        qkv_bias: biases in the packed qkv projection.
        proj_bias: bias in the output projection.
        scale: factor of q·k, or None for 1/sqrt(head_dim).
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
        softcap: soft-capping of the logits, or None.
    """

    dim: int
    heads: int
    grid: tuple[int, int]
    window: int | None = None
    rel_pos: bool = False
    qkv_bias: bool = True
    proj_bias: bool = True
    scale: float | None = None
    attn_drop: float = 0.0
    proj_drop: float = 0.0
    softcap: float | None = None

    @property
    def padded(self) -> tuple[int, int]:
        """The grid padded to a multiple of the window (the grid itself for global attention)."""
        (gh, gw), m = self.grid, self.window
        return (gh, gw) if m is None else (gh + (-gh) % m, gw + (-gw) % m)

    @property
    def extent(self) -> tuple[int, int]:
        """What one query attends over: (M, M) or the grid."""
        return (self.window, self.window) if self.window is not None else self.grid


@op
class GridAttention(Op):
    kind = "grid_attention"
    params_type = GridAttentionParams
    category = "attention"
    module = ATTENTION_MODULE

    def params(self, p: GridAttentionParams) -> int:
        d, (qh, qw) = p.dim, p.extent
        tables = (2 * qh - 1 + 2 * qw - 1) * (d // p.heads) if p.rel_pos else 0
        return d * 3 * d + 3 * d * p.qkv_bias + d * d + d * p.proj_bias + tables

    def flops(self, p: GridAttentionParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        b, _, d = inputs["x"]
        (hp, wp), (qh, qw) = p.padded, p.extent
        tokens, length, hd = b * hp * wp, qh * qw, d // p.heads
        scores = 4 * tokens * p.heads * length * hd  # q @ k^T and attn @ v in every window
        rel = 2 * tokens * p.heads * (qh + qw) * hd if p.rel_pos else 0  # the two einsums
        return linear_flops(tokens, d, 3 * d) + scores + rel + linear_flops(tokens, d, d)

    def ctor(self, p: GridAttentionParams) -> dict[str, Any]:
        return core_args(
            dim=p.dim,
            num_heads=p.heads,
            grid=p.grid,
            grid_window=p.window,
            relative="decomposed" if p.rel_pos else None,
            qkv_bias=p.qkv_bias,
            proj_bias=p.proj_bias,
            scale=p.scale,
            attn_drop=p.attn_drop,
            proj_drop=p.proj_drop,
            softcap=p.softcap,
        )

    def init(self, module: Any, p: GridAttentionParams, fill: Any) -> None:
        from torch.nn.init import trunc_normal_

        fill.children(module)
        for table in ("rel_pos_h", "rel_pos_w"):
            if hasattr(module, table):
                fill(getattr(module, table), lambda t: trunc_normal_(t, std=0.02))

    def label(self, p: GridAttentionParams) -> tuple[str, ...]:
        (gh, gw), (hp, wp) = p.grid, p.padded
        if p.window is None:
            where = f"global · whole {gh}x{gw} grid"
        else:
            pad = f" · grid {gh}x{gw} padded to {hp}x{wp}" if (hp, wp) != (gh, gw) else ""
            where = f"{p.window}x{p.window} windows · not shifted{pad}"
        lines = [f"heads {p.heads} · head_dim {p.dim // p.heads}", where]
        if p.rel_pos:
            (qh, qw), hd = p.extent, p.dim // p.heads
            lines.append(f"decomposed rel. pos · h {2 * qh - 1}x{hd} · w {2 * qw - 1}x{hd}")
        if p.softcap is not None:
            lines.append(f"softcap {p.softcap:g}")
        return tuple(lines)


def _decomposed(stack: Any) -> bool:
    return any(isinstance(p, DecomposedPosition) for p in stack.positions)


def lower_grid_attention(b: BlockCtx, x: str, name: str) -> str | None:
    """The self-attention of block ``b`` as a grid attention (ViTDet's windows or a stack with decomposed
    relative positions), or None when it is another attention (global, or Swin's windows)."""
    window, s = b.spec.window, b.stack.stack
    if not _decomposed(s) and (window is None or window.bias):
        return None
    assert b.grid is not None
    p = GridAttentionParams(
        b.dim,
        b.heads,
        b.grid,
        window.size if window is not None else None,
        _decomposed(s),
        b.spec.bias_of("q"),
        b.spec.proj_bias,
        b.spec.attention_scale,
        s.dropout.attention,
        s.dropout.projection,
        b.spec.attention_softcap,
    )
    source = f"{b.stack.role}.block.window" if window is not None else f"{b.stack.role}.position"
    return b.add(name, "grid_attention", p, {"x": x}, source=source)


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
