"""ALiBi (Press et al., 2022): attention biased by key distance, with one slope per head, no position table.

Dim legend: B batch, N new tokens (queries), T keys (cached + new), H heads.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["Alibi", "alibi_slopes"]


def alibi_slopes(heads: int) -> Tensor:
    """The heads' slopes: a geometric sequence from 2^(-8/n) for the largest power of two n <= heads, then
    the odd powers of 2^(-4/n) for the rest (as BLOOM's ``build_alibi_tensor``), float32 (H,)."""
    closest = 2 ** math.floor(math.log2(heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        extra = min(closest, heads - closest)
        powers = torch.arange(1, 1 + 2 * extra, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, powers)], dim=0)
    return slopes  # (H,)


class Alibi(nn.Module):
    """The additive attention bias of ALiBi for the new tokens x, against every key (cached and new).

    Causal: ``slope * j`` for key position j (BLOOM's form: softmax ignores the ``-slope * i`` it drops,
    and the causal mask hides j > i). Bidirectional: ``-slope * |i - j|``. Positions count the tokens that
    are not padding (BLOOM's ``cumsum`` of the attention mask), so left padding does not shift them.

    Args:
        heads: number of heads H.
        causal: the attention it biases is causal.
    """

    def __init__(self, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal

    def forward(self, x: Tensor, *, offset: int = 0, mask: Tensor | None = None) -> Tensor:
        """The bias, float32: (B, H, 1, T) when causal, (B, H, N, T) otherwise.

        Args:
            x: (B, N, D) the new tokens.
            offset: tokens already in the KV cache (T = offset + N).
            mask: (B, T) bool, True = padding.
        """
        n = x.shape[1]
        t = offset + n
        if mask is None:
            keys = torch.arange(t, device=x.device, dtype=torch.float32).expand(x.shape[0], t)  # (B, T) view
        else:
            keep = (~mask).to(torch.float32)  # (B, T)
            keys = (keep.cumsum(dim=-1) - 1) * keep  # (B, T): a padded key gets position 0
        slopes = alibi_slopes(self.heads).to(x.device)[None, :, None, None]  # (1, H, 1, 1)
        if self.causal:
            return slopes * keys[:, None, None, :]  # (B, H, 1, T)
        queries = keys[:, -n:]  # (B, N)
        distance = (queries[:, :, None] - keys[:, None, :]).abs()  # (B, N, T)
        return -slopes * distance[:, None]  # (B, H, N, T)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, causal={self.causal}"
