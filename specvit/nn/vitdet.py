"""ViTDet's attention over a token grid (Li et al. 2022, "Exploring Plain Vision Transformer Backbones for
Object Detection"; the image encoder of Segment Anything, Kirillov et al. 2023) and its convolutional neck.

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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn.attention import Attention, RelativeBias
from specvit.nn.scores import decomposed_bias, relative_rows

__all__ = ["GridAttention", "LayerNorm2d", "Neck", "decomposed_bias", "relative_rows"]


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


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map."""

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, C, H, W) -> (B, C, H, W)."""
        out = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return out.permute(0, 3, 1, 2)


class Neck(nn.Sequential):
    """The tokens as a (B, C, gh, gw) map, then SAM's neck: a 1x1 conv to ``channels``, LayerNorm2d, a 3x3
    conv, LayerNorm2d (convs without bias); with ``channels`` None only a LayerNorm2d over the width.

    Args:
        dim: token width C.
        grid: (gh, gw) token grid.
        channels: output channels, or None for the norm alone.
        eps: epsilon of the LayerNorm2d layers.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        grid: tuple[int, int],
        channels: int | None = 256,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if channels is None:
            layers: list[nn.Module] = [LayerNorm2d(dim, eps=eps, device=device, dtype=dtype)]
        else:
            layers = [
                nn.Conv2d(dim, channels, 1, bias=False, device=device, dtype=dtype),
                LayerNorm2d(channels, eps=eps, device=device, dtype=dtype),
                nn.Conv2d(channels, channels, 3, padding=1, bias=False, device=device, dtype=dtype),
                LayerNorm2d(channels, eps=eps, device=device, dtype=dtype),
            ]
        super().__init__(*layers)
        self.grid = grid

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, N, C) tokens -> (B, channels, gh, gw)."""
        b, _, c = x.shape
        out = x.transpose(1, 2).reshape(b, c, *self.grid)  # (B, C, gh, gw)
        for layer in self:
            out = layer(out)
        return out
