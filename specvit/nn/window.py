"""Swin's shifted-window attention (Liu et al., 2021; V2: Liu et al., 2022); patch merging is
:func:`~specvit.nn.functional.merge_2x2`, a norm and a linear layer.

Tokens are a row-major (gh, gw) grid. Windows of M x M tokens attend within themselves, with a learned
relative position bias; in shifted blocks the grid is cyclically rolled by -M/2 first and the pairs that
come from different regions of the unrolled image are masked with -100 (the paper's value). The index,
bias and mask are computed from static shapes in forward, so there are no buffers to initialise.

Dim legend: B batch, N = gh*gw tokens, C width, H heads, hd head dim, M window, L = M*M tokens per
window, nW windows per image.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn.attention import _packed, _project
from specvit.nn.functional import sdpa_layout
from specvit.nn.layers import Dropout
from specvit.nn.linear import Linear

__all__ = ["WindowAttention", "cpb_coords", "relative_position_index", "shift_mask"]

MASKED = -100.0
MAX_LOGIT_SCALE = math.log(100.0)  # Swin-V2 clamps the learned log scale of cosine attention here


def cpb_coords(window: int, pretrained: int = 0, device: torch.device | None = None) -> Tensor:
    """((2M-1)^2, 2) float32 log-spaced relative coordinates, the input of Swin-V2's bias MLP.

    Each offset in [-(M-1), M-1] is divided by ``pretrained - 1`` (or ``M - 1`` when ``pretrained`` is 0;
    at least 1), times 8, then mapped to ``sign(t) * log2(|t| + 1) / 3``.

    Args:
        window: the window side M.
        pretrained: the window side the coordinates are normalised by (Swin-V2's pretrained window
            size), or 0 for ``window``.
        device: the table's device.
    """
    side = torch.arange(-(window - 1), window, device=device, dtype=torch.float32)  # (2M-1,)
    table = torch.stack(torch.meshgrid(side, side, indexing="ij"), dim=-1)  # (2M-1, 2M-1, 2)
    table = table / max((pretrained or window) - 1, 1) * 8
    table = torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(8)
    return table.view(-1, 2)  # ((2M-1)^2, 2), row-major like relative_position_index


def relative_position_index(window: int, device: torch.device | None = None) -> Tensor:
    """(L, L) index into the ((2M-1)^2, H) bias table for every pair of tokens in a window."""
    coords = torch.stack(
        torch.meshgrid(
            torch.arange(window, device=device), torch.arange(window, device=device), indexing="ij"
        )
    ).flatten(1)  # (2, L)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)  # (L, L, 2), in [0, 2M-2]
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]  # (L, L)


def shift_mask(grid: tuple[int, int], window: int, shift: int, device: torch.device | None = None) -> Tensor:
    """(nW, L, L) additive mask of a cyclically shifted grid: -100 between tokens of different regions."""
    gh, gw = grid
    labels = torch.zeros(gh, gw, device=device)
    region = 0
    for rows in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
        for cols in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
            labels[rows, cols] = region
            region += 1
    windows = (
        labels.view(gh // window, window, gw // window, window).permute(0, 2, 1, 3).reshape(-1, window**2)
    )
    different = windows[:, None, :] != windows[:, :, None]  # (nW, L, L)
    return torch.zeros(different.shape, device=device).masked_fill(different, MASKED)


class WindowAttention(nn.Module):
    """Multi-head self-attention within (shifted) M x M windows, with a relative position bias.

    Args:
        dim: width C.
        num_heads: heads H.
        grid: (gh, gw) token grid; both divisible by ``window``.
        window: window side M.
        shift: cyclic shift (M/2 in every second Swin block, 0 otherwise).
        qkv_bias: biases of the fused qkv projection: one for all, or (q, k, v); with some but not all
            (Swin-V2: q and v), the module has ``q_bias`` / ``k_bias`` / ``v_bias`` for those that have one.
        proj_bias: bias in the output projection.
        attn_drop: dropout on the attention weights (training only).
        proj_drop: dropout after the output projection.
        cosine: cosine attention with a learned per-head ``logit_scale`` (Swin-V2), instead of
            q·k / sqrt(hd).
        cpb_hidden: the hidden width of Swin-V2's continuous position bias MLP ``cpb_mlp``
            (2 -> hidden -> H, ``16 * sigmoid`` of its output), or 0 for the learned
            ``relative_position_bias_table`` of Swin.
        pretrained: the window side the bias MLP's coordinates are normalised by, or 0 for ``window``.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        grid: tuple[int, int],
        window: int,
        shift: int = 0,
        *,
        qkv_bias: bool | tuple[bool, bool, bool] = True,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        cosine: bool = False,
        cpb_hidden: int = 0,
        pretrained: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if grid[0] % window or grid[1] % window:
            raise ValueError(f"grid {grid} is not divisible by window {window}")
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.grid, self.window, self.shift = grid, window, shift
        self.attn_drop, self.cosine = attn_drop, cosine
        self.cpb, self.pretrained = cpb_hidden > 0, pretrained
        bq, bk, bv = (qkv_bias,) * 3 if isinstance(qkv_bias, bool) else qkv_bias
        self.parts = (("q", dim, bq), ("k", dim, bk), ("v", dim, bv))  # (name, rows, has a bias)
        self.qkv = _packed(self, dim, self.parts, device, dtype)
        if cosine:
            self.logit_scale = nn.Parameter(
                torch.full((num_heads, 1, 1), math.log(10.0), device=device, dtype=dtype)
            )  # (H, 1, 1)
        if cpb_hidden:
            self.cpb_mlp = nn.Sequential(
                nn.Linear(2, cpb_hidden, device=device, dtype=dtype),
                nn.ReLU(inplace=True),
                nn.Linear(cpb_hidden, num_heads, bias=False, device=device, dtype=dtype),
            )
        else:
            self.relative_position_bias_table = nn.Parameter(
                torch.zeros((2 * window - 1) ** 2, num_heads, device=device, dtype=dtype)
            )  # ((2M-1)^2, H)
        self.proj = Linear(dim, dim, bias=proj_bias, device=device, dtype=dtype)
        self.proj_drop = Dropout(proj_drop) if proj_drop > 0 else nn.Identity()

    def _bias(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """(nW or 1, H, L, L) relative position bias plus, for shifted windows, the region mask."""
        L = self.window**2
        index = relative_position_index(self.window, device)  # (L, L)
        if self.cpb:
            coords = cpb_coords(self.window, self.pretrained, device).to(dtype)  # ((2M-1)^2, 2)
            table = self.cpb_mlp(coords)  # ((2M-1)^2, H)
        else:
            table = self.relative_position_bias_table
        bias = table[index.view(-1)].view(L, L, -1).permute(2, 0, 1)  # (H, L, L)
        if self.cpb:
            bias = 16 * torch.sigmoid(bias)
        if self.shift:
            mask = shift_mask(self.grid, self.window, self.shift, device).to(dtype)  # (nW, L, L)
            return bias[None] + mask[:, None]  # (nW, H, L, L)
        return bias[None]  # (1, H, L, L)

    def forward(self, x: Tensor) -> Tensor:
        """Attend within windows. x: (B, N, C) -> (B, N, C)."""
        b, n, c = x.shape
        (gh, gw), m, s = self.grid, self.window, self.shift
        h, hd = self.num_heads, self.head_dim
        x = x.view(b, gh, gw, c)
        if s:
            x = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        nw = (gh // m) * (gw // m)
        windows = x.view(b, gh // m, m, gw // m, m, c).permute(0, 1, 3, 2, 4, 5).reshape(b, nw, m * m, c)
        qkv = _project(self, windows, self.qkv, self.parts)  # (B, nW, L, 3C)
        q, k, v = qkv.view(b, nw, m * m, 3, h, hd).permute(3, 0, 1, 4, 2, 5).unbind(0)  # (B, nW, H, L, hd)
        scale = None
        if self.cosine:  # cos(q, k) * exp(logit scale): the scale is folded into the unit queries
            logit_scale = torch.clamp(self.logit_scale, max=MAX_LOGIT_SCALE).exp()  # (H, 1, 1)
            q, k, scale = F.normalize(q, dim=-1) * logit_scale, F.normalize(k, dim=-1), 1.0
        # windows and heads as one 4D attention, (B, nW * H, L, hd), which every SDPA backend and ONNX take
        q, k, v = (t.reshape(b, nw * h, m * m, hd) for t in (q, k, v))  # (B, nW * H, L, hd)
        bias = self._bias(x.device, x.dtype).expand(nw, h, m * m, m * m).reshape(1, nw * h, m * m, m * m)
        dropout = self.attn_drop if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=scale)
        out = (
            sdpa_layout(out).view(b, nw, h, m * m, hd).transpose(2, 3).reshape(b, nw, m * m, c)
        )  # (B, nW, L, C)
        out = self.proj_drop(self.proj(out))
        out = (
            out.view(b, gh // m, gw // m, m, m, c).permute(0, 1, 3, 2, 4, 5).reshape(b, gh, gw, c)
        )  # (B, gh, gw, C)
        if s:
            out = torch.roll(out, shifts=(s, s), dims=(1, 2))
        return out.reshape(b, n, c)

    def extra_repr(self) -> str:
        extra = ", cosine=True" if self.cosine else ""
        extra += f", cpb_pretrained={self.pretrained}" if self.pretrained else ""
        return f"heads={self.num_heads}, grid={self.grid}, window={self.window}, shift={self.shift}{extra}"
