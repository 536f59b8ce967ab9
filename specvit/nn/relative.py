"""Relative positions: T5's bucketed bias (Raffel et al., 2020), one learned scalar per head and distance
bucket; BEiT's table over the patch grid; DeBERTa's table of relative embeddings (He et al., 2021) and the
log-bucketed index into it, which the attention core's disentangled part reads.

Dim legend: N new tokens (queries), T keys (cached + new), H heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from specvit.nn.attend import project, split_heads
from specvit.nn.scores import disentangled_bias

__all__ = ["RelativeBias", "RelativeEmbedding", "disentangled_scores", "log_bucket_index", "relative_buckets"]


def relative_buckets(relative: Tensor, bidirectional: bool, buckets: int, max_distance: int) -> Tensor:
    """The bucket of each key - query distance, as T5's ``_relative_position_bucket``.

    Half the buckets (of each direction, when bidirectional) hold the exact distances 0 .. b/2 - 1; the
    rest grow logarithmically up to ``max_distance``, beyond which every distance shares the last bucket.
    A causal (not bidirectional) bias only tells apart keys before the query.

    Args:
        relative: integer ``key - query`` distances, any shape.
        bidirectional: keys after the query get buckets of their own.
        buckets: the number of buckets.
        max_distance: the distance from which all share the last bucket.
    """
    out = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        out = out + (relative > 0).to(relative.dtype) * buckets
        distance = relative.abs()
    else:
        distance = -torch.clamp(relative, max=0)
    exact = buckets // 2
    log = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = exact + (log * (buckets - exact)).to(relative.dtype)
    large = torch.clamp(large, max=buckets - 1)
    return out + torch.where(distance < exact, distance, large)


class RelativeBias(nn.Module):
    """The attention bias of every head for the new tokens against all keys, from a (buckets, H) table.

    Args:
        heads: H.
        buckets: distance buckets (T5: 32).
        max_distance: distance of the last bucket (T5: 128).
        bidirectional: keys after a query have buckets of their own (an encoder's bias; not a decoder's).
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        heads: int,
        buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.buckets, self.max_distance, self.bidirectional = buckets, max_distance, bidirectional
        self.embedding = nn.Embedding(buckets, heads, device=device, dtype=dtype)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """The bias (1, H, N, T) for the N tokens of x: (B, N, D) at positions offset .. offset + N - 1."""
        n = x.shape[1]
        queries = torch.arange(offset, offset + n, device=x.device)[:, None]  # (N, 1)
        keys = torch.arange(offset + n, device=x.device)[None, :]  # (1, T)
        bucket = relative_buckets(
            keys - queries, self.bidirectional, self.buckets, self.max_distance
        )  # (N, T)
        return self.embedding(bucket).permute(2, 0, 1).unsqueeze(0)  # (N, T, H) -> (1, H, N, T)

    def extra_repr(self) -> str:
        return f"buckets={self.buckets}, max_distance={self.max_distance}, bidirectional={self.bidirectional}"


def grid_relative_index(grid: tuple[int, int]) -> Tensor:
    """BEiT's index into its bias table for a class token and a (gh, gw) patch grid: (1 + gh*gw, 1 + gh*gw).

    Patch pairs index their (row, column) offset, ``(dr + gh - 1) * (2gw - 1) + dc + gw - 1``; the last three
    entries of the table are class -> patch, patch -> class and class -> class.
    """
    gh, gw = grid
    distances = (2 * gh - 1) * (2 * gw - 1)
    rows = torch.arange(gh).repeat_interleave(gw)  # (gh*gw,)
    cols = torch.arange(gw).repeat(gh)  # (gh*gw,)
    dr = rows[:, None] - rows[None, :] + gh - 1  # (gh*gw, gh*gw)
    dc = cols[:, None] - cols[None, :] + gw - 1  # (gh*gw, gh*gw)
    index = torch.empty(gh * gw + 1, gh * gw + 1, dtype=torch.long)
    index[1:, 1:] = dr * (2 * gw - 1) + dc
    index[0, :] = distances  # class -> patch
    index[:, 0] = distances + 1  # patch -> class
    index[0, 0] = distances + 2  # class -> class
    return index


class GridRelativeBias(nn.Module):
    """BEiT's learned relative position bias over a patch grid with a class token: (1, H, N, N).

    Args:
        heads: H.
        grid: (gh, gw) patch grid; the tokens are the class token then the patches, row-major.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        heads: int,
        grid: tuple[int, int],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.grid = grid
        rows = (2 * grid[0] - 1) * (2 * grid[1] - 1) + 3
        self.relative_position_bias_table = nn.Parameter(torch.zeros(rows, heads, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        """The bias of the N = 1 + gh*gw tokens of x: (B, N, D)."""
        index = grid_relative_index(self.grid).to(x.device)  # (N, N)
        n = index.shape[0]
        bias = self.relative_position_bias_table[index.view(-1)].view(n, n, -1)  # (N, N, H)
        return bias.permute(2, 0, 1).unsqueeze(0)  # (1, H, N, N)

    def extra_repr(self) -> str:
        return f"grid={self.grid}"


def log_bucket_index(x: Tensor, buckets: int, max_distance: int) -> Tensor:
    """(N, N) long: the row of DeBERTa's relative table for query i and key j of the tokens x (B, N, D).

    The distance i - j is kept exactly up to ``buckets // 2``, log-bucketed beyond it up to ``max_distance``
    (HF's ``make_log_bucket_position``, in float32 whatever x's dtype, as there), then offset into the table's
    2 * ``buckets`` rows.

    Args:
        x: the tokens (only their count and device are read).
        buckets: distances in each direction; the table has 2 * buckets rows.
        max_distance: the distance the last bucket stands for.
    """
    ids = torch.arange(x.shape[1], device=x.device)
    relative = ids[:, None] - ids[None, :]  # (N, N) query - key
    mid = buckets // 2
    near = (relative < mid) & (relative > -mid)
    far = torch.where(near, torch.full_like(relative, mid - 1), relative.abs()).float()  # (N, N)
    span = torch.log(torch.tensor((max_distance - 1) / mid, device=x.device))
    log = torch.ceil(torch.log(far / mid) / span * (mid - 1)) + mid
    bucket = torch.where(far <= mid, relative.float(), log * torch.sign(relative)).long()
    return torch.clamp(bucket + buckets, 0, 2 * buckets - 1)  # (N, N)


class RelativeEmbedding(nn.Module):
    """DeBERTa's table of relative embeddings, one row per bucketed distance, optionally layer-normed; every
    attention layer of the stack projects it with its own query and key weights.

    Args:
        rows: table rows (2 * buckets).
        dim: their width D (the stack's).
        norm: a LayerNorm over each row (``norm_rel_ebd: layer_norm``).
        eps: its epsilon.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        rows: int,
        dim: int,
        norm: bool = True,
        eps: float = 1e-7,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, device=device, dtype=dtype))  # (2P, D)
        self.norm = nn.LayerNorm(dim, eps=eps, device=device, dtype=dtype) if norm else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """The (2P, D) table, for the tokens x (read for nothing but ordering)."""
        return self.norm(self.weight)


def disentangled_scores(
    core: Any, q: Tensor, k: Tensor, rel_embed: Tensor | None, rel_index: Tensor | None
) -> Tensor:
    """DeBERTa's content-to-position and position-to-content scores (B, H, N, N), scaled: the relative table
    through the attention core's own query and key projections.

    Args:
        core: the :class:`~specvit.nn.attention.Attention` layer (``disentangled``).
        q: (B, H, N, hd) its queries.
        k: (B, H, N, hd) its keys.
        rel_embed: (2P, D) the stack's relative table.
        rel_index: (N, N) long, its row for each query and key.
    """
    assert rel_embed is not None and rel_index is not None  # the graph wires both with the part
    h, hd = core.num_heads, core.head_dim
    if core.projection == "split":
        pos_q, pos_k = core.q(rel_embed), core.k(rel_embed)  # (2P, H * hd) each
    else:
        pos_q, pos_k = project(core, rel_embed, core.qkv, core.parts, slice(0, 2 * h * hd)).chunk(2, -1)
    pos_q, pos_k = split_heads(pos_q, hd), split_heads(pos_k, hd)  # (H, 2P, hd)
    assert core.scale is not None  # set with the part
    return disentangled_bias(q, k, pos_q, pos_k, rel_index) * core.scale
