"""Spatial reduction (PVT, Wang et al. 2021): the keys and values of an attention read its token grid shrunk
by a strided convolution, queries every token.

The conv has kernel = stride = r and no padding, so a gh x gw grid leaves (gh // r) x (gw // r) tokens; a
LayerNorm over the width follows (PVT v1 and v2, HF's ``spatial_reduction`` and ``layer_norm``, timm's
``sr`` and ``norm``).

Dim legend: B batch, N tokens (gh * gw), D width, r the reduction ratio, M reduced tokens (gh // r) * (gw // r).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specvit.nn.functional import to_map, to_tokens

__all__ = ["reduce_tokens", "spatial_reduction"]


def spatial_reduction(
    dim: int,
    ratio: int,
    eps: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[nn.Conv2d, nn.LayerNorm]:
    """The conv and the norm that reduce a grid of D-wide tokens by ``ratio`` per side.

    Args:
        dim: token width D.
        ratio: r, the conv's kernel and stride.
        eps: the norm's epsilon.
        device: parameter device.
        dtype: parameter dtype.
    """
    conv = nn.Conv2d(dim, dim, kernel_size=ratio, stride=ratio, device=device, dtype=dtype)
    return conv, nn.LayerNorm(dim, eps=eps, device=device, dtype=dtype)


def reduce_tokens(x: Tensor, grid: tuple[int, int] | None, conv: nn.Module, norm: nn.Module) -> Tensor:
    """The (B, N, D) tokens of the row-major ``grid`` reduced to (B, M, D): ``norm(conv(map))``.

    Args:
        x: (B, N, D) tokens.
        grid: their (gh, gw) grid.
        conv: the strided conv of :func:`spatial_reduction`.
        norm: its norm.
    """
    assert grid is not None  # check_parts: a reduction needs the grid
    return norm(to_tokens(conv(to_map(x, grid))))  # (B, D, gh, gw) -> (B, D, gh/r, gw/r) -> (B, M, D)
