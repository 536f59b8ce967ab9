"""A learned position table kept at a grid of its own and resampled to the image's: ``position: {kind: learned,
grid: {size: [16, 16]}}`` (timm's NaFlexVit, whose one table serves images of any size)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from specvit.ops.base import Filler, Fragment, Op, Params, op
from specvit.ops.fields import Pair

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ResampledParams", "TableGrid"]


class TableGrid(Fragment):
    """The patch grid a learned table is stored at, and how it is resampled to the image's grid."""

    size: Pair = Field(description="The table's [rows, cols] (one int: square).")
    mode: Literal["bicubic", "bilinear"] = Field(
        "bicubic", description="The interpolation (F.interpolate's mode, corners not aligned)."
    )
    antialias: bool = Field(
        True,
        description="PyTorch's antialiased kernels (timm's default): smooth when shrinking; they upsample "
        "with their own cubic coefficient (-0.5), so a table trained with one setting needs it.",
    )


@dataclass(frozen=True)
class ResampledParams(Params):
    """A learned table of ``grid`` rows x cols, resampled to ``size`` and added to the patches.

    Args:
        grid: the table's (rows, cols).
        size: the image's patch grid.
        dim: width.
        mode: the interpolation.
        antialias: antialiased kernels.
    """

    grid: tuple[int, int]
    size: tuple[int, int]
    dim: int
    mode: str = "bicubic"
    antialias: bool = True


@op
class ResampledOp(Op):
    kind = "pos_resampled"
    params_type = ResampledParams
    category = "position"
    module = "specvit.nn.resampled:ResampledPosition"
    ports = ("x",)

    def params(self, p: ResampledParams) -> int:
        return p.grid[0] * p.grid[1] * p.dim

    def ctor(self, p: ResampledParams) -> dict[str, Any]:
        given = {"mode": (p.mode, "bicubic"), "antialias": (p.antialias, True)}
        fixed = {"grid": p.grid, "size": p.size, "dim": p.dim}
        return fixed | {k: v for k, (v, default) in given.items() if v != default}

    def init(self, module: nn.Module, p: ResampledParams, fill: Filler) -> None:
        import torch.nn as nn

        if fill.convention == "vit":
            fill(module.weight, lambda t: nn.init.trunc_normal_(t, std=0.02))
        else:
            fill(module.weight, lambda t: t.normal_(std=0.02))

    def label(self, p: ResampledParams) -> tuple[str, ...]:
        (r, c), (h, w) = p.grid, p.size
        how = "" if p.grid == p.size else f" · {p.mode}{' antialiased' * p.antialias} to {h}x{w}"
        return (f"learned {r}x{c}{how} · added",)
