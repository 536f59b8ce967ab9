"""ViTDet's attention over a token grid (Li et al. 2022, "Exploring Plain Vision Transformer Backbones for
Object Detection"; the image encoder of Segment Anything, Kirillov et al. 2023). Its neck is generic layers
(:mod:`specvit.nn.conv`).

Tokens are a row-major (gh, gw) grid. A windowed layer pads the grid at the bottom and right with zeros to
a multiple of the window M, attends within each M x M window (the padded tokens are keys like any other),
and crops the padding off; a global layer attends over the whole grid. Both may add MViTv2's decomposed
relative positions to the logits: for a query at (i, j) and a key at (k, l), ``q · Rh[i - k] + q · Rw[j - l]``
from two learned tables of ``2 * size - 1`` rows each, sized to what the layer attends over (the window,
or the grid), added without the 1/sqrt(head_dim) scale.

Dim legend: B batch, N = gh*gw tokens, C width, H heads, hd head dim, M window, (qh, qw) the extent a
layer attends over (M x M or the grid), L = qh*qw tokens per window, Bw = B * windows.
"""

from __future__ import annotations

from typing import Any

from specvit.nn.attention import Attention, RelativeBias
from specvit.nn.scores import decomposed_bias, relative_rows

__all__ = ["GridAttention", "decomposed_bias", "relative_rows"]


class GridAttention(Attention):
    """Multi-head self-attention over a token grid: global, or in padded M x M windows (ViTDet, SAM). A
    configuration of the attention core: ``Attention(..., grid=grid, grid_window=window, relative=
    "decomposed" if rel_pos else None)``.

    Args:
        dim: width C.
        num_heads: heads H.
        grid: (gh, gw) token grid.
        window: window side M, or None to attend over the whole grid.
        rel_pos: add decomposed relative positions (tables ``rel_pos_h``, ``rel_pos_w``).
        kwargs: the other arguments of :class:`~specvit.nn.attention.Attention`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        grid: tuple[int, int],
        window: int | None = None,
        rel_pos: bool = False,
        **kwargs: Any,
    ) -> None:
        relative: RelativeBias | None = "decomposed" if rel_pos else None
        super().__init__(dim, num_heads, grid=grid, grid_window=window, relative=relative, **kwargs)
