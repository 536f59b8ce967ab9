"""Perceiver's latent array: N learned vectors that are the residual stream of the latent tower."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["LatentArray"]


class LatentArray(nn.Module):
    """A learned (N, D) latent array, repeated over the batch of the input it will attend to.

    Args:
        count: number of latents N.
        dim: latent width D.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self, count: int, dim: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, dim, device=device, dtype=dtype))  # (N, D)
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """The latents for each sample of x (any tensor whose first dim is the batch): (B, N, D)."""
        # a copy, not an expanded view: a view of a parameter made under no_grad confuses autograd's hooks
        return self.weight[None].repeat(x.shape[0], 1, 1)  # (B, N, D)
