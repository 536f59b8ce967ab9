"""Input embeddings: image patches, text tokens and learned prefix (cls / register) tokens.

Dim legend: B batch, N tokens, D width, H heads, Hkv kv heads, hd head dim, M memory tokens.
C image channels, (Himg, Wimg) image size, (ph, pw) patch size, (gh, gw) patch grid, R registers.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from specvit.nn.linear import Linear


class PatchEmbed(nn.Module):
    """Split an image into non-overlapping patches and project each to D channels.

    Tokens come out in row-major order (token ``r * gw + c`` is patch row r, column c). With
    ``projection='linear'`` each patch is flattened in (C, ph, pw) order, so a Conv2d weight reshaped to
    (D, C*ph*pw) is the equivalent Linear weight.

    Args:
        img_size: (Himg, Wimg) expected input size, divisible by the patch size.
        patch: (ph, pw) patch size.
        in_chans: number of input channels C.
        dim: output width D.
        projection: ``conv`` (Conv2d with kernel = stride = patch) or ``linear`` (Linear on flat patches).
        bias: whether the projection has a bias.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        img_size: tuple[int, int],
        patch: tuple[int, int],
        in_chans: int,
        dim: int,
        projection: Literal["conv", "linear"] = "conv",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if img_size[0] % patch[0] != 0 or img_size[1] % patch[1] != 0:
            raise ValueError(f"image size {img_size} is not divisible by patch size {patch}")
        self.img_size = img_size
        self.patch = patch
        self.grid: tuple[int, int] = (img_size[0] // patch[0], img_size[1] // patch[1])
        self.num_patches = self.grid[0] * self.grid[1]
        self.projection = projection
        self.proj: nn.Conv2d | nn.Linear
        if projection == "conv":
            self.proj = nn.Conv2d(
                in_chans, dim, kernel_size=patch, stride=patch, bias=bias, device=device, dtype=dtype
            )
        elif projection == "linear":
            self.proj = Linear(in_chans * patch[0] * patch[1], dim, bias=bias, device=device, dtype=dtype)
        else:
            raise ValueError(f"projection must be 'conv' or 'linear', got {projection!r}")

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        if (h, w) != self.img_size:
            raise ValueError(f"PatchEmbed expects images of size {self.img_size}, got {(h, w)}")
        gh, gw = self.grid
        ph, pw = self.patch
        if self.projection == "conv":
            return self.proj(x).flatten(2).transpose(1, 2)  # (B, D, gh, gw) -> (B, N, D)
        x = x.reshape(b, c, gh, ph, gw, pw)  # (B, C, gh, ph, gw, pw)
        x = x.permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * ph * pw)  # (B, N, C*ph*pw)
        return self.proj(x)  # (B, N, D)

    def extra_repr(self) -> str:
        return f"img_size={self.img_size}, patch={self.patch}, grid={self.grid}, projection={self.projection}"


class TokenEmbed(nn.Embedding):
    """Token embedding table, optionally scaled by ``sqrt(dim)`` (Transformer / T5-style).

    Args:
        vocab: vocabulary size.
        dim: width D.
        padding_idx: index whose row is zero and receives no gradient.
        scale: multiply the looked-up rows by ``sqrt(dim)``.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        vocab: int,
        dim: int,
        padding_idx: int | None = None,
        scale: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(vocab, dim, padding_idx=padding_idx, device=device, dtype=dtype)
        self.scale = scale

    def forward(self, input: Tensor) -> Tensor:
        out = super().forward(input)  # (B, N, D)
        return out * math.sqrt(self.embedding_dim) if self.scale else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale}"


class TypeEmbed(nn.Embedding):
    """Token-type (segment) embeddings added to the tokens (BERT); every token is type 0 when none are given.

    Args:
        type_vocab: number of types.
        dim: width D.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        type_vocab: int,
        dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(type_vocab, dim, device=device, dtype=dtype)

    def forward(self, x: Tensor, *, types: Tensor | None = None) -> Tensor:
        """x: (B, N, D) token embeddings; types: (B, N) ids, or None for all zeros."""
        if types is None:
            return x + self.weight[0]  # (B, N, D)
        return x + super().forward(types)  # (B, N, D)


class PrefixTokens(nn.Module):
    """Learned cls, distillation and register tokens prepended to the sequence: ``cat([cls, dist, reg, x])``
    (timm order).

    Args:
        dim: width D.
        cls: whether there is a ``cls_token`` parameter (1, 1, D).
        registers: number R of register tokens; a ``reg_token`` parameter (1, R, D) exists when R > 0.
        distillation: whether there is a ``dist_token`` parameter (1, 1, D) (DeiT).
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        cls: bool,
        registers: int = 0,
        distillation: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if registers < 0:
            raise ValueError(f"registers must be >= 0, got {registers}")
        self.num_prefix = int(cls) + int(distillation) + registers
        self.cls_token: nn.Parameter | None = None
        self.dist_token: nn.Parameter | None = None
        self.reg_token: nn.Parameter | None = None
        if cls:
            self.cls_token = nn.Parameter(torch.empty(1, 1, dim, device=device, dtype=dtype))  # (1, 1, D)
        if distillation:
            self.dist_token = nn.Parameter(torch.empty(1, 1, dim, device=device, dtype=dtype))  # (1, 1, D)
        if registers > 0:
            self.reg_token = nn.Parameter(
                torch.empty(1, registers, dim, device=device, dtype=dtype)
            )  # (1, R, D)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated normal, std 0.02 (cut at +-2 std), for every token."""
        for p in (self.cls_token, self.dist_token, self.reg_token):
            if p is not None:
                nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04)

    def forward(self, x: Tensor) -> Tensor:
        b = x.shape[0]
        tokens = (self.cls_token, self.dist_token, self.reg_token)
        parts = [p.expand(b, -1, -1) for p in tokens if p is not None]
        if not parts:
            return x
        return torch.cat([*parts, x], dim=1)  # (B, num_prefix + N, D)

    def extra_repr(self) -> str:
        dist = ", distillation=True" if self.dist_token is not None else ""
        return f"cls={self.cls_token is not None}{dist}, num_prefix={self.num_prefix}"


class QueryEmbed(nn.Module):
    """DETR's learned object queries: a (N, D) table, expanded over the batch.

    Args:
        count: number of queries N.
        dim: width D.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self, count: int, dim: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, dim, device=device, dtype=dtype))  # (N, D)
        nn.init.normal_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        """The queries for each sample of x (any tensor whose first dim is the batch): (B, N, D)."""
        # a copy, not an expanded view: a view of a parameter made under no_grad confuses autograd's hooks
        return self.weight[None].repeat(x.shape[0], 1, 1)  # (B, N, D)
