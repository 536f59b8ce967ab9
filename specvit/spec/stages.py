"""The stages of a stack, resolved once from its keys: each stage's depth, heads, width, token grid and the
layers that lead into it.

A plain stack is one stage. A hierarchical one (``depth`` a list) starts each later stage with Swin's patch
merging (the grid halved, the width doubled) unless it writes ``downsample:``: then the tokens become a map,
run through those layers (PVT's overlapping patch embedding), and the map they leave is the stage's grid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specvit.ops.conv import map_out

__all__ = ["Stages", "with_channels"]


def with_channels(ops: list[Any], width: int) -> list[Any]:
    """``ops`` with every conv that states no channels leading to ``width`` (a downsample's conv: the next
    stage's width)."""
    return [
        layer.model_copy(update={"channels": width})
        if layer.kind == "conv" and layer.channels is None
        else layer
        for layer in ops
    ]


class Stages:
    """Per-stage values of a :class:`~specvit.spec.schema.StackSpec`, derived from its keys."""

    if TYPE_CHECKING:  # the stack's fields
        depth: int | list[int]
        width: int
        widths: list[int] | None
        downsample: list[Any] | None
        block: Any
        input: Any

    @property
    def hierarchical(self) -> bool:
        """A stack of stages with patch merging (or its ``downsample``) between them (``depth`` is a list)."""
        return isinstance(self.depth, list)

    @property
    def stage_depths(self) -> list[int]:
        return list(self.depth) if isinstance(self.depth, list) else [self.depth]

    @property
    def stage_heads(self) -> list[int]:
        heads = self.block.heads
        return list(heads) if isinstance(heads, list) else [heads] * len(self.stage_depths)

    @property
    def stage_widths(self) -> list[int]:
        """Each stage's width: ``widths`` when given, else ``width`` doubled per stage (Swin)."""
        return (
            list(self.widths) if self.widths else [self.width * 2**i for i in range(len(self.stage_depths))]
        )

    def stage_ops(self, i: int) -> list[Any]:
        """The ``downsample`` layers that lead into stage ``i`` (> 0), their convs to its width."""
        widths = self.stage_widths
        return with_channels(list(self.downsample or []), widths[min(i, len(widths) - 1)])

    @property
    def stage_grids(self) -> list[tuple[int, int]]:
        """Each stage's token grid (an image stack's): the input's, then halved by patch merging or what the
        ``downsample`` layers leave; empty without a grid."""
        grid = getattr(self.input, "grid", None)
        if grid is None:
            return []
        grids, widths = [grid], self.stage_widths
        for i in range(1, len(self.stage_depths)):
            if self.downsample is None:
                grid = (grid[0] // 2, grid[1] // 2)
            else:
                size = map_out(self.stage_ops(i), widths[min(i, len(widths)) - 1], grid)[1]
                grid = (size[0], size[1])
            grids.append(grid)
        return grids

    @property
    def out_grid(self) -> tuple[int, int] | None:
        """The token grid of the last stage, or None."""
        grids = self.stage_grids
        return grids[-1] if grids else None
