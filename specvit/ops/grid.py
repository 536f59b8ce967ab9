"""Attention over a token grid, and the grid between stages.

- A block's ``window:`` cuts the grid into M x M tiles around plain attention: Swin's (rolled by M/2 in
  every second block, with a relative table or Swin-V2's bias MLP and cosine attention), or ViTDet's
  (``bias: false``: padded to a multiple of M, never shifted). :func:`grid_parts` turns it, and the
  stack's positions computed per layer (``relative_decomposed``), into parts of the attention op.
- A hierarchical stack halves the grid between stages by patch merging (:func:`lower_merge`), or runs its
  ``downsample`` layers over the tokens as a map (:func:`lower_downsample`).
- A block's ``spatial_reduction`` (PVT) reduces the keys and values of its self-attention over the grid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specvit.ops.base import Dims, Op, Params, Shape, StackCtx, op
from specvit.ops.block import BlockCtx
from specvit.ops.conv import lower_map_ops
from specvit.ops.embed import LinearParams
from specvit.ops.maps import ToMapParams, ToTokensParams
from specvit.ops.norm import NormParams

__all__ = ["CPB_HIDDEN", "MergeParams", "block_window", "grid_parts", "lower_downsample", "lower_merge"]

CPB_HIDDEN = 512
"""The hidden width of Swin-V2's continuous position bias MLP when a spec leaves ``cpb_hidden`` unset."""


def block_window(size: int, shift: bool, grid: tuple[int, int], index: int) -> tuple[int, int]:
    """The window side and shift of block ``index`` of a stage on ``grid`` (Swin's rules).

    A stage smaller than the window attends over all of it and never shifts; otherwise every second
    block shifts by half a window.
    """
    m = min(size, *grid)
    return m, (m // 2 if shift and index % 2 and min(grid) > size else 0)


def grid_parts(b: BlockCtx) -> tuple[dict[str, Any], str | None]:
    """The parts of block ``b``'s self-attention that come from the token grid, and the spec key that
    sets them (None when there are none): the block's windows, relative positions of the layer's own, and
    ConViT's gated positions.
    """
    w, s = b.spec.window, b.stack.stack
    own = {k: v for position in s.positions for k, v in position.attention_parts().items()}
    own |= {"gated": True} if b.spec.gated_positions else {}
    own |= {"reduction": r} if (r := per_stage_value(b.spec.spatial_reduction, b.stage)) > 1 else {}
    if w is None and not own:
        return {}, None
    parts: dict[str, Any] = {**own} | ({"grid": b.grid} if b.grid is not None else {})
    if w is None:
        key = "gated_positions" if own.get("gated") else "spatial_reduction" if own.get("reduction") else ""
        return parts, f"{b.stack.role}.block.{key}" if key else f"{b.stack.role}.position"
    source = f"{b.stack.role}.block.window"
    assert b.grid is not None  # the rules keep windows to image stacks
    if not w.bias:  # ViTDet's tiles: the window as written, padded where it does not divide the grid
        return parts | {"window": w.size}, source
    m, shift = block_window(w.size, w.shift, b.grid, b.index)
    parts |= {"window": m, "shift": shift, "cosine": w.cosine, "relative": "table"}
    if w.bias == "cpb":
        pretrained = _pretrained(w.pretrained, s.input.grid, b.grid)
        parts |= {"relative": "cpb", "cpb_hidden": w.cpb_hidden or CPB_HIDDEN, "pretrained": pretrained}
    return parts, source


def per_stage_value(value: int | list[int], stage: int) -> int:
    """A per-stage setting's value in ``stage``: the one number, or the stage's entry of the list."""
    return value[stage] if isinstance(value, list) else value


def lower_downsample(
    ctx: StackCtx, path: str, grid: tuple[int, int], stage: int
) -> tuple[str, tuple[int, int]]:
    """What leads into ``stage`` (> 0) of a hierarchical stack, and the stage's grid: patch merging (Swin), or
    the stack's ``downsample`` layers over the tokens as a map, the map they leave as tokens (PVT).

    Args:
        ctx: the lowering, at the previous stage's tokens.
        path: the nodes' prefix (``encoder.stages.1.downsample``).
        grid: the previous stage's grid.
        stage: the stage's index.
    """
    s = ctx.stack
    if s.downsample is None:
        return lower_merge(ctx, path, grid, s.block.norm), (grid[0] // 2, grid[1] // 2)
    source = f"{ctx.role}.downsample"
    x = ctx.add(f"{path}.map", "to_map", ToMapParams(grid), {"x": ctx.x}, source=source)
    x = lower_map_ops(ctx, x, s.stage_ops(stage), path, source)
    _, _, gh, gw = ctx.shape(x)
    assert isinstance(gh, int) and isinstance(gw, int)
    return ctx.add(f"{path}.tokens", "to_tokens", ToTokensParams(), {"x": x}, source=source), (gh, gw)


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
