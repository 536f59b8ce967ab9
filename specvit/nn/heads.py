"""Sequence pooling heads.

Dim legend: B batch, N tokens, D width, H heads, Hkv kv heads, hd head dim, M memory tokens.
P below is the number of prefix (cls / register) tokens.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn


class Pool(nn.Module):
    """Pool a token sequence to one vector per sample (no parameters).

    ``cls`` takes token 0. ``mean`` averages the non-prefix tokens ``x[:, P:]`` (timm's ``global_pool='avg'``),
    skipping padded tokens when a mask is given; a sample whose tokens are all padding pools to zeros.

    Args:
        kind: ``cls`` or ``mean``.
        num_prefix: number P of prefix tokens at the start of the sequence (cls first, then registers).
    """

    def __init__(self, kind: Literal["cls", "mean"], num_prefix: int) -> None:
        super().__init__()
        if kind not in ("cls", "mean"):
            raise ValueError(f"Pool kind must be 'cls' or 'mean', got {kind!r}")
        if kind == "cls" and num_prefix < 1:
            raise ValueError("cls pooling needs a prefix (cls) token, but num_prefix is 0")
        self.kind = kind
        self.num_prefix = num_prefix

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Pool x of shape (B, N, D), with an optional (B, N) bool mask (True = padding), to (B, D)."""
        if self.kind == "cls":
            return x[:, 0]  # (B, D)
        tokens = x[:, self.num_prefix :]  # (B, N - P, D)
        if key_padding_mask is None:
            return tokens.mean(dim=1)  # (B, D)
        keep = (~key_padding_mask[:, self.num_prefix :]).to(x.dtype)[:, :, None]  # (B, N - P, 1)
        return (tokens * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)  # (B, D)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, num_prefix={self.num_prefix}"


class BoxMlp(nn.Module):
    """DETR's box regressor: Linear-ReLU repeated, a last Linear to 4, then a sigmoid.

    Args:
        dim: width D (also the hidden width).
        layers: number of linear layers.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        layers: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        outs = [dim] * (layers - 1) + [4]
        self.layers = nn.ModuleList(nn.Linear(dim, o, device=device, dtype=dtype) for o in outs)

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x.sigmoid()  # (B, N, 4)
