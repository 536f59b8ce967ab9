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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn.functional import sdpa_layout
from specvit.nn.layers import Dropout
from specvit.nn.linear import Linear

__all__ = ["GridAttention", "LayerNorm2d", "Neck", "decomposed_bias", "relative_rows"]


def relative_rows(size: int, table: Tensor) -> Tensor:
    """(size, size, hd) rows of a (2*size - 1, hd) table for every (query, key) pair: row q - k + size - 1."""
    coords = torch.arange(size, device=table.device)
    return table[coords[:, None] - coords[None, :] + (size - 1)]  # (size, size, hd)


def decomposed_bias(q: Tensor, rel_h: Tensor, rel_w: Tensor, extent: tuple[int, int]) -> Tensor:
    """The decomposed relative position bias of queries ``q`` (Bw, H, L, hd) on a (qh, qw) extent.

    Returns:
        (Bw, H, L, L): ``q · Rh[i - k] + q · Rw[j - l]`` for query (i, j) and key (k, l).
    """
    qh, qw = extent
    bw, h, _, hd = q.shape
    grid_q = q.reshape(bw * h, qh, qw, hd)  # (Bw*H, qh, qw, hd)
    along_h = torch.einsum("bhwc,hkc->bhwk", grid_q, relative_rows(qh, rel_h))  # (Bw*H, qh, qw, qh)
    along_w = torch.einsum("bhwc,wkc->bhwk", grid_q, relative_rows(qw, rel_w))  # (Bw*H, qh, qw, qw)
    bias = along_h[:, :, :, :, None] + along_w[:, :, :, None, :]  # (Bw*H, qh, qw, qh, qw)
    return bias.reshape(bw, h, qh * qw, qh * qw)


class GridAttention(nn.Module):
    """Multi-head self-attention over a token grid: global, or in padded M x M windows (ViTDet, SAM).

    Args:
        dim: width C.
        num_heads: heads H.
        grid: (gh, gw) token grid.
        window: window side M, or None to attend over the whole grid.
        rel_pos: add decomposed relative positions (tables ``rel_pos_h``, ``rel_pos_w``).
        qkv_bias: biases in the fused qkv projection.
        proj_bias: bias in the output projection.
        scale: factor of q·k, or None for 1/sqrt(hd).
        attn_drop: dropout on the attention weights (training only).
        proj_drop: dropout after the output projection.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        grid: tuple[int, int],
        window: int | None = None,
        rel_pos: bool = False,
        *,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.grid, self.window, self.rel_pos, self.scale = grid, window, rel_pos, scale
        self.attn_drop = attn_drop
        self.qkv = Linear(dim, 3 * dim, bias=qkv_bias, device=device, dtype=dtype)
        self.proj = Linear(dim, dim, bias=proj_bias, device=device, dtype=dtype)
        self.proj_drop = Dropout(proj_drop) if proj_drop > 0 else nn.Identity()
        if rel_pos:
            qh, qw = (window, window) if window is not None else grid
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * qh - 1, self.head_dim, device=device, dtype=dtype))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * qw - 1, self.head_dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        """Attend over the grid or within its windows. x: (B, N, C) -> (B, N, C)."""
        b, n, c = x.shape
        (gh, gw), m = self.grid, self.window
        grid = x.view(b, gh, gw, c)
        if m is not None:  # pad to a multiple of M, then cut into windows
            hp, wp = gh + (-gh) % m, gw + (-gw) % m
            grid = F.pad(grid, (0, 0, 0, wp - gw, 0, hp - gh))  # (B, hp, wp, C)
            grid = grid.view(b, hp // m, m, wp // m, m, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, m, m, c)
        bw, qh, qw, _ = grid.shape  # (Bw, qh, qw, C)
        length, h, hd = qh * qw, self.num_heads, self.head_dim
        qkv = self.qkv(grid.reshape(bw, length, c)).view(bw, length, 3, h, hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (Bw, H, L, hd)
        bias = decomposed_bias(q, self.rel_pos_h, self.rel_pos_w, (qh, qw)) if self.rel_pos else None
        dropout = self.attn_drop if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=self.scale)
        out = sdpa_layout(out).transpose(1, 2).reshape(bw, length, c)  # (Bw, L, C)
        out = self.proj_drop(self.proj(out))
        if m is not None:  # the windows back into the padded grid, the padding cropped
            out = out.view(b, hp // m, wp // m, m, m, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
            out = out[:, :gh, :gw]  # (B, gh, gw, C)
        return out.reshape(b, n, c)

    def extra_repr(self) -> str:
        where = f"window={self.window}" if self.window is not None else "global"
        return f"heads={self.num_heads}, grid={self.grid}, {where}, rel_pos={self.rel_pos}"


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
