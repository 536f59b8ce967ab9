"""Head layers (pooling is :func:`~specvit.nn.functional.cls_pool` / :func:`~specvit.nn.functional.mean_pool`).

Dim legend: B batch, N tokens, D width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specvit.nn.linear import Linear


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
        self.layers = nn.ModuleList(Linear(dim, o, device=device, dtype=dtype) for o in outs)

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x.sigmoid()  # (B, N, 4)
