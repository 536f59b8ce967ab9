"""The attention layers an ejected file holds: multi-head attention over ``F.scaled_dot_product_attention``.

They compute what the compiled model's attention core (:class:`specvit.nn.attention.Attention`) computes for
the parts they take (packed projections, GQA, QK-norm, rotary tables, DETR's positions, causal and sliding
masks, padding, an additive bias, the KV cache), bit for bit, in the few lines a person would write; a layer
using any other part is ejected from the core's own source. Every feature is a flag the ejector folds
(:mod:`specvit.codegen.specialise`), so a layer keeps only the lines its model runs.

Dim legend: B batch, N tokens, D width, H heads, Hkv key/value heads, hd head dim, T keys (cached + N),
M memory tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.codegen.templates.decoding import KVCache
from specvit.nn.position import apply_rope

__all__ = ["Attention", "CrossAttention"]


class Attention(nn.Module):
    """Multi-head self-attention.

    Args:
        dim: token width D.
        num_heads: query heads H.
        num_kv_heads: key/value heads Hkv (GQA), None for H.
        head_dim: the width hd of a head, None for D // H.
        qkv_bias: a bias in the packed q, k, v projection.
        qv_bias: q and v biases of their own and none for k (BEiT, EVA-02, Whisper).
        proj_bias: a bias in the output projection.
        qk_norm: ``layernorm`` or ``rmsnorm`` over each head's queries and keys, or None.
        qk_norm_bias: the QK LayerNorms have a bias.
        qk_norm_affine: the QK norms have a weight.
        norm_eps: their epsilon.
        scale: the factor of q·k, None for 1/sqrt(hd).
        causal: a token sees the tokens up to itself only.
        window: a token sees the tokens less than ``window`` positions away only, or None.
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
        layer_idx: this layer's entry in the KV cache.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = True,
        qv_bias: bool = False,
        proj_bias: bool = True,
        qk_norm: str | None = None,
        qk_norm_bias: bool = True,
        qk_norm_affine: bool = True,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        causal: bool = False,
        window: int | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.head_dim = dim // num_heads if head_dim is None else head_dim
        self.causal = causal
        self.window = window
        self.scale = scale
        self.attn_drop = attn_drop
        self.layer_idx = layer_idx
        self.gqa = num_kv_heads is not None
        self.qv_bias = qv_bias
        self.qk_norm = qk_norm is not None
        self.dropout = proj_drop > 0
        inner = num_heads * self.head_dim  # H * hd
        kv_inner = inner if num_kv_heads is None else num_kv_heads * self.head_dim  # Hkv * hd
        self.sizes = [inner, kv_inner, kv_inner]
        if num_kv_heads is None:
            self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        else:  # fewer key/value heads (GQA)
            self.qkv = nn.Linear(dim, inner + 2 * kv_inner, bias=qkv_bias)
        if qv_bias:
            self.q_bias = nn.Parameter(torch.zeros(inner))
            self.v_bias = nn.Parameter(torch.zeros(kv_inner))
        if qk_norm == "layernorm":
            self.q_norm: nn.Module = nn.LayerNorm(
                self.head_dim, eps=norm_eps, elementwise_affine=qk_norm_affine, bias=qk_norm_bias
            )
            self.k_norm: nn.Module = nn.LayerNorm(
                self.head_dim, eps=norm_eps, elementwise_affine=qk_norm_affine, bias=qk_norm_bias
            )
        elif qk_norm == "rmsnorm":
            self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps, elementwise_affine=qk_norm_affine)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps, elementwise_affine=qk_norm_affine)
        self.proj = nn.Linear(inner, dim, bias=proj_bias)
        if proj_drop > 0:
            self.proj_drop = nn.Dropout(proj_drop)

    def _qkv_bias(self) -> Tensor | None:
        """The packed projection's bias: with ``qv_bias``, the q and v biases around zeros for k."""
        if self.qv_bias:
            return torch.cat((self.q_bias, torch.zeros_like(self.v_bias), self.v_bias))
        return self.qkv.bias

    def _positioned(self, x: Tensor, pos: Tensor) -> Tensor:
        """The packed projection of x (B, N, D) where the queries and keys read x + pos (DETR)."""
        rows, weight, bias = self.sizes[0] + self.sizes[1], self.qkv.weight, self._qkv_bias()
        qk = F.linear(x + pos, weight[:rows], None if bias is None else bias[:rows])  # (B, N, (H + Hkv) * hd)
        v = F.linear(x, weight[rows:], None if bias is None else bias[rows:])  # (B, N, Hkv * hd)
        return torch.cat((qk, v), dim=-1)

    def _visible(self, n: int, t: int, past: int, device: torch.device) -> Tensor:
        """(N, T) bool: query i, at position past + i, may see key j."""
        visible = torch.ones(n, t, dtype=torch.bool, device=device)
        if self.causal:
            visible = visible.tril(past)
        if self.window is not None:
            visible = visible.triu(past - self.window + 1)
            if not self.causal:
                visible = visible.tril(past + self.window - 1)
        return visible

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
        """Self-attention of the tokens x (B, N, D): (B, N, D).

        Args:
            mask: (B, T) bool, True where a key is padding.
            rope: the rotary (cos, sin) tables of the N tokens.
            bias: an additive attention bias broadcastable to (B, H, N, T).
            pos: positions added to the queries' and keys' input only (DETR).
            cache: the KV cache while decoding.
        """
        b, n, _ = x.shape
        if pos is not None:
            qkv = self._positioned(x, pos)
        elif self.qv_bias:
            qkv = F.linear(x, self.qkv.weight, self._qkv_bias())
        else:
            qkv = self.qkv(x)  # (B, N, (H + 2Hkv) * hd)
        if self.gqa:
            q, k, v = qkv.split(self.sizes, dim=-1)  # (B, N, H * hd), (B, N, Hkv * hd) twice
        else:
            q, k, v = qkv.chunk(3, dim=-1)  # (B, N, H * hd) each
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (q, k, v))  # (B, H, N, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        past = 0  # the position of the first new token
        first = 0  # the position of the first key attended to
        if cache is not None:
            past = cache.length(self.layer_idx)
            k, v = cache.append(self.layer_idx, k, v)  # (B, Hkv, T, hd)
            if self.window is not None and self.causal:  # only the keys the window still sees
                first = max(0, past - self.window + 1)
                k, v = k[:, :, first:], v[:, :, first:]  # (B, Hkv, T, hd): T = past - first + N
        is_causal = self.causal and past == 0 and mask is None and bias is None and self.window is None
        visible = None  # (B, 1, N, T) bool: the keys each query sees
        if not is_causal and (self.window is not None or (self.causal and n > 1)):
            visible = self._visible(n, k.shape[2], past - first, x.device)  # (N, T)
        if mask is not None:
            keep = ~mask[:, None, None, first:]  # (B, 1, 1, T)
            visible = keep if visible is None else visible & keep  # (B, 1, N, T)
            has_key = visible.any(dim=-1, keepdim=True)  # (B, 1, N, 1): a query seeing only padding
            visible = visible | ~has_key  # sees every key instead, and outputs zeros
        if bias is not None:  # the mask becomes additive: the bias, -inf where a key is not seen
            bias = (bias if first == 0 else bias[..., first:]).to(q.dtype)
            visible = bias if visible is None else bias.masked_fill(~visible, -torch.inf)  # (B, H, N, T)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=visible,
            dropout_p=self.attn_drop if self.training else 0.0,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.gqa,
        )  # (B, H, N, hd)
        if mask is not None:
            out = out.masked_fill(~has_key, 0.0)
        out = self.proj(out.transpose(1, 2).reshape(b, n, -1))  # (B, N, D)
        if self.dropout:
            out = self.proj_drop(out)
        return out


class CrossAttention(nn.Module):
    """Multi-head attention from the tokens to a memory (the encoder's output).

    Args:
        dim: token width D.
        num_heads: query heads H.
        memory_dim: the memory's width.
        num_kv_heads: key/value heads Hkv (GQA), None for H.
        head_dim: the width hd of a head, None for D // H.
        qkv_bias: biases in the q and the packed k, v projections.
        proj_bias: a bias in the output projection.
        qk_norm: ``layernorm`` or ``rmsnorm`` over each head's queries and keys, or None.
        qk_norm_bias: the QK LayerNorms have a bias.
        qk_norm_affine: the QK norms have a weight.
        norm_eps: their epsilon.
        scale: the factor of q·k, None for 1/sqrt(hd).
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
        layer_idx: this layer's entry in the KV cache.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        memory_dim: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        qk_norm: str | None = None,
        qk_norm_bias: bool = True,
        qk_norm_affine: bool = True,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.head_dim = dim // num_heads if head_dim is None else head_dim
        self.scale = scale
        self.attn_drop = attn_drop
        self.layer_idx = layer_idx
        self.gqa = num_kv_heads is not None
        self.qk_norm = qk_norm is not None
        self.dropout = proj_drop > 0
        inner = num_heads * self.head_dim  # H * hd
        kv_inner = inner if num_kv_heads is None else num_kv_heads * self.head_dim  # Hkv * hd
        self.q = nn.Linear(dim, inner, bias=qkv_bias)
        self.kv = nn.Linear(memory_dim, 2 * kv_inner, bias=qkv_bias)
        if qk_norm == "layernorm":
            self.q_norm: nn.Module = nn.LayerNorm(
                self.head_dim, eps=norm_eps, elementwise_affine=qk_norm_affine, bias=qk_norm_bias
            )
            self.k_norm: nn.Module = nn.LayerNorm(
                self.head_dim, eps=norm_eps, elementwise_affine=qk_norm_affine, bias=qk_norm_bias
            )
        elif qk_norm == "rmsnorm":
            self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps, elementwise_affine=qk_norm_affine)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps, elementwise_affine=qk_norm_affine)
        self.proj = nn.Linear(inner, dim, bias=proj_bias)
        if proj_drop > 0:
            self.proj_drop = nn.Dropout(proj_drop)

    def _memory(
        self, memory: Tensor, memory_pos: Tensor | None, memory_rope: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor]:
        """The keys and values of the memory (B, M, Dm): (B, Hkv, M, hd) each."""
        if memory_pos is None:
            kv = self.kv(memory)  # (B, M, 2 * Hkv * hd)
        else:  # DETR: the keys read memory + memory_pos, the values the memory
            rows, weight, bias = self.kv.weight.shape[0] // 2, self.kv.weight, self.kv.bias
            k = F.linear(memory + memory_pos, weight[:rows], None if bias is None else bias[:rows])
            kv = torch.cat(
                (k, F.linear(memory, weight[rows:], None if bias is None else bias[rows:])), dim=-1
            )
        k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in kv.chunk(2, dim=-1))
        if self.qk_norm:
            k = self.k_norm(k)
        if memory_rope is not None:
            k = apply_rope(k, *memory_rope)
        return k, v

    def forward(
        self,
        x: Tensor,
        *,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        pos: Tensor | None = None,
        memory_pos: Tensor | None = None,
        memory_rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Attention of the tokens x (B, N, D) to the memory: (B, N, D).

        Args:
            memory: (B, M, Dm) the memory; not read once its keys and values are cached.
            memory_mask: (B, M) bool, True where the memory is padding.
            rope: the rotary (cos, sin) tables of the N tokens (for the queries).
            pos: positions added to the queries' input (DETR).
            memory_pos: positions added to the keys' input (DETR).
            memory_rope: the rotary tables of the memory (for the keys).
            cache: the KV cache while decoding: it keeps the memory's keys and values.
        """
        b, n, _ = x.shape
        q = self.q(x if pos is None else x + pos)  # (B, N, H * hd)
        q = q.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # (B, H, N, hd)
        if self.qk_norm:
            q = self.q_norm(q)
        if rope is not None:
            q = apply_rope(q, *rope)
        if cache is not None and self.layer_idx in cache.memory:
            k, v = cache.memory[self.layer_idx]  # (B, Hkv, M, hd) each
        else:
            assert memory is not None
            k, v = self._memory(memory, memory_pos, memory_rope)  # (B, Hkv, M, hd) each
            if cache is not None:
                cache.memory[self.layer_idx] = (k, v)
        visible = None  # (B, 1, 1, M) bool: the memory tokens each query sees
        if memory_mask is not None:
            visible = ~memory_mask[:, None, None, :]
            has_key = visible.any(dim=-1, keepdim=True)  # (B, 1, 1, 1): a sample whose memory is all padding
            visible = visible | ~has_key  # sees all of it instead, and outputs zeros
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=visible,
            dropout_p=self.attn_drop if self.training else 0.0,
            scale=self.scale,
            enable_gqa=self.gqa,
        )  # (B, H, N, hd)
        if memory_mask is not None:
            out = out.masked_fill(~has_key, 0.0)
        out = self.proj(out.transpose(1, 2).reshape(b, n, -1))  # (B, N, D)
        if self.dropout:
            out = self.proj_drop(out)
        return out
