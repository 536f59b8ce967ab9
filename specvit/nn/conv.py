"""Layers over channels-first maps that ``torch.nn`` lacks: a LayerNorm over the channels (timm's and SAM's
LayerNorm2d) and a convolution with a standardised weight (BiT's StdConv2d, timm's ResNetV2 stems).

Dim legend: B batch, C channels, H, W (or L) the map's sides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LayerNorm2d", "StdConv2d"]


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map (or a (B, C, L) signal), at each position."""

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, C, *size) -> (B, C, *size)."""
        out = F.layer_norm(x.movedim(1, -1), self.normalized_shape, self.weight, self.bias, self.eps)
        return out.movedim(-1, 1)


class StdConv2d(nn.Conv2d):
    """A Conv2d whose weight is standardised per output channel before use:
    ``(w - mean) / sqrt(var + eps)`` over each filter (Kolesnikov et al. 2020, BiT).

    Args:
        in_channels: input channels.
        out_channels: output channels (filters).
        kernel_size: side of the square kernel.
        stride: its step.
        padding: zeros on each side.
        groups: channel groups.
        bias: a bias per output channel.
        eps: added to each filter's (biased) variance.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        groups: int = 1,
        bias: bool = True,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            groups=groups,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, C_in, H, W) -> (B, C_out, H', W')."""
        var, mean = torch.var_mean(self.weight, dim=(1, 2, 3), keepdim=True, correction=0)
        return self._conv_forward(x, (self.weight - mean) / torch.sqrt(var + self.eps), self.bias)
