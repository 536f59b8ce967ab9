"""Global tokens beside a sliding window (Longformer, Beltagy et al. 2020): the parts the attention core
(:mod:`specvit.nn.attention`) takes for them.

A few tokens are global: every token attends to them beside the keys of its own window, and they attend to
every token. Which ones is data: ``"mask"``, a per-sample ``global_mask`` input, (B, N) bool with True =
global (Longformer's ``global_attention_mask``); or an int K, the first K tokens of every sample (a class
token). Padding stays hidden from every row.

With projections of their own (Longformer's ``query_global``, ``key_global`` and ``value_global``: the core's
packed ``qkv_global``), the global tokens' rows are computed again, their own queries against every token's
own keys and values, and replace those rows of the windowed pass; the other rows see the global tokens
through the layer's keys and values. Without, the global rows are rows of the one pass that see every key.
Either way the masks stay boolean, so SDPA runs unless a part of the core needs the scores.

Dim legend: B batch, N tokens, T keys (N: global tokens take no KV cache), H heads.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from specvit.nn.attend import Parts, normed_rotated, project_positioned, split_heads

__all__ = ["GlobalTokens", "global_attention", "global_keys", "global_parts", "global_rows"]

GlobalTokens = Literal["mask"] | int
"""Which tokens are global: those the ``global_mask`` input marks (``"mask"``), or the first K."""


def global_parts(parts: Parts) -> Parts:
    """The parts of the packed global projection ``qkv_global``: the layer's own q, k, v parts (widths and
    biases), named ``q_global``, ``k_global``, ``v_global`` (separate biases: ``q_global_bias`` ...)."""
    return tuple((f"{name}_global", rows, bias) for name, rows, bias in parts)


def global_rows(tokens: GlobalTokens, global_mask: Tensor | None, n: int, device: torch.device) -> Tensor:
    """(B or 1, N) bool, True = a global token: none when the tokens come from a mask and none is given.

    Args:
        tokens: ``"mask"`` (the ``global_mask`` input's) or K (the first K tokens).
        global_mask: (B, N), nonzero = global, or None.
        n: the number of tokens N.
        device: where the static rows are made.
    """
    if tokens == "mask":  # without a mask the global pass still runs (as its FLOPs are counted), for no row
        return (
            torch.zeros(1, n, dtype=torch.bool, device=device) if global_mask is None else global_mask.bool()
        )
    return (torch.arange(n, device=device) < tokens)[None]  # (1, N)


def global_keys(visible: Tensor | None, rows: Tensor, mask: Tensor | None, shared: bool) -> Tensor | None:
    """Which keys each query sees with global tokens: those ``visible`` already showed it (its window) and
    every global token; with ``shared`` projections a global token's own row sees every key too. Padding
    keys stay hidden.

    Args:
        visible: broadcastable to (B, 1, N, T), True = may attend; None = every key.
        rows: (B or 1, N) bool, the global tokens.
        mask: (B, T) bool, True = padding, or None.
        shared: the global rows are rows of this pass (no projections of their own).
    """
    if visible is None:
        return None
    seen = rows[:, None, None, :]  # (B or 1, 1, 1, T): the global keys
    if shared:
        seen = seen | rows[:, None, :, None]  # (B or 1, 1, N, T): and the global queries' every key
    if mask is not None:
        seen = seen & ~mask[:, None, None, :]  # (B, 1, N or 1, T)
    return visible | seen


def global_attention(
    core: Any,
    x: Tensor,
    out: Tensor,
    rows: Tensor,
    mask: Tensor | None,
    pos: Tensor | None,
    rope: tuple[Tensor, Tensor] | None,
    bias: Tensor | None,
) -> Tensor:
    """The attention core's heads ``out`` (B, H, N, hd) with the global tokens' rows computed again: their
    own queries against every token's own keys and values (Longformer's query_global, key_global and
    value_global: the core's ``qkv_global``), padding hidden, through the core's QK-norms, rotary tables
    and attention (SDPA, or its math path).

    Args:
        core: the :class:`~specvit.nn.attention.Attention` layer.
        x: (B, N, D) its tokens.
        out: (B, H, N, hd) the heads of its windowed pass.
        rows: (B or 1, N) bool, the global tokens.
        mask: (B, N) bool, True = padding, or None.
        pos: (B or 1, N, D) positions added to the queries' and keys' input (DETR), or None.
        rope: ``(cos, sin)`` rotary tables of the N tokens, or None.
        bias: additive bias broadcastable to (B, H, N, N), or None.
    """
    h, hkv, hd = core.num_heads, core.num_kv_heads, core.head_dim
    parts = global_parts(core.parts)
    qkv = project_positioned(core, x, pos, core.qkv_global, parts, (h + hkv) * hd)  # (B, N, (H + 2Hkv) * hd)
    q, k, v = split_heads(qkv, hd).split((h, hkv, hkv), dim=-3)  # (B, H or Hkv, N, hd)
    late = core.qk_norm_after_rope
    q, k = normed_rotated(q, core.q_norm, rope, late), normed_rotated(k, core.k_norm, rope, late)
    visible = None if mask is None else ~mask[:, None, None, :]  # (B, 1, 1, N): every key but padding
    own = core._attend(q, k, v, visible, False, bias)  # (B, H, N, hd)
    return torch.where(rows[:, None, :, None], own, out)  # (B, H, N, hd)
