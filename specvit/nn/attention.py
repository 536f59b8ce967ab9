"""Multi-head self- and cross-attention on top of ``F.scaled_dot_product_attention``, with GQA/MQA,
optional QK-norm, RoPE and KV caches.

Masks: ``key_padding_mask`` / ``memory_padding_mask`` are boolean with True = padding (ignored key), the
torch ``nn.MultiheadAttention`` convention. A query row that ends up with no visible key (e.g. every key of
that sample is padding) outputs zeros from the attention (so the module returns ``proj(0) = proj.bias``)
instead of NaN, independently of the SDPA backend; its gradients are finite too.

GQA/MQA uses SDPA's ``enable_gqa=True``: no repeated k/v copies in the fused kernels, bitwise equal to
repeating k/v heads, and counted like plain MHA by ``FlopCounterMode`` under the MATH backend.

Caches: one cache object per attention layer; a model-wide cache is a plain list, e.g.
``[KVCache() for _ in range(num_layers)]`` (and ``[CrossKVCache() for ...]`` for cross-attention layers).

Dim legend: B batch, N tokens, D width, H heads, Hkv kv heads, hd head dim, M memory tokens.
T is the number of keys a self-attention query sees (N, or cached + N with a KV cache); Dm memory width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn.position import apply_rope

QkNorm = Literal["layernorm", "rmsnorm"]


@dataclass
class KVCache:
    """Self-attention cache of the keys/values of all tokens seen so far (after QK-norm and RoPE).

    Args:
        k: (B, Hkv, T, hd) cached keys, or None when empty.
        v: (B, Hkv, T, hd) cached values, or None when empty.
    """

    k: Tensor | None = None
    v: Tensor | None = None

    @property
    def length(self) -> int:
        """Number of cached positions T."""
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append new (B, Hkv, N, hd) keys/values and return all (B, Hkv, T + N, hd) keys/values."""
        if self.k is None or self.v is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat((self.k, k), dim=2)  # (B, Hkv, T + N, hd)
            self.v = torch.cat((self.v, v), dim=2)  # (B, Hkv, T + N, hd)
        return self.k, self.v


@dataclass
class CrossKVCache:
    """Cross-attention cache: the memory's projected keys/values, computed once and then reused.

    Args:
        k: (B, Hkv, M, hd) memory keys (after QK-norm), or None until the first forward.
        v: (B, Hkv, M, hd) memory values, or None until the first forward.
    """

    k: Tensor | None = None
    v: Tensor | None = None


def _head_norm(
    kind: QkNorm | None,
    head_dim: int,
    eps: float,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> nn.Module:
    if kind is None:
        return nn.Identity()
    if kind == "layernorm":
        return nn.LayerNorm(head_dim, eps=eps, device=device, dtype=dtype)
    if kind == "rmsnorm":
        return nn.RMSNorm(head_dim, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"qk_norm must be 'layernorm', 'rmsnorm' or None, got {kind!r}")


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0.0 else nn.Identity()


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
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, is_causal: bool, dropout_p: float
) -> Tensor:
    """SDPA where query rows without any visible key output zeros instead of NaN.

    Args:
        q: (B, H, N, hd) queries.
        k: (B, Hkv, T, hd) keys.
        v: (B, Hkv, T, hd) values.
        visible: boolean mask broadcastable to (B, 1, N, T), True = may attend; None = all visible.
        is_causal: let SDPA apply its own causal mask (only when ``visible`` is None and N == T).
        dropout_p: attention-probability dropout.
    """
    has_key = None
    if visible is not None:
        has_key = visible.any(dim=-1, keepdim=True)  # (B, 1, N, 1)
        visible = visible | ~has_key  # rows with nothing visible attend everywhere; zeroed below
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=visible,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # (B, H, N, hd)
    if has_key is not None:
        out = out.masked_fill(~has_key, 0.0)
    return out


class SelfAttention(nn.Module):
    """Multi-head self-attention with GQA/MQA, optional QK-norm, RoPE, causal masking and a KV cache.

    Args:
        dim: token width D.
        num_heads: number of query heads H.
        num_kv_heads: number of key/value heads Hkv (divides H); None = H (plain MHA), 1 = MQA.
        head_dim: per-head width hd; None = D // H.
        qkv_bias: bias of the packed ``qkv`` projection.
        proj_bias: bias of the output projection.
        qk_norm: ``layernorm`` or ``rmsnorm`` over hd applied to queries and keys, or None.
        norm_eps: epsilon of the QK norms.
        attn_drop: dropout on the attention probabilities (training only).
        proj_drop: dropout after the output projection.
        causal: query i only sees keys at positions <= its own.
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
        qkv_bias: bool = True,
        proj_bias: bool = True,
        qk_norm: QkNorm | None = None,
        norm_eps: float = 1e-6,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        causal: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = _resolve_heads(dim, num_heads, num_kv_heads, head_dim)
        self.causal = causal
        self.attn_drop = attn_drop
        hd, h, hkv = self.head_dim, num_heads, self.num_kv_heads
        self.qkv = nn.Linear(dim, (h + 2 * hkv) * hd, bias=qkv_bias, device=device, dtype=dtype)
        self.q_norm = _head_norm(qk_norm, hd, norm_eps, device, dtype)
        self.k_norm = _head_norm(qk_norm, hd, norm_eps, device, dtype)
        self.proj = nn.Linear(h * hd, dim, bias=proj_bias, device=device, dtype=dtype)
        self.proj_drop = _dropout(proj_drop)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        pos: Tensor | None = None,
    ) -> Tensor:
        """Attend x to itself (and to the cached tokens).

        Args:
            x: (B, N, D) tokens.
            key_padding_mask: (B, T) bool, True = padding key; T counts the cached keys too when a cache is
                given (T = cache.length + N). Queries are not masked: a padded query still gets an output.
            rope: ``(cos, sin)`` tables for the N new tokens (absolute positions cache.length .. + N - 1),
                from :class:`~specvit.nn.position.Rope` or :class:`~specvit.nn.position.Rope2d`.
            cache: KV cache of this layer; the new keys/values are appended to it. Masking is unchanged
                by the cache: a causal layer lets query i (absolute position cache.length + i) see keys
                j <= cache.length + i, a non-causal one lets the new tokens see every cached and new key.
            pos: (B or 1, N, D) positions added to the input of the queries and keys only, not of the values
                (DETR); the projections cost what the fused one does.

        Returns:
            (B, N, D).
        """
        b, n, _ = x.shape
        h, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if pos is None:
            qkv = self.qkv(x)  # (B, N, (H + 2Hkv) * hd)
        else:
            rows = (h + hkv) * hd  # q and k rows of the packed weight read x + pos; v rows read x
            w, bias = self.qkv.weight, self.qkv.bias
            qk = F.linear(x + pos, w[:rows], bias[:rows] if bias is not None else None)
            v_in = F.linear(x, w[rows:], bias[rows:] if bias is not None else None)
            qkv = torch.cat((qk, v_in), dim=-1)  # (B, N, (H + 2Hkv) * hd)
        qkv = qkv.view(b, n, h + 2 * hkv, hd).transpose(1, 2)  # (B, H + 2Hkv, N, hd)
        q, k, v = qkv.split((h, hkv, hkv), dim=1)  # (B, H, N, hd), (B, Hkv, N, hd), (B, Hkv, N, hd)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)  # (B, Hkv, T, hd)
        t = k.shape[2]

        visible: Tensor | None = None  # broadcastable to (B, 1, N, T), True = may attend
        is_causal = False
        if self.causal:
            if past == 0 and key_padding_mask is None:
                is_causal = True
            else:
                # query i sits at absolute position past + i and sees keys j <= past + i
                visible = torch.ones(n, t, dtype=torch.bool, device=x.device).tril(diagonal=past)  # (N, T)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (b, t):
                raise ValueError(
                    f"key_padding_mask must have shape (B, T)=({b}, {t}), got {tuple(key_padding_mask.shape)}"
                )
            keep = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, T)
            visible = keep if visible is None else visible & keep  # (B, 1, N, T)

        dropout_p = self.attn_drop if self.training else 0.0
        out = _attend(q, k, v, visible, is_causal, dropout_p)  # (B, H, N, hd)
        out = out.transpose(1, 2).reshape(b, n, h * hd)  # (B, N, H*hd)
        return self.proj_drop(self.proj(out))  # (B, N, D)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"causal={self.causal}, attn_drop={self.attn_drop}"
        )


class CrossAttention(nn.Module):
    """Multi-head cross-attention from tokens to a memory, with GQA/MQA, optional QK-norm, RoPE and a KV cache.

    Args:
        dim: query token width D.
        num_heads: number of query heads H.
        memory_dim: memory width Dm; None = D.
        num_kv_heads: number of key/value heads Hkv (divides H); None = H.
        head_dim: per-head width hd; None = D // H.
        qkv_bias: bias of the ``q`` and ``kv`` projections.
        proj_bias: bias of the output projection.
        qk_norm: ``layernorm`` or ``rmsnorm`` over hd applied to queries and keys, or None.
        norm_eps: epsilon of the QK norms.
        attn_drop: dropout on the attention probabilities (training only).
        proj_drop: dropout after the output projection.
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
        qkv_bias: bool = True,
        proj_bias: bool = True,
        qk_norm: QkNorm | None = None,
        norm_eps: float = 1e-6,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = _resolve_heads(dim, num_heads, num_kv_heads, head_dim)
        self.attn_drop = attn_drop
        hd, h, hkv = self.head_dim, num_heads, self.num_kv_heads
        self.q = nn.Linear(dim, h * hd, bias=qkv_bias, device=device, dtype=dtype)
        self.kv = nn.Linear(
            dim if memory_dim is None else memory_dim, 2 * hkv * hd, bias=qkv_bias, device=device, dtype=dtype
        )
        self.q_norm = _head_norm(qk_norm, hd, norm_eps, device, dtype)
        self.k_norm = _head_norm(qk_norm, hd, norm_eps, device, dtype)
        self.proj = nn.Linear(h * hd, dim, bias=proj_bias, device=device, dtype=dtype)
        self.proj_drop = _dropout(proj_drop)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_padding_mask: Tensor | None = None,
        cache: CrossKVCache | None = None,
        pos: Tensor | None = None,
        memory_pos: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        memory_rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Attend x to the memory.

        Args:
            x: (B, N, D) query tokens.
            memory: (B, M, Dm) memory tokens; not read when ``cache`` already holds its keys/values.
            memory_padding_mask: (B, M) bool, True = padding memory token.
            cache: when given and filled, its keys/values are reused; when given and empty, it is filled.
            pos: (B or 1, N, D) positions added to the queries' input (DETR's query embeddings).
            memory_pos: (B or 1, M, Dm) positions added to the keys' input, not the values' (DETR).
            rope: ``(cos, sin)`` tables of the N queries: RoPE rotates the queries (CroCo), or None.
            memory_rope: ``(cos, sin)`` tables of the M memory tokens: RoPE rotates the keys before they are
                cached (CroCo), or None.

        Returns:
            (B, N, D).
        """
        b, n, _ = x.shape
        h, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(
            self.q(x if pos is None else x + pos).view(b, n, h, hd).transpose(1, 2)
        )  # (B, H, N, hd)
        if rope is not None:
            q = apply_rope(q, *rope)
        if cache is not None and cache.k is not None and cache.v is not None:
            k, v = cache.k, cache.v  # (B, Hkv, M, hd)
        else:
            m = memory.shape[1]
            if memory_pos is None:
                kv_flat = self.kv(memory)  # (B, M, 2 * Hkv * hd)
            else:
                rows = hkv * hd  # k rows of the packed weight read memory + pos; v rows read memory
                w, bias = self.kv.weight, self.kv.bias
                k_in = F.linear(memory + memory_pos, w[:rows], bias[:rows] if bias is not None else None)
                v_in = F.linear(memory, w[rows:], bias[rows:] if bias is not None else None)
                kv_flat = torch.cat((k_in, v_in), dim=-1)  # (B, M, 2 * Hkv * hd)
            kv = kv_flat.view(b, m, 2, hkv, hd).permute(2, 0, 3, 1, 4)  # (2, B, Hkv, M, hd)
            k, v = self.k_norm(kv[0]), kv[1]  # (B, Hkv, M, hd)
            if memory_rope is not None:
                k = apply_rope(k, *memory_rope)
            if cache is not None:
                cache.k, cache.v = k, v

        visible = None
        if memory_padding_mask is not None:
            if memory_padding_mask.shape != (b, k.shape[2]):
                raise ValueError(
                    f"memory_padding_mask must have shape (B, M)=({b}, {k.shape[2]}), "
                    f"got {tuple(memory_padding_mask.shape)}"
                )
            visible = ~memory_padding_mask[:, None, None, :]  # (B, 1, 1, M)

        dropout_p = self.attn_drop if self.training else 0.0
        out = _attend(q, k, v, visible, False, dropout_p)  # (B, H, N, hd)
        out = out.transpose(1, 2).reshape(b, n, h * hd)  # (B, N, H*hd)
        return self.proj_drop(self.proj(out))  # (B, N, D)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"attn_drop={self.attn_drop}"
        )
