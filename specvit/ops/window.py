"""Swin's ops: attention within (shifted) windows with a relative position bias, and patch merging."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specvit.ops.base import Dims, Op, Params, Shape, StackCtx, linear_flops, op
from specvit.ops.block import BlockCtx
from specvit.ops.embed import LinearParams
from specvit.ops.norm import NormParams

__all__ = ["MergeParams", "WindowParams", "block_window", "lower_merge", "window_params"]


@dataclass(frozen=True)
class WindowParams(Params):
    """Self-attention within M x M windows of a token grid, with a learned relative position bias.

    Args:
        dim: width.
        heads: heads.
        grid: the (rows, cols) token grid, both divisible by ``window``.
        window: the window side M.
        shift: the cyclic shift of the grid before windowing (M/2 in every second Swin block, else 0).
        qkv_bias: biases in the packed qkv projection.
        proj_bias: bias in the output projection.
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
    """

    dim: int
    heads: int
    grid: tuple[int, int]
    window: int
    shift: int = 0
    qkv_bias: bool = True
    proj_bias: bool = True
    attn_drop: float = 0.0
    proj_drop: float = 0.0


@op
class WindowAttention(Op):
    kind = "window_attention"
    params_type = WindowParams
    category = "attention"
    module = "specvit.nn.window:WindowAttention"

    def params(self, p: WindowParams) -> int:
        d = p.dim
        return d * 3 * d + 3 * d * p.qkv_bias + d * d + d * p.proj_bias + (2 * p.window - 1) ** 2 * p.heads

    def flops(self, p: WindowParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        b, n, d = inputs["x"]
        tokens = b * n
        return linear_flops(tokens, d, 3 * d) + 4 * tokens * p.window**2 * d + linear_flops(tokens, d, d)

    def ctor(self, p: WindowParams) -> dict[str, Any]:
        return {
            "dim": p.dim,
            "num_heads": p.heads,
            "grid": p.grid,
            "window": p.window,
            "shift": p.shift,
            "qkv_bias": p.qkv_bias,
            "proj_bias": p.proj_bias,
            "attn_drop": p.attn_drop,
            "proj_drop": p.proj_drop,
        }

    def init(self, module: Any, p: WindowParams, fill: Any) -> None:
        from torch.nn.init import trunc_normal_

        fill.children(module)
        fill(module.relative_position_bias_table, lambda t: trunc_normal_(t, std=0.02))

    def label(self, p: WindowParams) -> tuple[str, ...]:
        m = p.window
        shifted = f"shifted by {p.shift}" if p.shift else "not shifted"
        return (
            f"heads {p.heads} · head_dim {p.dim // p.heads}",
            f"{m}x{m} windows · {shifted} · relative bias",
        )


def block_window(size: int, shift: bool, grid: tuple[int, int], index: int) -> tuple[int, int]:
    """The window side and shift of block ``index`` of a stage on ``grid`` (Swin's rules).

    A stage smaller than the window attends over all of it and never shifts; otherwise every second
    block shifts by half a window.
    """
    m = min(size, *grid)
    return m, (m // 2 if shift and index % 2 and min(grid) > size else 0)


def window_params(b: BlockCtx) -> WindowParams:
    """The windowed self-attention of block ``b`` (its window, shift and grid set by the stack)."""
    assert b.grid is not None and b.window is not None
    s = b.stack.stack
    return WindowParams(
        b.dim,
        b.heads,
        b.grid,
        b.window,
        b.shift,
        b.spec.qkv_bias,
        b.spec.proj_bias,
        s.dropout.attention,
        s.dropout.projection,
    )


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
    """Swin's patch merging at ``path``: the 2x2 gather, a norm over 4C, a linear 4C -> 2C without bias."""
    c = ctx.shape(ctx.x)[-1]
    assert isinstance(c, int)
    source = f"{ctx.role}.depth"
    x = ctx.add(f"{path}.merge", "merge_2x2", MergeParams(grid), {"x": ctx.x}, source=source)
    x = ctx.add(f"{path}.norm", norm.kind, NormParams(4 * c, norm.eps, norm.bias), {"x": x}, source=source)
    return ctx.add(
        f"{path}.reduction", "linear", LinearParams(4 * c, 2 * c, bias=False), {"x": x}, source=source
    )
