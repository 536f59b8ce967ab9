"""Swin's ops: attention within (shifted) windows with a relative position bias (Swin's learned table or
Swin-V2's continuous position bias MLP, with V2's cosine attention), and patch merging."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specvit.ops.base import Dims, Op, Params, Shape, StackCtx, linear_flops, op
from specvit.ops.block import BlockCtx
from specvit.ops.core import ATTENTION_MODULE, core_args
from specvit.ops.embed import LinearParams
from specvit.ops.norm import NormParams

__all__ = ["CPB_HIDDEN", "MergeParams", "WindowParams", "block_window", "lower_merge", "window_params"]

CPB_HIDDEN = 512
"""The hidden width of Swin-V2's continuous position bias MLP when a spec leaves ``cpb_hidden`` unset."""


@dataclass(frozen=True)
class WindowParams(Params):
    """Self-attention within M x M windows of a token grid, with a learned relative position bias.

    Args:
        dim: width.
        heads: heads.
        grid: the (rows, cols) token grid, both divisible by ``window``.
        window: the window side M.
        shift: the cyclic shift of the grid before windowing (M/2 in every second Swin block, else 0).
        qkv_bias: biases of the q, k and v parts of the packed qkv projection.
        proj_bias: bias in the output projection.
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
        cosine: Swin-V2's cosine attention with a learned per-head logit scale.
        cpb_hidden: hidden width of Swin-V2's continuous position bias MLP, or 0 for Swin's bias table.
        pretrained: the window side the bias MLP's coordinates are normalised by, 0 for ``window``.
        softcap: soft-capping of the logits, or None.
    """

    dim: int
    heads: int
    grid: tuple[int, int]
    window: int
    shift: int = 0
    qkv_bias: tuple[bool, bool, bool] = (True, True, True)
    proj_bias: bool = True
    attn_drop: float = 0.0
    proj_drop: float = 0.0
    cosine: bool = False
    cpb_hidden: int = 0
    pretrained: int = 0
    softcap: float | None = None


@op
class WindowAttention(Op):
    kind = "window_attention"
    params_type = WindowParams
    category = "attention"
    module = ATTENTION_MODULE

    def params(self, p: WindowParams) -> int:
        d, h = p.dim, p.heads
        bias = 3 * p.cpb_hidden + p.cpb_hidden * h if p.cpb_hidden else (2 * p.window - 1) ** 2 * h
        return d * 3 * d + d * sum(p.qkv_bias) + d * d + d * p.proj_bias + bias + h * p.cosine

    def flops(self, p: WindowParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        b, n, d = inputs["x"]
        tokens, offsets = b * n, (2 * p.window - 1) ** 2
        cpb = linear_flops(offsets, 2, p.cpb_hidden) + linear_flops(offsets, p.cpb_hidden, p.heads)
        return (
            linear_flops(tokens, d, 3 * d)
            + 4 * tokens * p.window**2 * d
            + linear_flops(tokens, d, d)
            + (cpb if p.cpb_hidden else 0)
        )

    def ctor(self, p: WindowParams) -> dict[str, Any]:
        return core_args(
            dim=p.dim,
            num_heads=p.heads,
            grid=p.grid,
            grid_window=p.window,
            shift=p.shift,
            qkv_bias=p.qkv_bias[0] if len(set(p.qkv_bias)) == 1 else p.qkv_bias,
            proj_bias=p.proj_bias,
            attn_drop=p.attn_drop,
            proj_drop=p.proj_drop,
            cosine=p.cosine,
            relative="cpb" if p.cpb_hidden else "table",
            cpb_hidden=p.cpb_hidden,
            pretrained=p.pretrained,
            softcap=p.softcap,
        )

    def init(self, module: Any, p: WindowParams, fill: Any) -> None:
        from torch.nn.init import trunc_normal_

        fill.children(module)  # the bias MLP's layers too, as timm's init does
        for name in ("q_bias", "k_bias", "v_bias"):
            if hasattr(module, name):
                fill.zeros(getattr(module, name))
        if p.cosine:
            fill(module.logit_scale, lambda t: t.fill_(math.log(10.0)))  # Swin-V2: scale 10 at init
        if not p.cpb_hidden:
            fill(module.relative_position_bias_table, lambda t: trunc_normal_(t, std=0.02))

    def label(self, p: WindowParams) -> tuple[str, ...]:
        m = p.window
        shifted = f"shifted by {p.shift}" if p.shift else "not shifted"
        lines = [f"heads {p.heads} · head_dim {p.dim // p.heads}"]
        if p.cpb_hidden:
            lines.append(f"{m}x{m} windows · {shifted}")
            normalised = f"coords / {p.pretrained - 1}" if p.pretrained else f"coords / {max(m - 1, 1)}"
            lines.append(f"CPB MLP 2→{p.cpb_hidden}→{p.heads} · 16·sigmoid · {normalised}")
        else:
            lines.append(f"{m}x{m} windows · {shifted} · relative bias")
        if p.cosine:
            lines.append("cosine attention · logit scale ≤ 100")
        if len(set(p.qkv_bias)) > 1:
            lines.append("bias " + "".join(c for c, b in zip("qkv", p.qkv_bias, strict=True) if b))
        if p.softcap is not None:
            lines.append(f"softcap {p.softcap:g}")
        return tuple(lines)


def block_window(size: int, shift: bool, grid: tuple[int, int], index: int) -> tuple[int, int]:
    """The window side and shift of block ``index`` of a stage on ``grid`` (Swin's rules).

    A stage smaller than the window attends over all of it and never shifts; otherwise every second
    block shifts by half a window.
    """
    m = min(size, *grid)
    return m, (m // 2 if shift and index % 2 and min(grid) > size else 0)


def window_params(b: BlockCtx) -> WindowParams:
    """The windowed self-attention of block ``b`` (its window, shift and grid set by the stack)."""
    assert b.grid is not None and b.window is not None and b.spec.window is not None
    s, w = b.stack.stack, b.spec.window
    return WindowParams(
        b.dim,
        b.heads,
        b.grid,
        b.window,
        b.shift,
        (b.spec.bias_of("q"), b.spec.bias_of("k"), b.spec.bias_of("v")),
        b.spec.proj_bias,
        s.dropout.attention,
        s.dropout.projection,
        w.cosine,
        (w.cpb_hidden or CPB_HIDDEN) if w.bias == "cpb" else 0,
        _pretrained(w.pretrained, s.input.grid, b.grid),
        b.spec.attention_softcap,
    )


def _pretrained(sizes: int | list[int] | None, grid: tuple[int, int], stage_grid: tuple[int, int]) -> int:
    """The pretrained window side of the stage on ``stage_grid`` (stage i's grid is the input's / 2^i)."""
    if not isinstance(sizes, list):
        return sizes or 0
    return sizes[(grid[0] // stage_grid[0]).bit_length() - 1]


@dataclass(frozen=True)
class MergeParams(Params):
    """Gather each 2x2 neighbourhood of a (rows, cols) grid into one token of 4x the width."""

    grid: tuple[int, int]


@op
class Merge(Op):
    kind = "merge_2x2"
    params_type = MergeParams
    category = "embedding"
    helpers = ("specvit.nn.functional:merge_2x2",)

    def shape(self, p: MergeParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, _, c = inputs["x"]
        assert isinstance(c, int)
        return (b, p.grid[0] * p.grid[1] // 4, 4 * c)

    def code(self, p: MergeParams, args: Mapping[str, str]) -> str:
        return f"merge_2x2({args['x']}, {p.grid})"

    def label(self, p: MergeParams) -> tuple[str, ...]:
        return (f"2x2 tokens · grid {p.grid[0]}x{p.grid[1]} → {p.grid[0] // 2}x{p.grid[1] // 2}",)


def lower_merge(ctx: StackCtx, path: str, grid: tuple[int, int], norm: Any) -> str:
    """Swin's patch merging at ``path``: the 2x2 gather, a norm over 4C, a linear 4C -> 2C without bias;
    with the stack's ``merge_norm: post`` (Swin-V2) the linear first, then a norm over 2C."""
    c = ctx.shape(ctx.x)[-1]
    assert isinstance(c, int)
    source = f"{ctx.role}.depth"
    post = ctx.stack.merge_norm == "post"
    x = ctx.add(f"{path}.merge", "merge_2x2", MergeParams(grid), {"x": ctx.x}, source=source)
    reduce: tuple[str, str, Params] = ("reduction", "linear", LinearParams(4 * c, 2 * c, bias=False))
    normed: tuple[str, str, Params] = (
        "norm",
        norm.kind,
        NormParams.of(norm, 2 * c if post else 4 * c),
    )
    steps = [reduce, normed] if post else [normed, reduce]
    for name, kind, p in steps:
        src = f"{ctx.role}.merge_norm" if name == "norm" and post else source
        x = ctx.add(f"{path}.{name}", kind, p, {"x": x}, source=src)
    return x
