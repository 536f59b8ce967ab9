"""2D rotary positions over a patch grid: fixed frequencies shared by every layer (:class:`Rope2d`: CroCo,
EVA-02, timm's ``RotaryEmbeddingCat``), or frequencies each attention layer learns per head
(:class:`RopeMixed`: RoPE-Mixed, Heo et al. 2024, timm's ``RotaryEmbeddingMixed``).

Both give ``(cos, sin)`` tables :func:`~specvit.nn.position.apply_rope` reads; prefix tokens (cls / registers),
which come first, get the identity rotation. Dim legend: H heads, hd head dim, P prefix tokens, gh x gw the grid.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from specvit.nn.position import _rope_inv_freq, rope_tables

__all__ = ["Axes", "Rope2d", "Rope2dLayout", "RopeMixed", "mixed_frequencies_"]

Rope2dLayout = Literal["sections", "interleaved", "half"]
"""How :class:`Rope2d` pairs a head's channels."""
Axes = Literal["ij", "xy"]
"""Which coordinate the first frequencies take: ``ij`` the row, ``xy`` the column."""


def _by_axes(rows: Tensor, cols: Tensor, axes: str) -> tuple[Tensor, Tensor]:
    return (rows, cols) if axes == "ij" else (cols, rows)


def _unrotated_prefix(cos: Tensor, sin: Tensor, prefix: int, dim: int) -> tuple[Tensor, Tensor]:
    """The tables with ``prefix`` identity rotations put in front along the tokens' ``dim``."""
    if prefix == 0:
        return cos, sin
    shape = list(cos.shape)
    shape[dim] = prefix
    ones = cos.new_ones(shape)  # (..., P, ...) identity rotation
    return torch.cat((ones, cos), dim=dim), torch.cat((torch.zeros_like(ones), sin), dim=dim)


class Rope2d(nn.Module):
    """2D rotary position embedding over a row-major patch grid (CroCo's ``RoPE2D``, EVA-02's).

    Every layout rotates hd/4 channel pairs by the row (y) coordinate and hd/4 by the column (x), at the
    frequencies ``base^(-i / (hd/4))``, i < hd/4; they differ in which channels form a pair:

    - ``sections`` (CroCo): the head's first half is rotated by the row, its second by the column, each
      half by its own rotate-half RoPE (channel i with i + hd/4). Tables (P + gh*gw, 2, hd/2).
    - ``interleaved`` (EVA-02, timm's ``RotaryEmbeddingCat``): adjacent channels (2i, 2i + 1) form a pair,
      the first hd/4 pairs by the row, the others by the column. Tables (P + gh*gw, hd/2, 2).
    - ``half`` (timm's ``rope_rotate_half``): channel i with i + hd/2 over the whole head, the first hd/4
      pairs by the row, the others by the column. Tables (P + gh*gw, hd).

    :func:`apply_rope` reads the layout off the tables' shape. Prefix tokens (cls / registers), which come
    first, get the identity rotation.

    Args:
        head_dim: hd, divisible by 4.
        grid: (gh, gw) patch grid.
        base: RoPE theta (CroCo uses 100, EVA-02 10000).
        num_prefix: leading prefix tokens P, left unrotated.
        layout: ``sections``, ``interleaved`` or ``half``.
        ref_grid: EVA's ``ref_feat_shape``: row r becomes ``r / gh * ref_h`` (columns likewise), so a
            fine-tuning grid spans the pretraining one; None keeps the patch indexes.
        axes: ``ij``: the first pairs (or section) by the row, as above; ``xy``: by the column (timm's
            ``grid_indexing='xy'``).
    """

    def __init__(
        self,
        head_dim: int,
        grid: tuple[int, int],
        base: float = 100.0,
        num_prefix: int = 0,
        layout: Rope2dLayout = "sections",
        ref_grid: tuple[int, int] | None = None,
        axes: Axes = "ij",
    ) -> None:
        super().__init__()
        if head_dim % 4 != 0:
            raise ValueError(f"Rope2d needs head_dim divisible by 4, got {head_dim}")
        if layout not in ("sections", "interleaved", "half"):
            raise ValueError(f"Rope2d layout must be sections, interleaved or half, got {layout!r}")
        self.head_dim = head_dim
        self.grid = grid
        self.base = base
        self.num_prefix = num_prefix
        self.layout = layout
        self.ref_grid = ref_grid
        self.axes = axes

    def _coords(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(gh*gw,) row and column coordinates, row-major, as timm's ``_build_grid`` computes them."""
        (gh, gw), ref = self.grid, self.ref_grid
        ys = torch.arange(gh, device=device).to(torch.float32)  # (gh,)
        xs = torch.arange(gw, device=device).to(torch.float32)  # (gw,)
        if ref is not None:
            ys, xs = ys / gh * ref[0], xs / gw * ref[1]  # EVA: the grid spans the reference grid
        return _by_axes(ys.repeat_interleave(gw), xs.repeat(gh), self.axes)  # (gh*gw,) each

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 ``(cos, sin)`` for the tokens x: (B, P + gh*gw, D), shaped by the layout."""
        rows, cols = self._coords(x.device)  # the first axis's coordinates and the second's
        half = self.head_dim // 2
        if self.layout == "sections":
            cos_y, sin_y = rope_tables(rows, half, self.base)  # (gh*gw, hd/2)
            cos_x, sin_x = rope_tables(cols, half, self.base)  # (gh*gw, hd/2)
            cos = torch.stack((cos_y, cos_x), dim=1)  # (gh*gw, 2, hd/2)
            sin = torch.stack((sin_y, sin_x), dim=1)  # (gh*gw, 2, hd/2)
        else:
            inv_freq = _rope_inv_freq(half, self.base, x.device)  # (hd/4,)
            angles = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)  # (gh*gw, hd/2)
            if self.layout == "interleaved":
                angles = torch.stack((angles, angles), dim=-1)  # (gh*gw, hd/2, 2): one angle per pair
            else:
                angles = torch.cat((angles, angles), dim=-1)  # (gh*gw, hd): channel i with i + hd/2
            cos, sin = angles.cos(), angles.sin()
        return _unrotated_prefix(cos, sin, self.num_prefix, 0)

    def extra_repr(self) -> str:
        extra = "" if self.layout == "sections" else f", layout={self.layout}"
        extra += "" if self.ref_grid is None else f", ref_grid={self.ref_grid}"
        extra += "" if self.axes == "ij" else f", axes={self.axes}"
        return f"head_dim={self.head_dim}, grid={self.grid}, base={self.base}, num_prefix={self.num_prefix}{extra}"


class RopeMixed(nn.Module):
    """RoPE-Mixed (Heo et al. 2024, "Rotary Position Embedding for Vision Transformer"): one attention layer's
    2D rotation with frequencies it learns per head, so a pair's angle mixes both axes:
    ``angle[h, n, i] = first(n) * freqs[0, h, i] + second(n) * freqs[1, h, i]`` over hd/2 pairs, the
    coordinates the row and column indexes (``axes`` orders them). timm's ``RotaryEmbeddingMixed`` holds every
    layer's frequencies in one (2, depth, H, hd/2) parameter; here each layer holds its own (2, H, hd/2).

    Tables are per head, in the sectioned shape :func:`~specvit.nn.position.apply_rope` reads: (H, P + gh*gw,
    hd/2, 2) for ``interleaved`` pairs (2i, 2i + 1), (H, P + gh*gw, 1, hd) for ``half`` (channel i with
    i + hd/2).

    Args:
        heads: H.
        head_dim: hd, divisible by 4.
        grid: (gh, gw) patch grid.
        base: the initial magnitudes' base (RoPE-ViT: 10, timm's ``rope_temperature``).
        num_prefix: leading prefix tokens P, left unrotated.
        layout: ``interleaved`` or ``half``.
        axes: ``ij``: ``freqs[0]`` multiplies the row; ``xy``: the column (RoPE-ViT).
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        heads: int,
        head_dim: int,
        grid: tuple[int, int],
        base: float = 10.0,
        num_prefix: int = 0,
        layout: Literal["interleaved", "half"] = "interleaved",
        axes: Axes = "ij",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 4 != 0:
            raise ValueError(f"RopeMixed needs head_dim divisible by 4, got {head_dim}")
        self.grid, self.base, self.num_prefix, self.layout, self.axes = grid, base, num_prefix, layout, axes
        self.freqs = nn.Parameter(
            torch.empty(2, heads, head_dim // 2, device=device, dtype=dtype)
        )  # (2, H, hd/2)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """RoPE-ViT's initial frequencies (:func:`mixed_frequencies_`)."""
        mixed_frequencies_(self.freqs, self.base)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 ``(cos, sin)`` per head for the tokens x: (B, P + gh*gw, D), shaped by the layout."""
        gh, gw = self.grid
        rows = torch.arange(gh, device=x.device, dtype=torch.float32).repeat_interleave(gw)  # (gh*gw,)
        cols = torch.arange(gw, device=x.device, dtype=torch.float32).repeat(gh)  # (gh*gw,)
        first, second = _by_axes(rows, cols, self.axes)
        freqs = self.freqs.float()
        angles = first[:, None] * freqs[0, :, None] + second[:, None] * freqs[1, :, None]  # (H, gh*gw, hd/2)
        if self.layout == "interleaved":
            angles = torch.stack((angles, angles), dim=-1)  # (H, gh*gw, hd/2, 2): one angle per pair
        else:
            angles = torch.cat((angles, angles), dim=-1).unsqueeze(-2)  # (H, gh*gw, 1, hd)
        return _unrotated_prefix(angles.cos(), angles.sin(), self.num_prefix, 1)

    def extra_repr(self) -> str:
        return f"grid={self.grid}, num_prefix={self.num_prefix}, layout={self.layout}, axes={self.axes}"


def mixed_frequencies_(freqs: Tensor, base: float) -> Tensor:
    """Fill (2, H, hd/2) frequencies as RoPE-ViT starts them: the fixed magnitudes ``base^(-4i/hd)``, i < hd/4,
    turned by a random angle per head, once along it and once a quarter turn further.

    Args:
        freqs: the (2, H, hd/2) parameter, filled in place.
        base: the magnitudes' base.
    """
    heads, half = freqs.shape[1], freqs.shape[2]
    with torch.no_grad():
        steps = torch.arange(0, 2 * half, 4, dtype=torch.float32, device=freqs.device)  # (hd/4,)
        mag = base ** -(steps / (2 * half))  # (hd/4,)
        turn = torch.rand(heads, 1, device=freqs.device) * 2 * math.pi  # (H, 1)
        first = torch.cat((mag * turn.cos(), mag * (turn + math.pi / 2).cos()), dim=-1)  # (H, hd/2)
        second = torch.cat((mag * turn.sin(), mag * (turn + math.pi / 2).sin()), dim=-1)  # (H, hd/2)
        return freqs.copy_(torch.stack((first, second)))  # (2, H, hd/2)
