"""Partitioners: the tokens of a grid cut into M x M windows before plain attention, and put back after.

Tokens are a row-major (gh, gw) grid. Swin's windows tile the grid exactly, every second block after a
cyclic shift by -M/2 (:func:`window_split` rolls, :func:`window_merge` rolls back); ViTDet's pad the grid
at the bottom and right with zeros to a multiple of M (the padded tokens are keys like any other) and crop
the padding off after.

Dim legend: B batch, N = gh*gw tokens, C width, M window, L = M*M tokens per window, nW windows per image,
(hp, wp) the padded grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["padded_grid", "window_merge", "window_split"]


def padded_grid(grid: tuple[int, int], window: int) -> tuple[int, int]:
    """The grid padded at the bottom and right to a multiple of the window."""
    gh, gw = grid
    return gh + (-gh) % window, gw + (-gw) % window


def window_split(x: Tensor, grid: tuple[int, int], window: int, shift: int = 0) -> Tensor:
    """(B, N, C) tokens of ``grid`` -> (B, nW, L, C) windows: rolled by ``-shift`` first, padded to a multiple
    of ``window`` (a no-op when it divides the grid)."""
    b, _, c = x.shape
    gh, gw = grid
    hp, wp = padded_grid(grid, window)
    m = window
    tokens = x.view(b, gh, gw, c)
    if shift:
        tokens = torch.roll(tokens, shifts=(-shift, -shift), dims=(1, 2))
    if (hp, wp) != (gh, gw):
        tokens = F.pad(tokens, (0, 0, 0, wp - gw, 0, hp - gh))  # (B, hp, wp, C)
    windows = tokens.view(b, hp // m, m, wp // m, m, c).permute(0, 1, 3, 2, 4, 5)  # (B, hp/M, wp/M, M, M, C)
    return windows.reshape(b, (hp // m) * (wp // m), m * m, c)  # (B, nW, L, C)


def window_merge(windows: Tensor, grid: tuple[int, int], window: int, shift: int = 0) -> Tensor:
    """(B, nW, L, C) windows -> the (B, N, C) tokens of ``grid``, the inverse of :func:`window_split`."""
    b, _, _, c = windows.shape
    gh, gw = grid
    hp, wp = padded_grid(grid, window)
    m = window
    tokens = windows.view(b, hp // m, wp // m, m, m, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
    if (hp, wp) != (gh, gw):
        tokens = tokens[:, :gh, :gw]  # (B, gh, gw, C)
    if shift:
        tokens = torch.roll(tokens, shifts=(shift, shift), dims=(1, 2))
    return tokens.reshape(b, gh * gw, c)  # (B, N, C)
