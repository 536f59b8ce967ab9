"""SAGAN's self-attention over a convolutional feature map (Zhang et al., 2019)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["SaganAttention"]


class SaganAttention(nn.Module):
    """Self-attention among the H*W positions of a (B, C, H, W) map, scaled by a learned scalar gamma.

    With f = W_f x and g = W_g x (1x1 convs to ``qk_channels``) and h = W_h x (a 1x1 conv keeping C):
    beta[j, i] = softmax_i(f(x_i) . g(x_j)), o_j = sum_i beta[j, i] h(x_i), and the output is gamma * o
    (the block adds x). gamma starts at 0, so the block starts as the identity.

    Args:
        channels: channels C of the feature map.
        qk_channels: channels of f and g (SAGAN: C / 8).
        qkv_bias: biases in the f, g and h convs.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        channels: int,
        qk_channels: int,
        qkv_bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        # g (query) is read at the attending position j, f (key) at the attended positions i
        self.query = nn.Conv2d(channels, qk_channels, 1, bias=qkv_bias, device=device, dtype=dtype)
        self.key = nn.Conv2d(channels, qk_channels, 1, bias=qkv_bias, device=device, dtype=dtype)
        self.value = nn.Conv2d(channels, channels, 1, bias=qkv_bias, device=device, dtype=dtype)  # h
        self.gamma = nn.Parameter(torch.zeros(1, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        """gamma * o for a (B, C, H, W) map x -> (B, C, H, W)."""
        b, c, h, w = x.shape
        q = self.query(x).flatten(2)  # (B, C', N), N = H * W
        k = self.key(x).flatten(2)  # (B, C', N)
        v = self.value(x).flatten(2)  # (B, C, N)
        weights = torch.softmax(q.transpose(1, 2) @ k, dim=-1)  # (B, N_j, N_i): each j over every i
        o = v @ weights.transpose(1, 2)  # (B, C, N_j) = sum_i h(x_i) beta[j, i]
        return self.gamma * o.view(b, c, h, w)  # (B, C, H, W)

    def extra_repr(self) -> str:
        return f"channels={self.value.out_channels}, qk_channels={self.query.out_channels}"
