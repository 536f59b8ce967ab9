"""Parameter-free steps the generated forwards call by name: mask extension, pooling, the 2x2 merge.

Each is one graph node and one call in the generated code, so a traced forward shows it as one step.

Dim legend: B batch, N tokens (incl. prefix), P prefix tokens, D width, (gh, gw) token grid.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "cls_pool",
    "eos_pool",
    "extend_mask",
    "map_mean",
    "mean_pool",
    "merge_2x2",
    "shift_right",
    "to_map",
    "to_tokens",
]


def extend_mask(mask: Tensor | None, prefix: int) -> Tensor | None:
    """A (B, S) padding mask (True = padding) with ``prefix`` never-padded tokens in front: (B, P + S)."""
    if mask is None:
        return None
    return torch.cat((mask.new_zeros(mask.shape[0], prefix), mask), dim=1)  # (B, P + S)


def cls_pool(x: Tensor) -> Tensor:
    """The first (class) token of (B, N, D): (B, D)."""
    return x[:, 0]


def eos_pool(x: Tensor, ids: Tensor, eos_id: int | None, last: bool = False) -> Tensor:
    """The token at each sequence's end-of-text position (CLIP's text pooling): (B, N, D) -> (B, D).

    Args:
        x: (B, N, D) tokens.
        ids: (B, N) the input token ids.
        eos_id: the end token's id: its first occurrence is pooled; None: the position of the highest id
            (CLIP's original rule, where the end token has the highest id).
        last: pool the last occurrence instead (BART's and T5's sequence classifiers); a row without the
            end token pools its last position.
    """
    if last:  # the first occurrence in the ids read backwards
        found = ids.flip(-1) == (ids.amax(dim=-1, keepdim=True) if eos_id is None else eos_id)  # (B, N)
        where = ids.shape[-1] - 1 - found.int().argmax(dim=-1)  # (B,)
    else:
        where = ids.argmax(dim=-1) if eos_id is None else (ids == eos_id).int().argmax(dim=-1)  # (B,)
    return x[torch.arange(x.shape[0], device=x.device), where]  # (B, D)


def shift_right(ids: Tensor, start: int | None, pad: int | None = None) -> Tensor:
    """Token ids one position to the right behind a start id (HF's ``shift_tokens_right``: a decoder's input
    made of its encoder's), (B, N) -> (B, N).

    Args:
        ids: (B, N) token ids.
        start: the id in front; None: each row's last token that is not ``pad`` (mBART's language id, at
            ``(ids != pad).sum() - 1`` as HF finds it).
        pad: the padding id, read where ``start`` is None (None: no token is padding).
    """
    if start is None:
        real = ids.ne(pad) if pad is not None else torch.ones_like(ids, dtype=torch.bool)  # (B, N)
        index = real.sum(dim=-1, keepdim=True) - 1  # (B, 1)
        first = ids.gather(1, index)  # (B, 1)
    else:
        first = ids.new_full((ids.shape[0], 1), start)  # (B, 1)
    # cut after joining: a part of length N - 1 would make torch.export guard N != 2
    return torch.cat((first, ids), dim=1)[:, :-1]  # (B, N)


def last_pool(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """The last token that is not padding (a causal decoder's summary of the sequence): (B, N, D) -> (B, D).

    Args:
        x: (B, N, D) tokens.
        mask: (B, N) bool, True = padding (left or right); None: the last token.
    """
    if mask is None:
        return x[:, -1]  # (B, D)
    order = torch.arange(x.shape[1], device=x.device)  # (N,)
    where = (order * ~mask).argmax(
        dim=-1
    )  # (B,) the rightmost real token, as HF's *ForSequenceClassification
    return x[torch.arange(x.shape[0], device=x.device), where]  # (B, D)


def cls_mean_pool(x: Tensor, prefix: int, mask: Tensor | None = None) -> Tensor:
    """The class token beside the mean of the tokens after the prefix (DINOv2's linear probe): (B, N, D) ->
    (B, 2D).

    Args:
        x: (B, N, D) tokens, the first of them the class token, the first ``prefix`` class or register tokens.
        prefix: how many leading tokens the mean leaves out.
        mask: (B, N) bool, True = padding.
    """
    return torch.cat((x[:, 0], mean_pool(x, prefix, mask)), dim=-1)  # (B, 2D)


def mean_pool(x: Tensor, prefix: int, mask: Tensor | None = None) -> Tensor:
    """The mean of the tokens after the prefix, skipping padding: (B, N, D) -> (B, D).

    Args:
        x: (B, N, D) tokens, the first ``prefix`` of them class or register tokens.
        prefix: how many leading tokens to leave out (timm's ``global_pool='avg'``).
        mask: (B, N) bool, True = padding; a sample that is all padding pools to zeros.
    """
    tokens = x[:, prefix:]  # (B, N - P, D)
    if mask is None:
        return tokens.mean(dim=1)  # (B, D)
    keep = (~mask[:, prefix:]).to(x.dtype)[:, :, None]  # (B, N - P, 1)
    return (tokens * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)  # (B, D)


def merge_2x2(x: Tensor, grid: tuple[int, int]) -> Tensor:
    """Swin's patch merging gather: each 2x2 neighbourhood of a (gh, gw) grid concatenated.

    The order is the paper's: (0, 0), (1, 0), (0, 1), (1, 1) as (row, col) offsets.

    Args:
        x: (B, gh * gw, C) tokens, row-major.
        grid: (gh, gw), both even.

    Returns:
        (B, gh * gw / 4, 4C).
    """
    b, _, c = x.shape
    gh, gw = grid
    x = x.view(b, gh // 2, 2, gw // 2, 2, c)  # (B, gh/2, 2, gw/2, 2, C)
    return x.permute(0, 1, 3, 4, 2, 5).reshape(b, gh * gw // 4, 4 * c)  # (B, N/4, 4C)


def to_tokens(x: Tensor) -> Tensor:
    """A (B, C, *size) map as (B, positions, C) tokens, row-major."""
    return x.flatten(2).transpose(1, 2)  # (B, N, C)


def to_map(x: Tensor, grid: tuple[int, int]) -> Tensor:
    """(B, gh * gw, C) row-major tokens as a (B, C, gh, gw) map."""
    return x.transpose(1, 2).reshape(x.shape[0], -1, *grid)  # (B, C, gh, gw)


def map_mean(x: Tensor) -> Tensor:
    """The mean of a (B, C, *size) map over its positions: (B, C)."""
    return x.flatten(2).mean(-1)


def sdpa_layout(out: Tensor) -> Tensor:
    """SDPA's output (B, H, N, hd), laid out in memory as (B, N, H, hd) while exporting, as its fused CPU
    kernels lay it out in eager runs.

    ONNX export (torch 2.13) swaps an SDPA with a float mask for the math kernel, whose output is laid out
    (B, H, N, hd): the caller's transpose and reshape, traced as a view on the fused kernel's layout, would
    then be invalid. Eager runs never copy.
    """
    if torch.compiler.is_exporting():
        return out.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)
    return out
