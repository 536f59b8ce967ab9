"""The parts of attention scores that the attention core (:mod:`specvit.nn.attention`) takes as data:
relative position biases a layer owns, the shifted windows' region mask, mixing across heads and soft-capping.

- Swin's learned table: one scalar per head and (row, column) offset within an M x M window, indexed by
  :func:`relative_position_index`; Swin-V2 computes the table with a small MLP of :func:`cpb_coords`.
- Swin's shifted windows: :func:`shift_mask` hides (-100) pairs of tokens that come from different regions
  of the unrolled image.
- MViTv2's decomposed relative positions (ViTDet, SAM): :func:`decomposed_bias`, ``q · Rh[i - k] + q · Rw[j - l]``.
- Talking heads (Shazeer et al. 2020; CaiT): :func:`mix_heads` mixes scores across heads with a learned map.
- Soft-capping (Gemma 2, Grok): :func:`tanh_cap`, ``cap * tanh(logits / cap)``.
- Cosine attention (Swin-V2): :func:`cosine_qk`, unit queries and keys, a learned scale per head.

Dim legend: H heads, M window, L = M*M tokens per window (or qh*qw, the extent a layer attends over),
nW windows per image, Bw = B * windows, hd head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MASKED",
    "MAX_LOGIT_SCALE",
    "cosine_qk",
    "cpb_coords",
    "decomposed_bias",
    "disentangled_bias",
    "grid_offsets",
    "mix_heads",
    "relative_position_index",
    "relative_rows",
    "shift_mask",
    "table_bias",
    "tanh_cap",
]

MASKED = -100.0
"""What Swin adds to the scores of token pairs from different regions of a shifted window (the paper's value)."""

MAX_LOGIT_SCALE = math.log(100.0)
"""Swin-V2 clamps the learned log scale of cosine attention here."""


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


def cosine_qk(q: Tensor, k: Tensor, logit_scale: Tensor) -> tuple[Tensor, Tensor]:
    """Cosine attention's (Swin-V2) unit queries and keys, the learned scale exp(min(logit_scale, log 100))
    of each head, ``logit_scale`` (H, 1, 1), folded into the queries."""
    scale = torch.clamp(logit_scale, max=MAX_LOGIT_SCALE).exp()  # (H, 1, 1)
    return F.normalize(q, dim=-1) * scale, F.normalize(k, dim=-1)


def relative_position_index(window: int, device: torch.device | None = None) -> Tensor:
    """(L, L) index into a ((2M-1)^2, H) bias table for every pair of tokens in a window."""
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


def grid_offsets(grid: tuple[int, int], device: torch.device | None = None) -> Tensor:
    """ConViT's query-key offsets on a row-major (gh, gw) grid: (N, N, 3) of ``[dx, dy, dx² + dy²]`` with
    dx = key column - query column and dy = key row - query row."""
    gh, gw = grid
    rows = torch.arange(gh, device=device).repeat_interleave(gw)  # (N,) the row of each token
    cols = torch.arange(gw, device=device).repeat(gh)  # (N,) its column
    dx = (cols[None, :] - cols[:, None]).float()  # (N, N)
    dy = (rows[None, :] - rows[:, None]).float()
    return torch.stack((dx, dy, dx**2 + dy**2), dim=-1)  # (N, N, 3)


def mix_heads(scores: Tensor, mix: nn.Linear, heads: int) -> Tensor:
    """Scores (B, G*H, N, T) mixed across the H heads of each of G groups by ``mix`` (an H -> H linear)."""
    grouped = scores.unflatten(1, (-1, heads))  # (B, G, H, N, T)
    mixed = mix(grouped.movedim(2, -1)).movedim(-1, 2)  # (B, G, H, N, T)
    return mixed.flatten(1, 2)  # (B, G*H, N, T)


def tanh_cap(logits: Tensor, cap: float) -> Tensor:
    """``cap * tanh(logits / cap)``: the logits squashed into (-cap, cap) (Gemma 2's soft-capping)."""
    return torch.tanh(logits / cap) * cap


def disentangled_bias(q: Tensor, k: Tensor, pos_q: Tensor, pos_k: Tensor, index: Tensor) -> Tensor:
    """DeBERTa's content-to-position and position-to-content scores, unscaled: (B, H, N, N) with
    ``q_i · pos_k[index[i, j]] + k_j · pos_q[index[i, j]]``.

    Args:
        q: (B, H, N, hd) queries.
        k: (B, H, N, hd) keys.
        pos_q: (H, 2P, hd) the relative table through the query projection.
        pos_k: (H, 2P, hd) the table through the key projection.
        index: (N, N) long, the table row of query i and key j.
    """
    b, h, n, _ = q.shape
    c2p = torch.gather(q @ pos_k.transpose(-1, -2), -1, index.expand(b, h, n, n))  # (B, H, N, N)
    p2c = torch.gather(k @ pos_q.transpose(-1, -2), -1, index.T.expand(b, h, n, n))  # (B, H, key, query)
    return c2p + p2c.transpose(-1, -2)


def table_bias(
    table: Tensor, window: int, groups: int, cpb: bool, grid: tuple[int, int] | None = None, shift: int = 0
) -> Tensor:
    """A window's relative bias from a table of its (2M-1)^2 offsets (Swin's, or Swin-V2's MLP output), for
    every window of the grid, with the region mask of shifted windows.

    Args:
        table: ((2M-1)^2, H) one bias per offset and head.
        window: the window side M.
        groups: the windows per sample G.
        cpb: the table is Swin-V2's MLP output, bounded by 16 * sigmoid.
        grid: the (gh, gw) token grid, for shifted windows.
        shift: the cyclic shift of shifted windows, or 0.

    Returns:
        (1, G*H, L, L) with L = M * M.
    """
    length, h = window * window, table.shape[-1]
    index = relative_position_index(window, table.device)  # (L, L)
    bias = table[index.view(-1)].view(length, length, -1).permute(2, 0, 1)  # (H, L, L)
    if cpb:
        bias = 16 * torch.sigmoid(bias)
    if shift:
        assert grid is not None
        regions = shift_mask(grid, window, shift, table.device).to(table.dtype)  # (G, L, L)
        return (bias[None] + regions[:, None]).reshape(1, groups * h, length, length)
    return bias[None].expand(groups, h, length, length).reshape(1, groups * h, length, length)
