"""``position: rope2d``: rotary embedding of queries and keys over the patch grid (CroCo, EVA-02).

The op it lowers to is the ``rope`` op of :mod:`specvit.ops.position` (one table every self-attention
reads); this fragment chooses its grid, its channel layout and its coordinates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import Dims, Filler, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.block import BlockCtx
from specvit.ops.facts import SpecView, StackView
from specvit.ops.position import Phase, PositionFragment, _base, _grid_only, _needs
from specvit.ops.rope import RopeParams

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MixedParams", "Rope2dPosition"]


@fragment("position")
class Rope2dPosition(PositionFragment):
    """2D rotary embedding over the patch grid (CroCo; EVA-02 with layout interleaved and ref_grid)."""

    kind: Literal["rope2d"] = Field(description="Discriminator: 2D rotary positions (images).")
    base: float = _base(100.0)
    layout: Literal["sections", "interleaved", "half"] = Field(
        "sections",
        description="Which channels are rotated together. sections (CroCo): the head's first half by the "
        "row, its second by the column, each half rotate-half. interleaved (EVA-02, timm's "
        "RotaryEmbeddingCat): adjacent channels pair up, the first half of the pairs by the row, the rest by "
        "the column. half (timm's rope_rotate_half): channel i with i + head_dim/2, the first quarter of the "
        "head by the row, the second by the column.",
    )
    ref_grid: list[int] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="EVA-02's ref_feat_shape (pt_hw_seq_len): the grid the positions are scaled to, [rows, "
        "cols]; row r becomes r / grid_rows * rows. null: the patch indexes 0, 1, ...",
    )

    axes: Literal["ij", "xy"] = Field(
        "ij",
        description="Which coordinate the first frequencies take: ij the row (EVA-02, timm's default); xy the "
        "column (timm's rope_grid_indexing='xy': the RoPE-ViT models).",
    )
    frequencies: Literal["fixed", "learned"] = Field(
        "fixed",
        description="fixed: base^(-i/(hd/4)), shared by every layer. learned: RoPE-Mixed (Heo et al. 2024): "
        "each attention layer learns, per head, a frequency of each channel pair along each axis, so a "
        "pair's angle mixes row and column; they start at the fixed magnitudes turned by a random angle "
        "per head (timm's rope_type='mixed'). Layout interleaved or half, no ref_grid.",
    )

    def phase(self) -> Phase:
        return "attention"

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        hd = stack.head_dim
        problems = _grid_only("rope2d", at, stack) + _needs(
            at,
            hd % 4 == 0,
            f"rope2d needs a head dim divisible by 4, got {hd}",
            "pick heads (or head_dim) so that width/heads is a multiple of 4",
        )
        if self.frequencies == "learned":
            problems += _needs(
                f"{at}.frequencies",
                self.layout != "sections" and self.ref_grid is None,
                "learned frequencies pair the channels interleaved or half, over the patch indexes",
                "set layout: interleaved or half, and remove ref_grid",
            ) + _needs(
                f"{at}.frequencies",
                stack.kv_heads == stack.heads,
                f"learned frequencies turn each head's keys as its queries; {stack.kv_heads} key/value heads "
                f"serve {stack.heads} query heads",
                "remove block.kv_heads, or use frequencies: fixed",
            )
        if self.ref_grid is not None:
            problems += _needs(
                f"{at}.ref_grid",
                all(1 <= r <= 4096 for r in self.ref_grid),
                f"ref_grid {self.ref_grid} must be two sizes between 1 and 4096",
                "write the pretraining patch grid, e.g. ref_grid: [16, 16]",
            )
        return problems

    def lower(self, ctx: StackCtx) -> None:
        assert ctx.grid is not None
        if self.frequencies == "learned":
            return  # every attention layer computes its own (lower_layer)
        p = RopeParams(
            ctx.stack.facts.head_dim,
            self.base,
            ctx.grid,
            ctx.stack.facts.num_prefix,
            layout=self.layout,
            ref=None if self.ref_grid is None else (self.ref_grid[0], self.ref_grid[1]),
            axes=self.axes,
        )
        rope = ctx.add(f"{ctx.role}.rope", "rope", p, {"x": ctx.x}, source=f"{ctx.role}.position")
        ctx.side["rope"] = rope
        if "memory" in ctx.side and ctx.stack.input.kind == "siamese":
            ctx.side["memory_rope"] = rope  # the memory lies on the same patch grid (CroCo)

    def lower_layer(self, b: BlockCtx, x: str, name: str) -> str | None:
        """Learned frequencies: the attention layer's own rotations, read as its ``rope``."""
        if self.frequencies != "learned":
            return None
        facts = b.stack.stack.facts
        assert facts.grid is not None  # an image input (the check)
        p = MixedParams(
            facts.heads, facts.head_dim, facts.grid, self.base, facts.num_prefix, self.layout, self.axes
        )
        return b.add(name, "rope_mixed", p, {"x": x}, source=f"{b.stack.role}.position")


@dataclass(frozen=True)
class MixedParams(Params):
    """One attention layer's RoPE-Mixed rotations (:class:`~specvit.nn.rope2d.RopeMixed`).

    Args:
        heads: the layer's heads.
        head_dim: their width.
        grid: the patch grid.
        base: the initial magnitudes' base.
        prefix: leading tokens left unrotated.
        layout: ``interleaved`` or ``half``.
        axes: ``ij`` or ``xy``.
    """

    heads: int
    head_dim: int
    grid: tuple[int, int]
    base: float
    prefix: int
    layout: str
    axes: str


@op
class MixedOp(Op):
    kind = "rope_mixed"
    params_type = MixedParams
    category = "position"
    module = "specvit.nn.rope2d:RopeMixed"
    ports = ("x",)
    value = "tuple[Tensor, Tensor]"  # (cos, sin) per head

    def shape(self, p: MixedParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        n = inputs["x"][1]
        if p.layout == "interleaved":
            return (p.heads, n, p.head_dim // 2, 2)  # pairs of adjacent channels
        return (p.heads, n, 1, p.head_dim)

    def params(self, p: MixedParams) -> int:
        return p.heads * p.head_dim  # (2, H, hd/2)

    def ctor(self, p: MixedParams) -> dict[str, Any]:
        fixed = {"heads": p.heads, "head_dim": p.head_dim, "grid": p.grid, "base": p.base}
        given = {"num_prefix": (p.prefix, 0), "layout": (p.layout, "interleaved"), "axes": (p.axes, "ij")}
        return fixed | {k: v for k, (v, default) in given.items() if v != default}

    def init(self, module: nn.Module, p: MixedParams, fill: Filler) -> None:
        from specvit.nn.rope2d import mixed_frequencies_

        fill(module.freqs, lambda t: mixed_frequencies_(t, p.base))

    def label(self, p: MixedParams) -> tuple[str, ...]:
        extra = [f"{p.layout} pairs"] + (["column first"] if p.axes == "xy" else [])
        extra += [f"{p.prefix} prefix unrotated"] if p.prefix else []
        return (f"rotary 2D · learned per head · grid {p.grid[0]}x{p.grid[1]}", " · ".join(extra))
