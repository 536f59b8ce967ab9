"""Swin's shifted-window attention (Liu et al., 2021; V2: Liu et al., 2022); patch merging is
:func:`~specvit.nn.functional.merge_2x2`, a norm and a linear layer.

Tokens are a row-major (gh, gw) grid. Windows of M x M tokens attend within themselves, with a learned
relative position bias; in shifted blocks the grid is cyclically rolled by -M/2 first and the pairs that
come from different regions of the unrolled image are masked with -100 (the paper's value). The index,
bias and mask are computed from static shapes in forward, so there are no buffers to initialise.

Dim legend: B batch, N = gh*gw tokens, C width, H heads, hd head dim, M window, L = M*M tokens per
window, nW windows per image.
"""

from __future__ import annotations

from typing import Any

from specvit.nn.attention import Attention, RelativeBias
from specvit.nn.scores import MASKED, MAX_LOGIT_SCALE, cpb_coords, relative_position_index, shift_mask

__all__ = [
    "MASKED",
    "MAX_LOGIT_SCALE",
    "WindowAttention",
    "cpb_coords",
    "relative_position_index",
    "shift_mask",
]


class WindowAttention(Attention):
    """Multi-head self-attention within (shifted) M x M windows, with a relative position bias. A
    configuration of the attention core: ``Attention(..., grid=grid, grid_window=window, shift=shift,
    relative="cpb" if cpb_hidden else "table", cosine=cosine)``.

    Args:
        dim: width C.
        num_heads: heads H.
        grid: (gh, gw) token grid; both divisible by ``window``.
        window: window side M.
        shift: cyclic shift (M/2 in every second Swin block, 0 otherwise).
        cpb_hidden: the hidden width of Swin-V2's continuous position bias MLP ``cpb_mlp``
            (2 -> hidden -> H, ``16 * sigmoid`` of its output), or 0 for the learned
            ``relative_position_bias_table`` of Swin.
        kwargs: the other arguments of :class:`~specvit.nn.attention.Attention` (``cosine``, ``pretrained``,
            ``qkv_bias`` ...).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        grid: tuple[int, int],
        window: int,
        shift: int = 0,
        *,
        cpb_hidden: int = 0,
        **kwargs: Any,
    ) -> None:
        if grid[0] % window or grid[1] % window:
            raise ValueError(f"grid {grid} is not divisible by window {window}")
        relative: RelativeBias = "cpb" if cpb_hidden else "table"
        super().__init__(
            dim,
            num_heads,
            grid=grid,
            grid_window=window,
            shift=shift,
            relative=relative,
            cpb_hidden=cpb_hidden,
            **kwargs,
        )
