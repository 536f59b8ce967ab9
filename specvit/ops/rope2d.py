"""``position: rope2d``: rotary embedding of queries and keys over the patch grid (CroCo, EVA-02).

The op it lowers to is the ``rope`` op of :mod:`specvit.ops.position` (one table every self-attention
reads); this fragment chooses its grid, its channel layout and its coordinates.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import StackCtx, fragment
from specvit.ops.facts import SpecView, StackView
from specvit.ops.position import Phase, PositionFragment, _base, _grid_only, _needs
from specvit.ops.rope import RopeParams

__all__ = ["Rope2dPosition"]


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
        p = RopeParams(
            ctx.stack.facts.head_dim,
            self.base,
            ctx.grid,
            ctx.stack.facts.num_prefix,
            layout=self.layout,
            ref=None if self.ref_grid is None else (self.ref_grid[0], self.ref_grid[1]),
        )
        rope = ctx.add(f"{ctx.role}.rope", "rope", p, {"x": ctx.x}, source=f"{ctx.role}.position")
        ctx.side["rope"] = rope
        if "memory" in ctx.side and ctx.stack.input.kind == "siamese":
            ctx.side["memory_rope"] = rope  # the memory lies on the same patch grid (CroCo)
