"""Position encodings: fixed sin-cos tables, learned tables and rotary (RoPE) tables.

Every table is computed on the fly from shapes (no buffers), so a model built on the meta device needs
nothing special. Tables are built with broadcasting multiplies only (no matmul), so they add no FLOPs to
``torch.utils.flop_counter.FlopCounterMode`` counts.

Dim legend: B batch, N tokens, D width, H heads, Hkv kv heads, hd head dim, M memory tokens.
P below is the number of prefix (cls / register) tokens, gh x gw the patch grid.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from specvit.nn.qkv import one_node, packed_heads


def sincos_1d(positions: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """Interleaved sin-cos table of "Attention Is All You Need".

    ``PE[p, 2i] = sin(p / base^(2i/dim))`` and ``PE[p, 2i+1] = cos(p / base^(2i/dim))``; identical to the
    PyTorch tutorial's ``PositionalEncoding`` buffer.

    Args:
        positions: (N,) integer or float positions.
        dim: table width, even.
        base: wavelength base.

    Returns:
        (N, dim) float32 table on ``positions.device``.
    """
    if dim % 2 != 0:
        raise ValueError(f"sincos_1d needs an even dim, got {dim}")
    exponent = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32)  # (dim/2,)
    inv_freq = torch.exp(exponent * (-math.log(base) / dim))  # (dim/2,)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (N, dim/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (N, dim/2, 2) -> (N, dim)


def _sincos_half_split(positions: Tensor, dim: int, base: float) -> Tensor:
    """MAE's 1D table: ``cat(sin(p * omega), cos(p * omega))`` with ``omega_i = base^(-i / (dim/2))``."""
    omega = torch.arange(dim // 2, device=positions.device, dtype=torch.float32) / (dim / 2)  # (dim/2,)
    omega = 1.0 / base**omega
    angles = positions.to(torch.float32)[:, None] * omega[None, :]  # (N, dim/2)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)  # (N, dim)


def sincos_2d(
    grid_h: int,
    grid_w: int,
    dim: int,
    base: float = 10000.0,
    device: torch.device | str | None = None,
) -> Tensor:
    """2D sin-cos table in the convention of MAE's ``get_2d_sincos_pos_embed``.

    Tokens are in row-major order (token ``r * grid_w + c`` is row r, column c). The first ``dim/2``
    channels encode the column (w / x) coordinate and the last ``dim/2`` the row (h / y) coordinate (MAE's
    ``np.meshgrid(grid_w, grid_h)`` puts w first); each half is ``[sin(p * omega), cos(p * omega)]`` with
    ``omega_i = base^(-i / (dim/4))``, i < dim/4 (halves, not interleaved).

    Args:
        grid_h: number of patch rows.
        grid_w: number of patch columns.
        dim: table width, divisible by 4.
        base: wavelength base.
        device: device of the table.

    Returns:
        (grid_h * grid_w, dim) float32 table.
    """
    if dim % 4 != 0:
        raise ValueError(f"sincos_2d needs dim divisible by 4, got {dim}")
    rows = torch.arange(grid_h, device=device).repeat_interleave(grid_w)  # (gh*gw,)
    cols = torch.arange(grid_w, device=device).repeat(grid_h)  # (gh*gw,)
    emb_w = _sincos_half_split(cols, dim // 2, base)  # (gh*gw, D/2)
    emb_h = _sincos_half_split(rows, dim // 2, base)  # (gh*gw, D/2)
    return torch.cat((emb_w, emb_h), dim=-1)  # (gh*gw, D)


class LearnedPosition(nn.Module):
    """Learned absolute position table added to the tokens.

    Args:
        num_positions: number of rows of the table (maximum sequence length, plus ``start``).
        dim: width D.
        start: the row of position 0 (BART's offset of 2).
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        num_positions: int,
        dim: int,
        start: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_positions, self.start = num_positions, start
        self.weight = nn.Parameter(
            torch.empty(1, num_positions, dim, device=device, dtype=dtype)
        )  # (1, N, D)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated normal, std 0.02 (cut at +-2 std)."""
        nn.init.trunc_normal_(self.weight, std=0.02, a=-0.04, b=0.04)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """Add rows ``offset .. offset + N - 1`` of the table to x of shape (B, N, D)."""
        n = x.shape[1]
        first = self.start + offset
        if offset < 0 or first + n > self.num_positions:
            raise ValueError(
                f"LearnedPosition has {self.num_positions - self.start} positions but positions "
                f"{offset}..{offset + n - 1} were requested (offset {offset} + {n} tokens)"
            )
        return x + self.weight[:, first : first + n]  # (B, N, D)

    def extra_repr(self) -> str:
        return f"num_positions={self.num_positions}, dim={self.weight.shape[-1]}, start={self.start}"


def sincos_1d_concat(positions: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """The sin-cos table of "Attention Is All You Need" with the sines first, then the cosines (Marian).

    ``PE[p, i] = sin(p / base^(2i/dim))`` and ``PE[p, dim/2 + i] = cos(p / base^(2i/dim))``, i < dim/2;
    the angles and their sines are computed in float64 and rounded once to float32, as Marian's table
    (equal to it bit for bit; MAE's float32 half-split table, ``_sincos_half_split``, is not).

    Args:
        positions: (N,) integer or float positions.
        dim: table width, even.
        base: wavelength base.

    Returns:
        (N, dim) float32 table on ``positions.device``.
    """
    exponent = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim  # (dim/2,)
    angles = positions.to(torch.float64)[:, None] / base ** exponent[None, :]  # (N, dim/2)
    return torch.cat((angles.sin(), angles.cos()), dim=-1).to(torch.float32)  # (N, dim)


def sincos_1d_tensor2tensor(positions: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """The (N, dim) sin-cos table of tensor2tensor and fairseq (M2M100): sines, then cosines, of frequencies
    ``base^(-i / (dim/2 - 1))``, i < dim/2 (the last exactly ``1/base``), computed in float32 in the order of
    fairseq's ``get_embedding`` (and transformers' M2M100), which it equals bit for bit.

    Args:
        positions: (N,) integer or float positions.
        dim: table width, even and at least 4.
        base: wavelength base.
    """
    if dim % 2 != 0 or (half := dim // 2) < 2:
        raise ValueError(f"sincos_1d_tensor2tensor needs an even dim of at least 4, got {dim}")
    step = math.log(base) / (half - 1)
    inv_freq = torch.exp(torch.arange(half, device=positions.device, dtype=torch.int64).float() * -step)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (N, dim/2)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)  # (N, dim)


SinCosLayout = Literal["interleaved", "concat"]
SinCosFrequencies = Literal["paper", "tensor2tensor"]


def sincos_table(
    positions: Tensor,
    dim: int,
    base: float = 10000.0,
    layout: SinCosLayout = "interleaved",
    frequencies: SinCosFrequencies = "paper",
) -> Tensor:
    """The (N, dim) float32 table of (N,) ``positions``: :func:`sincos_1d` (interleaved), :func:`sincos_1d_concat`
    (sines, then cosines) or, of ``tensor2tensor`` frequencies, :func:`sincos_1d_tensor2tensor` (its pairs
    interleaved where ``layout`` says so).

    Args:
        positions: (N,) positions.
        dim: table width, even.
        base: wavelength base.
        layout: ``interleaved`` or ``concat``.
        frequencies: ``paper`` (``base^(-2i/dim)``) or ``tensor2tensor`` (``base^(-i/(dim/2 - 1))``).
    """
    if frequencies == "tensor2tensor":
        table = sincos_1d_tensor2tensor(positions, dim, base)  # (N, dim): [sin | cos]
        if layout == "interleaved":
            table = torch.stack(table.chunk(2, dim=-1), dim=-1).flatten(-2)  # (N, dim/2, 2) -> (N, dim)
        return table
    if layout == "concat":
        return sincos_1d_concat(positions, dim, base)
    return sincos_1d(positions, dim, base)


class SinCosPosition(nn.Module):
    """Adds the fixed 1D table (:func:`sincos_table`) of positions ``start + offset .. start + offset + N - 1``.

    Args:
        dim: width D, even.
        base: wavelength base.
        layout: ``interleaved`` or ``concat``.
        frequencies: ``paper`` or ``tensor2tensor``.
        start: the position of the first token (M2M100 numbers tokens from ``pad_token_id + 1``).
    """

    def __init__(
        self,
        dim: int,
        base: float = 10000.0,
        layout: SinCosLayout = "interleaved",
        frequencies: SinCosFrequencies = "paper",
        start: int = 0,
    ) -> None:
        super().__init__()
        if dim % 2 != 0:
            raise ValueError(f"SinCosPosition needs an even dim, got {dim}")
        if layout not in ("interleaved", "concat"):
            raise ValueError(f"SinCosPosition's layout must be 'interleaved' or 'concat', got {layout!r}")
        if frequencies not in ("paper", "tensor2tensor"):
            raise ValueError(f"SinCosPosition's frequencies: 'paper' or 'tensor2tensor', not {frequencies!r}")
        self.dim, self.base, self.layout, self.frequencies, self.start = dim, base, layout, frequencies, start

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        first = self.start + offset
        positions = torch.arange(first, first + x.shape[1], device=x.device)  # (N,)
        table = sincos_table(positions, self.dim, self.base, self.layout, self.frequencies)  # (N, D)
        return x + table.to(x.dtype)  # (B, N, D)

    def extra_repr(self) -> str:
        layout = "" if self.layout == "interleaved" else f", layout={self.layout}"
        rest = ("" if self.frequencies == "paper" else f", frequencies={self.frequencies}") + (
            f", start={self.start}" if self.start else ""
        )
        return f"dim={self.dim}, base={self.base}{layout}{rest}"


class SinCos2dPosition(nn.Module):
    """Adds the fixed 2D table :func:`sincos_2d` (MAE convention) to patch tokens.

    Args:
        dim: width D, divisible by 4.
        grid: (gh, gw) patch grid; x must have exactly prefix + gh * gw tokens, patches row-major.
        base: wavelength base.
        prefix: leading tokens in front of the grid (MAE's decoder gets the encoder's class token), whose
            position is zero.
    """

    def __init__(self, dim: int, grid: tuple[int, int], base: float = 10000.0, prefix: int = 0) -> None:
        super().__init__()
        if dim % 4 != 0:
            raise ValueError(f"SinCos2dPosition needs dim divisible by 4, got {dim}")
        self.dim = dim
        self.grid = grid
        self.base = base
        self.prefix = prefix

    def forward(self, x: Tensor) -> Tensor:
        gh, gw = self.grid
        if x.shape[1] != self.prefix + gh * gw:
            raise ValueError(
                f"SinCos2dPosition expects {self.prefix}+{gh}x{gw}={self.prefix + gh * gw} tokens, got {x.shape[1]}"
            )
        table = sincos_2d(gh, gw, self.dim, self.base, device=x.device)  # (N, D)
        if self.prefix:
            table = torch.cat((table.new_zeros(self.prefix, self.dim), table))  # (prefix + N, D)
        return x + table.to(x.dtype)  # (B, prefix + N, D)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, grid={self.grid}, base={self.base}" + (
            f", prefix={self.prefix}" if self.prefix else ""
        )


def _rope_inv_freq(dim: int, base: float, device: torch.device | str | None) -> Tensor:
    """Inverse frequencies ``base^(-2i/dim)``, i < dim/2, computed as in HF's LLaMA rotary embedding."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))  # (dim/2,)


def rope_tables(
    positions: Tensor, dim: int, base: float, layout: Rope1dLayout = "half"
) -> tuple[Tensor, Tensor]:
    """cos/sin of the RoPE of width dim at (N,) ``positions``, float32: for ``half``, angles
    ``cat(freqs, freqs)``, each (N, dim); for ``interleaved``, each angle twice in a row, (N, dim/2, 2)."""
    inv_freq = _rope_inv_freq(dim, base, positions.device)  # (dim/2,)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (N, dim/2)
    if layout == "interleaved":
        angles = freqs[..., None].expand(*freqs.shape, 2)  # (N, dim/2, 2): channels 2i, 2i + 1 form a pair
    else:
        angles = torch.cat((freqs, freqs), dim=-1)  # (N, dim)
    return angles.cos(), angles.sin()


Rope1dLayout = Literal["half", "interleaved"]


class Rope(nn.Module):
    """1D rotary position embedding.

    Channel pairs are rotated by angle ``pos * base^(-2i/hd)``; ``layout`` says which channels pair up:
    ``half`` (GPT-NeoX, HF LLaMA): channel i with i + hd/2; ``interleaved`` (GPT-J, RoFormer): channel 2i
    with 2i + 1.

    Args:
        head_dim: hd, the width rotated, even.
        base: RoPE theta.
        layout: ``half`` or ``interleaved``.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, layout: Rope1dLayout = "half") -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"Rope needs an even head_dim, got {head_dim}")
        if layout not in ("half", "interleaved"):
            raise ValueError(f"Rope's layout must be 'half' or 'interleaved', got {layout!r}")
        self.head_dim = head_dim
        self.base = base
        self.layout = layout

    def forward(self, x: Tensor, *, offset: int = 0) -> tuple[Tensor, Tensor]:
        """Float32 ``(cos, sin)`` for positions ``offset .. offset + N - 1`` of x: (B, N, D); each (N, hd),
        or (N, hd/2, 2) interleaved."""
        positions = torch.arange(offset, offset + x.shape[1], device=x.device)  # (N,)
        return rope_tables(positions, self.head_dim, self.base, self.layout)

    def extra_repr(self) -> str:
        layout = "" if self.layout == "half" else f", layout={self.layout}"
        return f"head_dim={self.head_dim}, base={self.base}{layout}"


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x by RoPE tables: ``x * cos + rotate_half(x) * sin`` over the channels the tables cover.

    Args:
        x: (B, H, N, hd) queries or keys.
        cos: (N, r) table from :class:`Rope` or :class:`~specvit.nn.rope2d.Rope2d` (rotate-half over the first r <= hd channels),
            or (N, S, r/S) sectioned table from :class:`Rope` or :class:`~specvit.nn.rope2d.Rope2d` (the first r channels split in
            S contiguous sections, each rotated on its own: CroCo's two halves, or r/2 interleaved pairs).
        sin: same shape as ``cos``.

    Returns:
        (B, H, N, hd) tensor with x's dtype (the tables are cast to it).
    """
    if one_node(x, (cos, sin)):
        return packed_heads(x, (x.shape[-3],), (cos, sin), rotated=1)[0]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    width = cos.shape[-1] if cos.ndim == 2 else cos.shape[-2] * cos.shape[-1]
    if width < x.shape[-1]:  # partial rotary: the first channels only
        rot, keep = x.split((width, x.shape[-1] - width), dim=-1)
        return torch.cat((_rotate(rot, cos, sin), keep), dim=-1)  # (B, H, N, hd)
    return _rotate(x, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    if cos.ndim == 2:
        return x * cos + _rotate_half(x) * sin  # (B, H, N, r)
    xs = x.unflatten(-1, cos.shape[-2:])  # (B, H, N, S, r/S)
    return (xs * cos + _rotate_half(xs) * sin).flatten(-2)  # (B, H, N, r)


def sine_2d(
    grid_h: int, grid_w: int, dim: int, base: float = 10000.0, device: torch.device | str | None = None
) -> Tensor:
    """DETR's ``PositionEmbeddingSine(normalize=True)`` for an unpadded (grid_h, grid_w) map: (gh*gw, dim).

    Rows and columns are numbered from 1 and scaled to (0, 2*pi]; the first dim/2 channels encode the row
    (y), the last dim/2 the column (x), each as sin/cos interleaved over frequencies ``base**(2*(i//2)/(dim/2))``.
    Tokens are row-major.
    """
    half = dim // 2
    eps, scale = 1e-6, 2 * math.pi
    y = torch.arange(1, grid_h + 1, dtype=torch.float32, device=device) / (grid_h + eps) * scale  # (gh,)
    x = torch.arange(1, grid_w + 1, dtype=torch.float32, device=device) / (grid_w + eps) * scale  # (gw,)
    steps = torch.arange(half, dtype=torch.float32, device=device)
    freq = base ** (2 * torch.div(steps, 2, rounding_mode="floor") / half)  # (dim/2,)

    def encode(coord: Tensor) -> Tensor:
        angles = coord[:, None] / freq  # (L, dim/2)
        return torch.stack((angles[:, 0::2].sin(), angles[:, 1::2].cos()), dim=2).flatten(1)  # (L, dim/2)

    pos_y = encode(y)[:, None, :].expand(grid_h, grid_w, half)  # (gh, gw, dim/2)
    pos_x = encode(x)[None, :, :].expand(grid_h, grid_w, half)  # (gh, gw, dim/2)
    return torch.cat((pos_y, pos_x), dim=2).reshape(grid_h * grid_w, dim)  # (gh*gw, dim)


class Sine2dPosition(nn.Module):
    """DETR's 2D sine positions of a token grid, returned (not added): attention layers add them to q and k.

    Args:
        dim: width D, divisible by 4.
        grid: (gh, gw) token grid.
        base: temperature.
    """

    def __init__(self, dim: int, grid: tuple[int, int], base: float = 10000.0) -> None:
        super().__init__()
        if dim % 4:
            raise ValueError(f"Sine2dPosition needs a width divisible by 4, got {dim}")
        self.dim, self.grid, self.base = dim, grid, base

    def forward(self, x: Tensor) -> Tensor:
        """(1, gh*gw, D) positions for the tokens x: (B, gh*gw, D), in x's dtype."""
        return sine_2d(*self.grid, self.dim, self.base, device=x.device).to(x.dtype)[None]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, grid={self.grid}, base={self.base}"
