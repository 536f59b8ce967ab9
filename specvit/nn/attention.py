"""Multi-head self- and cross-attention on top of ``F.scaled_dot_product_attention``, with GQA/MQA,
optional QK-norm, RoPE and KV caches.

Masks: ``key_padding_mask`` / ``memory_padding_mask`` are boolean with True = padding (ignored key), the
torch ``nn.MultiheadAttention`` convention. A query row that ends up with no visible key (e.g. every key of
that sample is padding) outputs zeros from the attention (so the module returns ``proj(0) = proj.bias``)
instead of NaN, independently of the SDPA backend; its gradients are finite too.

GQA/MQA uses SDPA's ``enable_gqa=True``: no repeated k/v copies in the fused kernels, bitwise equal to
repeating k/v heads, and counted like plain MHA by ``FlopCounterMode`` under the MATH backend.

Caches: one :class:`KVCache` per model; each attention layer reads and writes its own entry by its
``layer_idx``, as HF's ``Cache`` objects do.

Every forward takes the tokens positionally and everything else by keyword (``mask``, ``rope``, ``bias``,
``pos``, ``cache``; cross-attention also ``memory`` and its ``memory_mask``, ``memory_pos``, ``memory_rope``).

Dim legend: B batch, N tokens, D width, H heads, Hkv kv heads, hd head dim, M memory tokens.
T is the number of keys a self-attention query sees (N, or cached + N with a KV cache); Dm memory width.
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
from specvit.nn.position import apply_rope

QkNorm = Literal["layernorm", "rmsnorm"]


def _head_norm(
    kind: QkNorm | None,
    head_dim: int,
    eps: float,
    bias: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> nn.Module:
    if kind is None:
        return nn.Identity()
    if kind == "layernorm":
        return nn.LayerNorm(head_dim, eps=eps, bias=bias, device=device, dtype=dtype)
    if kind == "rmsnorm":
        return nn.RMSNorm(head_dim, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"qk_norm must be 'layernorm', 'rmsnorm' or None, got {kind!r}")


QkvBias = bool | tuple[bool, ...]


Parts = tuple[tuple[str, int, bool], ...]  # (name, rows, has a bias) of each part of a packed projection


def _packed(
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


def _project(
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


def _three(qkv_bias: QkvBias) -> tuple[bool, bool, bool]:
    if isinstance(qkv_bias, bool):
        return (qkv_bias, qkv_bias, qkv_bias)
    q, k, v = qkv_bias
    return (q, k, v)


def _visible(n: int, t: int, past: int, causal: bool, window: int | None, device: torch.device) -> Tensor:
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


def _dropout(p: float) -> nn.Module:
    return Dropout(p) if p > 0.0 else nn.Identity()


def _resolve_heads(
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


def _attend(
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
        v: (B, Hkv, T, hd) values.
        visible: boolean mask broadcastable to (B, 1, N, T), True = may attend; None = all visible.
        is_causal: let SDPA apply its own causal mask (only when ``visible`` and ``bias`` are None and N == T).
        dropout_p: attention-probability dropout.
        bias: additive attention bias broadcastable to (B, H, N, T) (ALiBi, relative positions), or None.
        scale: the factor of q·k; None = 1/sqrt(hd).
    """
    has_key = None
    mask: Tensor | None = visible
    if visible is not None:
        has_key = visible.any(dim=-1, keepdim=True)  # (B, 1, N, 1)
        mask = visible | ~has_key  # rows with nothing visible attend everywhere; zeroed below
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
    )  # (B, H, N, hd)
    if has_key is not None:
        out = out.masked_fill(~has_key, 0.0)
    if mask is not None:  # a masked SDPA's layout while exporting: see sdpa_layout
        out = sdpa_layout(out)
    return out


class SelfAttention(nn.Module):
    """Multi-head self-attention with GQA/MQA, optional QK-norm, RoPE, an additive bias, causal masking
    and a KV cache.

    Args:
        dim: token width D.
        num_heads: number of query heads H.
        num_kv_heads: number of key/value heads Hkv (divides H); None = H (plain MHA), 1 = MQA.
        head_dim: per-head width hd; None = D // H.
        qkv_bias: bias of the packed ``qkv`` projection: one for all, or (q, k, v); with some but not all,
            the module has ``q_bias`` / ``k_bias`` / ``v_bias`` parameters for those that have one.
        proj_bias: bias of the output projection.
        qk_norm: ``layernorm`` or ``rmsnorm`` over hd applied to queries and keys, or None.
        qk_norm_bias: the QK LayerNorms have a bias.
        norm_eps: epsilon of the QK norms.
        attn_drop: dropout on the attention probabilities (training only).
        proj_drop: dropout after the output projection.
        causal: query i only sees keys at positions <= its own.
        scale: factor of q·k; None = 1/sqrt(hd) (T5 uses 1).
        window: query i only sees keys less than ``window`` positions away (a sliding window), or None.
        layer_idx: this layer's entry in a :class:`KVCache`.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: QkvBias = True,
        proj_bias: bool = True,
        qk_norm: QkNorm | None = None,
        qk_norm_bias: bool = True,
        norm_eps: float = 1e-6,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        causal: bool = False,
        scale: float | None = None,
        window: int | None = None,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = _resolve_heads(dim, num_heads, num_kv_heads, head_dim)
        self.causal, self.scale, self.window = causal, scale, window
        self.layer_idx = layer_idx
        self.attn_drop = attn_drop
        hd, h, hkv = self.head_dim, num_heads, self.num_kv_heads
        bq, bk, bv = _three(qkv_bias)
        self.parts: Parts = (("q", h * hd, bq), ("k", hkv * hd, bk), ("v", hkv * hd, bv))
        self.qkv = _packed(self, dim, self.parts, device, dtype)
        self.q_norm = _head_norm(qk_norm, hd, norm_eps, qk_norm_bias, device, dtype)
        self.k_norm = _head_norm(qk_norm, hd, norm_eps, qk_norm_bias, device, dtype)
        self.proj = Linear(h * hd, dim, bias=proj_bias, device=device, dtype=dtype)
        self.proj_drop = _dropout(proj_drop)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        bias: Tensor | None = None,
        pos: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Attend x to itself (and to the cached tokens).

        Args:
            x: (B, N, D) tokens.
            mask: (B, T) bool, True = padding key; T counts the cached keys too when a cache is given
                (T = cached + N). Queries are not masked: a padded query still gets an output.
            rope: ``(cos, sin)`` tables for the N new tokens (absolute positions cached .. cached + N - 1),
                from :class:`~specvit.nn.position.Rope` or :class:`~specvit.nn.position.Rope2d`.
            bias: additive attention bias broadcastable to (B, H, N, T) (ALiBi, relative positions).
            pos: (B or 1, N, D) positions added to the input of the queries and keys only, not of the values
                (DETR); the projections cost what the fused one does.
            cache: the model's KV cache; this layer's new keys/values are appended to its entry. Masking is
                unchanged by the cache: a causal layer lets query i (absolute position cached + i) see keys
                j <= cached + i, a non-causal one lets the new tokens see every cached and new key.

        Returns:
            (B, N, D).
        """
        b, n, _ = x.shape
        h, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if pos is None:
            qkv = _project(self, x, self.qkv, self.parts)  # (B, N, (H + 2Hkv) * hd)
        else:
            rows = (h + hkv) * hd  # q and k rows of the packed weight read x + pos; v rows read x
            qk = _project(self, x + pos, self.qkv, self.parts, slice(None, rows))
            v_in = _project(self, x, self.qkv, self.parts, slice(rows, None))
            qkv = torch.cat((qk, v_in), dim=-1)  # (B, N, (H + 2Hkv) * hd)
        qkv = qkv.view(b, n, h + 2 * hkv, hd).transpose(1, 2)  # (B, H + 2Hkv, N, hd)
        q, k, v = qkv.split((h, hkv, hkv), dim=1)  # (B, H, N, hd), (B, Hkv, N, hd), (B, Hkv, N, hd)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        past, first = 0, 0  # query i sits at absolute position past + i, key j at first + j
        if cache is not None:
            past = cache.length(self.layer_idx)
            k, v = cache.append(self.layer_idx, k, v)  # (B, Hkv, T, hd)
            first = past + n - k.shape[2]
        t = k.shape[2]
        if bias is not None and bias.shape[-1] != t:
            bias = bias[..., -t:]  # the keys still held: (B or 1, H, N or 1, T)

        visible: Tensor | None = None  # broadcastable to (B, 1, N, T), True = may attend
        is_causal = False
        if cache is not None and self.causal and cache.window is not None:
            window = cache.window if self.window is None else min(self.window, cache.window)
            visible = _visible(n, t, past - first, True, window, x.device)  # (N, T)
        elif self.causal and past == 0 and mask is None and bias is None and self.window is None:
            is_causal = True
        elif self.window is not None or (self.causal and n > 1):  # causal, one new token: it sees every key
            visible = _visible(n, t, past - first, self.causal, self.window, x.device)  # (N, T)
        if mask is not None:
            if mask.shape != (b, past + n):
                raise ValueError(f"mask must have shape (B, T)=({b}, {past + n}), got {tuple(mask.shape)}")
            keep = ~mask[:, None, None, past + n - t :]  # (B, 1, 1, T)
            visible = keep if visible is None else visible & keep  # (B, 1, N, T)

        dropout_p = self.attn_drop if self.training else 0.0
        out = _attend(q, k, v, visible, is_causal, dropout_p, bias, self.scale)  # (B, H, N, hd)
        if cache is not None and self.causal:
            cache.bound(self.layer_idx, self.window)
        out = out.transpose(1, 2).reshape(b, n, h * hd)  # (B, N, H*hd)
        return self.proj_drop(self.proj(out))  # (B, N, D)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"causal={self.causal}, window={self.window}, attn_drop={self.attn_drop}"
        )


class CrossAttention(nn.Module):
    """Multi-head cross-attention from tokens to a memory, with GQA/MQA, optional QK-norm, RoPE and a KV cache.

    Args:
        dim: query token width D.
        num_heads: number of query heads H.
        memory_dim: memory width Dm; None = D.
        num_kv_heads: number of key/value heads Hkv (divides H); None = H.
        head_dim: per-head width hd; None = D // H.
        qkv_bias: biases of the ``q`` and ``kv`` projections: one for all, or (q, k, v).
        proj_bias: bias of the output projection.
        qk_norm: ``layernorm`` or ``rmsnorm`` over hd applied to queries and keys, or None.
        qk_norm_bias: the QK LayerNorms have a bias.
        norm_eps: epsilon of the QK norms.
        attn_drop: dropout on the attention probabilities (training only).
        proj_drop: dropout after the output projection.
        layer_idx: this layer's entry in a :class:`KVCache`.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        memory_dim: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: QkvBias = True,
        proj_bias: bool = True,
        qk_norm: QkNorm | None = None,
        qk_norm_bias: bool = True,
        norm_eps: float = 1e-6,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        scale: float | None = None,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = _resolve_heads(dim, num_heads, num_kv_heads, head_dim)
        self.layer_idx, self.scale = layer_idx, scale
        self.attn_drop = attn_drop
        hd, h, hkv = self.head_dim, num_heads, self.num_kv_heads
        bq, bk, bv = _three(qkv_bias)
        self.q = Linear(dim, h * hd, bias=bq, device=device, dtype=dtype)
        self.parts: Parts = (("k", hkv * hd, bk), ("v", hkv * hd, bv))
        self.kv = _packed(self, dim if memory_dim is None else memory_dim, self.parts, device, dtype)
        self.q_norm = _head_norm(qk_norm, hd, norm_eps, qk_norm_bias, device, dtype)
        self.k_norm = _head_norm(qk_norm, hd, norm_eps, qk_norm_bias, device, dtype)
        self.proj = Linear(h * hd, dim, bias=proj_bias, device=device, dtype=dtype)
        self.proj_drop = _dropout(proj_drop)

    def _memory_kv(
        self, memory: Tensor, memory_pos: Tensor | None, memory_rope: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor]:
        """The memory's (B, Hkv, M, hd) keys (QK-normed, rotated) and values."""
        b, m, _ = memory.shape
        hkv, hd = self.num_kv_heads, self.head_dim
        if memory_pos is None:
            kv_flat = _project(self, memory, self.kv, self.parts)  # (B, M, 2 * Hkv * hd)
        else:
            rows = hkv * hd  # k rows of the packed weight read memory + pos; v rows read memory
            k_in = _project(self, memory + memory_pos, self.kv, self.parts, slice(None, rows))
            v_in = _project(self, memory, self.kv, self.parts, slice(rows, None))
            kv_flat = torch.cat((k_in, v_in), dim=-1)  # (B, M, 2 * Hkv * hd)
        kv = kv_flat.view(b, m, 2, hkv, hd).permute(2, 0, 3, 1, 4)  # (2, B, Hkv, M, hd)
        k, v = self.k_norm(kv[0]), kv[1]  # (B, Hkv, M, hd)
        if memory_rope is not None:
            k = apply_rope(k, *memory_rope)
        return k, v

    def forward(
        self,
        x: Tensor,
        *,
        memory: Tensor,
        memory_mask: Tensor | None = None,
        pos: Tensor | None = None,
        memory_pos: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        memory_rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Attend x to the memory.

        Args:
            x: (B, N, D) query tokens.
            memory: (B, M, Dm) memory tokens; not read when ``cache`` already holds this layer's keys/values.
            memory_mask: (B, M) bool, True = padding memory token.
            pos: (B or 1, N, D) positions added to the queries' input (DETR's query embeddings).
            memory_pos: (B or 1, M, Dm) positions added to the keys' input, not the values' (DETR).
            rope: ``(cos, sin)`` tables of the N queries: RoPE rotates the queries (CroCo), or None.
            memory_rope: ``(cos, sin)`` tables of the M memory tokens: RoPE rotates the keys before they are
                cached (CroCo), or None.
            cache: the model's KV cache: this layer's memory keys/values are computed once, then reused.

        Returns:
            (B, N, D).
        """
        b, n, _ = x.shape
        h, hd = self.num_heads, self.head_dim
        q = self.q_norm(
            self.q(x if pos is None else x + pos).view(b, n, h, hd).transpose(1, 2)
        )  # (B, H, N, hd)
        if rope is not None:
            q = apply_rope(q, *rope)
        if cache is None:
            k, v = self._memory_kv(memory, memory_pos, memory_rope)  # (B, Hkv, M, hd)
        else:
            if self.layer_idx not in cache.memory:
                cache.memory[self.layer_idx] = self._memory_kv(memory, memory_pos, memory_rope)
            k, v = cache.memory[self.layer_idx]  # (B, Hkv, M, hd)

        visible = None
        if memory_mask is not None:
            if memory_mask.shape != (b, k.shape[2]):
                raise ValueError(
                    f"memory_mask must have shape (B, M)=({b}, {k.shape[2]}), got {tuple(memory_mask.shape)}"
                )
            visible = ~memory_mask[:, None, None, :]  # (B, 1, 1, M)

        dropout_p = self.attn_drop if self.training else 0.0
        out = _attend(q, k, v, visible, False, dropout_p, scale=self.scale)  # (B, H, N, hd)
        out = out.transpose(1, 2).reshape(b, n, h * hd)  # (B, N, H*hd)
        return self.proj_drop(self.proj(out))  # (B, N, D)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"attn_drop={self.attn_drop}"
        )
