"""A learned position table stored at a grid of its own and resampled to the image's (timm's NaFlexVit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ResampledPosition"]


class ResampledPosition(nn.Module):
    """A learned (rows x cols) table of position embeddings, resampled to the patch grid of the image and added
    to the patches: the table a model was trained with at one grid serves images of another (timm's NaFlexVit
    at any fixed size). At its own grid it is a plain learned table.

    Args:
        grid: the table's (rows, cols).
        size: the image's patch grid (rows, cols) the table is resampled to.
        dim: width D.
        mode: ``F.interpolate``'s mode (``bicubic``, ``bilinear``).
        antialias: antialias when shrinking (PyTorch's antialiased kernels, which also upsample with their
            own cubic coefficient).
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        grid: tuple[int, int],
        size: tuple[int, int],
        dim: int,
        mode: str = "bicubic",
        antialias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.grid, self.size, self.mode, self.antialias = tuple(grid), tuple(size), mode, antialias
        self.weight = nn.Parameter(
            torch.empty(1, grid[0], grid[1], dim, device=device, dtype=dtype)
        )  # (1, rows, cols, D)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated normal, std 0.02 (cut at +-2 std)."""
        nn.init.trunc_normal_(self.weight, std=0.02, a=-0.04, b=0.04)

    def table(self) -> Tensor:
        """The table at the image's grid, (1, rows * cols, D) in row-major order."""
        if self.size == self.grid:
            return self.weight.flatten(1, 2)  # (1, rows * cols, D)
        maps = self.weight.permute(0, 3, 1, 2).float()  # (1, D, rows, cols)
        maps = F.interpolate(
            maps, size=self.size, mode=self.mode, align_corners=False, antialias=self.antialias
        )
        return maps.flatten(2).transpose(1, 2)  # (1, h * w, D)

    def forward(self, x: Tensor) -> Tensor:
        """Add the resampled table to the (B, h * w, D) patches."""
        return x + self.table().to(x.dtype)
