"""The functional side of the attention core (:mod:`specvit.nn.attention`): projections with a bias per
part, the output parts, the masks of keys a query may see, and attention itself, through SDPA or, when a
part needs the scores, the math path.

Dim legend: B batch, N query tokens, T keys, H heads, Hkv kv heads, hd head dim (vd of the values),
G windows per sample.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn.cache import KVCache
from specvit.nn.functional import sdpa_layout
from specvit.nn.layers import Dropout
from specvit.nn.linear import Linear, onednn_linear
from specvit.nn.norm import make_norm
from specvit.nn.partition import padded_grid
from specvit.nn.position import apply_rope
from specvit.nn.qkv import one_node, packed_heads
from specvit.nn.scores import mix_heads, tanh_cap

__all__ = [
    "Parts",
    "QkNorm",
    "QkNormScope",
    "QkvBias",
    "attend",
    "attend_math",
    "check_parts",
    "dropout",
    "head_norm",
    "normed_rotated",
    "open_empty_rows",
    "output_parts",
    "packed_projection",
    "project",
    "project_positioned",
    "resolve_heads",
    "split_heads",
    "split_parts",
    "three_biases",
    "visible_keys",
    "visible_mask",
]

QkNorm = Literal["layernorm", "rmsnorm"]
QkNormScope = Literal["head", "all"]


def head_norm(
    kind: QkNorm | None,
    heads: int,
    head_dim: int,
    eps: float,
    scope: QkNormScope,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    **settings: bool,
) -> nn.Module:
    """The QK-norm of ``heads`` (B, H, N, hd) heads: per head over hd (scope ``head``), or over all H * hd
    channels of a token at once (``all``, OLMo 2); Identity without one.

    Args:
        kind: ``layernorm``, ``rmsnorm`` or None.
        heads: H, the heads normalised together under scope ``all``.
        head_dim: hd.
        eps: added to the variance.
        scope: ``head`` or ``all``.
        device: parameter device.
        dtype: parameter dtype.
        settings: ``bias``, ``affine``, ``unit_offset`` of :func:`specvit.nn.norm.make_norm`.
    """
    if kind is None:
        return nn.Identity()
    if scope == "all":
        return make_norm(kind, heads * head_dim, eps, heads=heads, device=device, dtype=dtype, **settings)
    return make_norm(kind, head_dim, eps, device=device, dtype=dtype, **settings)


def normed_rotated(t: Tensor, norm: nn.Module, rope: tuple[Tensor, Tensor] | None, late: bool) -> Tensor:
    """Queries or keys (B, [G,] H, N, hd) through their QK-norm and RoPE: the norm first (Qwen3, OLMo 2), or
    with ``late`` the norm of the rotated heads (HunYuan).

    Args:
        t: the heads.
        norm: their QK-norm (Identity without one).
        rope: ``(cos, sin)`` tables of their positions, or None.
        late: the norm after RoPE.
    """
    if not late:
        t = norm(t)
    if rope is not None:
        t = apply_rope(t, *rope)
    return norm(t) if late else t


QkvBias = bool | tuple[bool, ...]


Parts = tuple[tuple[str, int, bool], ...]  # (name, rows, has a bias) of each part of a packed projection


def packed_projection(
    owner: nn.Module, dim: int, parts: Parts, device: torch.device | str | None, dtype: torch.dtype | None
) -> nn.Linear:
    """A Linear packing ``parts``. When only some parts have a bias (BEiT: q and v, no k), the Linear has
    none and ``owner`` gets a parameter ``{name}_bias`` per part that has one (timm's names)."""
    has = {h for _, _, h in parts}
    linear = Linear(dim, sum(w for _, w, _ in parts), bias=has == {True}, device=device, dtype=dtype)
    if len(has) == 2:
        for name, width, h in parts:
            if h:
                owner.register_parameter(
                    f"{name}_bias", nn.Parameter(torch.zeros(width, device=device, dtype=dtype))
                )
    return linear


def project(
    owner: nn.Module, x: Tensor, linear: nn.Linear, parts: Parts, rows: slice = slice(None)
) -> Tensor:
    """``linear(x)`` restricted to output ``rows``, with the parts' own biases when they have them."""
    separate = linear.bias is None and any(h for _, _, h in parts)
    if not separate and rows == slice(None):
        return linear(x)
    bias: Tensor | None = linear.bias
    if separate:
        pieces = [
            getattr(owner, f"{name}_bias") if h else linear.weight.new_zeros(width)
            for name, width, h in parts
        ]
        bias = torch.cat(pieces)  # ((H + 2Hkv) * hd,) or (2Hkv * hd,)
    return onednn_linear(x, linear.weight[rows], bias[rows] if bias is not None else None)


def project_positioned(
    owner: nn.Module, x: Tensor, pos: Tensor | None, linear: nn.Linear, parts: Parts, rows: int
) -> Tensor:
    """``project(owner, x, linear, parts)`` where the first ``rows`` outputs (queries and keys) read
    ``x + pos`` and the rest (values) read ``x`` (DETR's positions); the cost of the fused projection."""
    if pos is None:
        return project(owner, x, linear, parts)
    positioned = project(owner, x + pos, linear, parts, slice(None, rows))
    return torch.cat((positioned, project(owner, x, linear, parts, slice(rows, None))), dim=-1)


def output_parts(
    owner: nn.Module,
    inner: int,
    dim: int,
    parts: tuple[bool, bool, bool],
    drop: float,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> None:
    """Give ``owner`` its output parts: ``proj``, the heads' ``inner`` -> ``dim`` linear (Identity without
    one: the heads are ``dim`` wide already, SAGAN), ``proj_drop``, and with a gate the learned scalar
    ``gamma`` (init 0, so the layer starts at zero) that scales the output (SAGAN's).

    Args:
        owner: the attention module.
        inner: the width of the heads' outputs together, H * vd.
        dim: the layer's width D.
        parts: (an output projection, its bias, an output gate).
        drop: dropout after the projection.
        device: parameter device.
        dtype: parameter dtype.
    """
    proj, bias, gate = parts
    if not proj and inner != dim:
        raise ValueError(f"without an output projection the heads' outputs must be {dim} wide, got {inner}")
    linear = Linear(inner, dim, bias=bias, device=device, dtype=dtype) if proj else nn.Identity()
    owner.add_module("proj", linear)
    owner.add_module("proj_drop", dropout(drop))
    if gate:
        owner.register_parameter("gamma", nn.Parameter(torch.zeros(1, device=device, dtype=dtype)))


def three_biases(qkv_bias: QkvBias) -> tuple[bool, bool, bool]:
    if isinstance(qkv_bias, bool):
        return (qkv_bias, qkv_bias, qkv_bias)
    q, k, v = qkv_bias
    return (q, k, v)


def visible_keys(n: int, t: int, past: int, causal: bool, window: int | None, device: torch.device) -> Tensor:
    """(N, T) bool: query i, ``past`` positions after key 0 (at position past + i if key 0 is at 0), may see
    key j; causal: j <= past + i; a window keeps the keys less than ``window`` positions away."""
    visible = torch.ones(n, t, dtype=torch.bool, device=device)
    if causal:
        visible = visible.tril(diagonal=past)
    if window is not None:
        visible = visible.triu(diagonal=past - window + 1)
        if not causal:
            visible = visible.tril(diagonal=past + window - 1)
    return visible  # (N, T)


def dropout(p: float) -> nn.Module:
    return Dropout(p) if p > 0.0 else nn.Identity()


def resolve_heads(
    dim: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None
) -> tuple[int, int]:
    """Return (Hkv, hd) after validating the head configuration."""
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if kv_heads < 1 or num_heads % kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv_heads})")
    if head_dim is None:
        if dim % num_heads != 0:
            raise ValueError(
                f"dim ({dim}) must be divisible by num_heads ({num_heads}) when head_dim is unset"
            )
        head_dim = dim // num_heads
    return kv_heads, head_dim


def open_empty_rows(visible: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """``(has_key, allowed)``: which query rows of ``visible`` (broadcastable to (B, 1, N, T)) see any key,
    and ``visible`` with the rows that see none opened to every key (their outputs are zeroed after), so
    that no softmax row is all -inf. ``(None, None)`` when everything is visible."""
    if visible is None:
        return None, None
    has_key = visible.any(dim=-1, keepdim=True)  # (B, 1, N, 1)
    return has_key, visible | ~has_key


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    bias: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """SDPA where query rows without any visible key output zeros instead of NaN.

    Args:
        q: (B, H, N, hd) queries.
        k: (B, Hkv, T, hd) keys.
        v: (B, Hkv, T, vd) values (vd may differ from hd).
        visible: boolean mask broadcastable to (B, 1, N, T), True = may attend; None = all visible.
        is_causal: let SDPA apply its own causal mask (only when ``visible`` and ``bias`` are None and N == T).
        dropout_p: attention-probability dropout.
        bias: additive attention bias broadcastable to (B, H, N, T) (ALiBi, relative positions), or None.
        scale: the factor of q·k; None = 1/sqrt(hd).
    """
    has_key, mask = open_empty_rows(visible)  # rows with nothing visible attend everywhere; zeroed below
    if bias is not None:
        bias = bias.to(q.dtype)
        mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))  # (B or 1, H, N, T)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # (B, H, N, vd)
    if has_key is not None:
        out = out.masked_fill(~has_key, 0.0)
    if mask is not None:  # a masked SDPA's layout while exporting: see sdpa_layout
        out = sdpa_layout(out)
    return out


def attend_math(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    bias: Tensor | None,
    scale: float | None,
    cap: float | None,
    mix: tuple[nn.Linear, nn.Linear] | None,
    gate: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """What :func:`attend` computes, with the parts that need the scores themselves: talking heads mix the
    logits and the weights across heads, soft-capping squashes the logits before the masks, a gate mixes
    the weights with positional ones.

    Args:
        q: (B, G*H, N, hd) queries.
        k: (B, G*Hkv, T, hd) keys.
        v: (B, G*Hkv, T, vd) values.
        visible: boolean mask broadcastable to (B, 1, N, T), True = may attend; None = all visible.
        is_causal: query i sees keys j <= i (N == T).
        dropout_p: attention-probability dropout.
        bias: additive attention bias broadcastable to (B, G*H, N, T), or None.
        scale: the factor of q·k; None = 1/sqrt(hd).
        cap: soft-capping of the logits, ``cap * tanh(logits / cap)``, or None.
        mix: the (before, after the softmax) H -> H maps of talking heads, or None.
        gate: ConViT's (positional weights broadcastable to (B, H, N, T), per-head gates g (H, 1, 1) in
            [0, 1]): the weights become ``(1 - g) * weights + g * positional``, renormalised; or None.
    """
    b, h, n, hd = q.shape
    groups = h // k.shape[1]  # GQA: query head i reads kv head i // groups, as SDPA's enable_gqa
    if groups > 1 and (mix is not None or bias is not None or gate is not None):  # per-head scores
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))  # (B, G*H, T, hd)
        groups = 1
    has_key: Tensor | None = None
    if is_causal:  # every row sees itself: no row to open
        hidden: Tensor | None = torch.ones(n, k.shape[2], dtype=torch.bool, device=q.device).triu(1)  # (N, T)
    else:
        has_key, allowed = open_empty_rows(visible)  # rows that see no key attend everywhere; zeroed below
        hidden = None if allowed is None else ~allowed
    if groups > 1:  # the query heads of one kv head stacked: (B, Hkv, groups*N, hd), k and v read once
        q = q.reshape(b, h // groups, groups * n, hd)
        if hidden is not None and hidden.shape[-2] > 1:  # row g*N + i is query i of the group's head g
            hidden = hidden.repeat(*[1] * (hidden.ndim - 2), groups, 1)  # (..., groups*N, T)
    scale = hd**-0.5 if scale is None else scale
    fold = cap is not None and bias is None and mix is None  # logits / cap folded into the queries' scale
    logits = (q * (scale / cap if fold and cap else scale)) @ k.transpose(-2, -1)  # (B, G*H or Hkv, N, T)
    heads = mix[0].in_features if mix is not None else 0
    if mix is not None:
        logits = mix_heads(logits, mix[0], heads)
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    if cap is not None and fold and not logits.requires_grad:  # in place: two (B, H, N, T) tensors fewer
        logits = logits.tanh_().mul_(cap)
    elif cap is not None:
        logits = torch.tanh(logits) * cap if fold else tanh_cap(logits, cap)
    if hidden is not None:
        logits = logits.masked_fill_(hidden, float("-inf"))  # logits is this function's own tensor
    weights = logits.softmax(dim=-1)  # (B, G*H, N, T)
    if mix is not None:
        weights = mix_heads(weights, mix[1], heads)
    if gate is not None:
        positional, g = gate
        weights = (1.0 - g) * weights + g * positional
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    out = (weights @ v).reshape(b, h, n, v.shape[-1])  # (B, G*H, N, vd)
    return out if has_key is None else out.masked_fill(~has_key, 0.0)


def split_heads(t: Tensor, head_dim: int) -> Tensor:
    """(..., L, heads * hd) projections -> (..., heads, L, hd)."""
    return t.unflatten(-1, (-1, head_dim)).transpose(-3, -2)


def split_parts(t: Tensor, parts: tuple[tuple[int, int], ...]) -> list[Tensor]:
    """(..., L, sum of heads * width) packed projections -> one (..., heads, L, width) tensor per (heads,
    width) of ``parts`` (keys and values of their own widths)."""
    if len({width for _, width in parts}) == 1:  # the same views, from one view of all heads: 3 ops, not 7
        heads, sizes = split_heads(t, parts[0][1]), tuple(n for n, _ in parts)  # (..., all heads, L, width)
        return list(packed_heads(heads, sizes) if one_node(heads, None) else heads.split(sizes, dim=-3))
    pieces = t.split([heads * width for heads, width in parts], dim=-1)  # (..., L, heads * width) each
    return [split_heads(piece, width) for piece, (_, width) in zip(pieces, parts, strict=True)]


def split_rotated(
    t: Tensor, heads: tuple[int, int], head_dim: int, rope: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`split_parts` of a packed projection of queries, keys and values all ``head_dim`` wide, the
    queries and keys rotated by RoPE in one call: (..., H, L, hd), (..., Hkv, L, hd), (..., Hkv, L, hd).

    The values of rotating each (RoPE is elementwise) in half the ops: a decode step's layers are short of
    arithmetic, and each op costs microseconds however small.

    Args:
        t: (..., L, (H + 2 Hkv) * hd) the projection.
        heads: (H, Hkv).
        head_dim: hd.
        rope: ``(cos, sin)`` tables of the L positions.
    """
    h, hkv = heads
    all_heads = split_heads(t, head_dim)  # (..., H + 2Hkv, L, hd)
    if one_node(all_heads, rope):  # one node, and its backward writes t's gradient once
        q, k, v = packed_heads(all_heads, (h, hkv, hkv), rope, rotated=2)
        return q, k, v
    qk, v = all_heads.split((h + hkv, hkv), dim=-3)  # (..., H + Hkv, L, hd), (..., Hkv, L, hd)
    q, k = apply_rope(qk, *rope).split((h, hkv), dim=-3)
    return q, k, v


def visible_mask(
    causal: bool,
    window: int | None,
    sizes: tuple[int, int, int, int, int],
    masks: tuple[Tensor | None, Tensor | None],
    cache: KVCache | None,
    unbiased: bool,
    device: torch.device,
) -> tuple[Tensor | None, bool]:
    """Which of the T keys each of the N queries (at positions past .. past + N - 1; key 0 at ``first``)
    sees, broadcastable to (B, 1, N, T) with True = may attend, or None for all; or SDPA's own causal mask
    (True) where nothing else hides a key (``unbiased``: no additive bias either).

    Args:
        causal: the layer is causal.
        window: its sliding window, or None.
        sizes: (B, N, T, past, first).
        masks: the padding of the keys, (B, past + N) bool with True = padding, and of a memory, (B, T);
            each or None.
        cache: the KV cache, whose ``window`` bounds every causal layer.
        unbiased: no additive bias: SDPA may apply its own causal mask.
        device: where the mask is made.
    """
    (b, n, t, past, first), (mask, memory_mask) = sizes, masks
    visible: Tensor | None = None
    is_causal = False
    if cache is not None and causal and cache.window is not None:
        window = cache.window if window is None else min(window, cache.window)
        visible = visible_keys(n, t, past - first, True, window, device)  # (N, T)
    elif causal and past == 0 and mask is None and unbiased and window is None:
        is_causal = True
    elif window is not None or (causal and n > 1):  # causal, one new token: it sees every key
        visible = visible_keys(n, t, past - first, causal, window, device)  # (N, T)
    if mask is not None:
        if mask.shape != (b, past + n):
            raise ValueError(f"mask must have shape (B, T)=({b}, {past + n}), got {tuple(mask.shape)}")
        keep = ~mask[:, None, None, past + n - t :]  # (B, 1, 1, T)
        visible = keep if visible is None else visible & keep  # (B, 1, N, T)
    if memory_mask is not None:
        if memory_mask.shape != (b, t):
            raise ValueError(f"memory_mask must have shape (B, M)=({b}, {t}), got {tuple(memory_mask.shape)}")
        visible = ~memory_mask[:, None, None, :]  # (B, 1, 1, M)
    return visible, is_causal


def check_parts(
    memory_dim: int | None,
    projection: str,
    relative: str | None,
    grid: tuple[int, int] | None,
    grid_window: int | None,
    shift: int,
    queries: int | None,
    causal: bool,
    gated: bool = False,
    disentangled: bool = False,
    gqa: bool = False,
    global_tokens: str | int | None = None,
    global_projection: bool = False,
    reduction: int | None = None,
) -> None:
    """Refuse the combinations of parts the core does not compute (``gqa``: fewer key/value heads)."""
    problems = []
    if global_tokens is not None and (memory_dim is not None or queries is not None or grid_window or causal):
        problems.append("global tokens are in a self-attention of every token, not causal, without windows")
    if global_projection and (global_tokens is None or projection != "packed" or gated or disentangled):
        problems.append(
            "global projections mirror the packed qkv of global tokens, without gated or disentangled"
        )
    if isinstance(global_tokens, int) and global_tokens < 1:
        problems.append(f"the first {global_tokens} tokens cannot be global: use K >= 1")
    others = (memory_dim, grid_window, queries, relative, causal, gated, disentangled, projection != "packed")
    if reduction is not None and (grid is None or any(others) or global_tokens is not None):
        problems.append("a spatial reduction is packed self-attention of every token of the whole grid")
    if disentangled and (
        memory_dim is not None or grid_window is not None or queries is not None or causal or gqa
    ):
        problems.append("disentangled attention is MHA self-attention of every token, not causal")
    if gated and (grid is None or grid_window is not None or memory_dim is not None or queries is not None):
        problems.append("gated positions are over the whole token grid, every token querying itself")
    if memory_dim is not None and (projection != "packed" or grid_window is not None or queries is not None):
        problems.append("keys and values from a memory take the packed projection, no windows, all queries")
    conv = projection not in ("packed", "split")  # 1x1 convs over a (B, D, H, W) map
    if conv and (grid_window is not None or queries is not None or disentangled):
        problems.append(
            "1x1-conv projections read a whole map: no windows, query subset or disentangled scores"
        )
    if queries is not None and causal:
        problems.append("a subset of queries is never causal")
    if relative is not None and grid is None:
        problems.append(f"a {relative} relative bias needs the token grid")
    if relative in ("table", "cpb") and grid_window is None:
        problems.append(f"a {relative} relative bias is over windows: set grid_window")
    if grid_window is not None and grid is None:
        problems.append("windows need the token grid")
    if shift and (grid is None or grid_window is None or padded_grid(grid, grid_window) != grid):
        problems.append("shifted windows need a grid divisible by the window")
    if problems:
        raise ValueError("; ".join(problems))
