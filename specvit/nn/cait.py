"""CaiT's attention layers (Touvron et al. 2021, "Going deeper with Image Transformers"; timm ``cait.py``).

- :class:`TalkingHeadsAttention`: self-attention whose scores are mixed across heads by a learned
  H x H map before the softmax (``proj_l``) and again after it (``proj_w``) (Shazeer et al. 2020). The
  mixing sits between the two matmuls, so it cannot use the fused SDPA kernels: it is the math path.
- :class:`ClassAttention`: only the class token (the first token) forms a query; it attends over every
  token, itself included. The output is the class token's update, (B, 1, D).

Masks follow :mod:`specvit.nn.attention`: ``mask`` is (B, T) bool, True = padding key. In talking-heads
attention the mask and an additive bias apply to the mixed logits, just before the softmax, so a hidden key
gets no weight from any head.

Dim legend: B batch, N tokens, D width, H heads, hd head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn.attention import QkNorm, QkvBias, _dropout, _head_norm, _resolve_heads, _three
from specvit.nn.linear import Linear
from specvit.nn.position import apply_rope

__all__ = ["ClassAttention", "TalkingHeadsAttention", "class_token", "join_class_token"]


class TalkingHeadsAttention(nn.Module):
    """Multi-head self-attention with talking heads: the (B, H, N, N) scores are mixed across H by
    ``proj_l`` before the softmax and the probabilities by ``proj_w`` after it (timm ``TalkingHeadAttn``).

    Args:
        dim: token width D.
        num_heads: number of heads H (keys and values have as many).
        head_dim: per-head width hd; None = D // H.
        qkv_bias: bias of the packed ``qkv`` projection (one flag, or (q, k, v) all equal).
        proj_bias: bias of the output projection.
        qk_norm: ``layernorm`` or ``rmsnorm`` over hd applied to queries and keys, or None.
        qk_norm_bias: the QK LayerNorms have a bias.
        norm_eps: epsilon of the QK norms.
        attn_drop: dropout on the mixed attention weights (training only).
        proj_drop: dropout after the output projection.
        scale: factor of q·k; None = 1/sqrt(hd).
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        qkv_bias: QkvBias = True,
        proj_bias: bool = True,
        qk_norm: QkNorm | None = None,
        qk_norm_bias: bool = True,
        norm_eps: float = 1e-6,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        scale: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _, self.head_dim = _resolve_heads(dim, num_heads, None, head_dim)
        self.num_heads = num_heads
        hd, h = self.head_dim, num_heads
        self.scale = hd**-0.5 if scale is None else scale
        biases = set(_three(qkv_bias))
        if len(biases) > 1:
            raise ValueError("talking-heads attention has one bias flag for q, k and v")
        self.qkv = Linear(dim, 3 * h * hd, bias=biases.pop(), device=device, dtype=dtype)
        self.q_norm = _head_norm(qk_norm, hd, norm_eps, qk_norm_bias, device, dtype)
        self.k_norm = _head_norm(qk_norm, hd, norm_eps, qk_norm_bias, device, dtype)
        self.proj_l = nn.Linear(h, h, device=device, dtype=dtype)  # mixes the logits across heads
        self.proj_w = nn.Linear(h, h, device=device, dtype=dtype)  # mixes the probabilities across heads
        self.attn_drop = _dropout(attn_drop)
        self.proj = Linear(h * hd, dim, bias=proj_bias, device=device, dtype=dtype)
        self.proj_drop = _dropout(proj_drop)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        bias: Tensor | None = None,
    ) -> Tensor:
        """Attend x to itself, the heads talking.

        Args:
            x: (B, N, D) tokens.
            mask: (B, N) bool, True = padding key.
            rope: ``(cos, sin)`` rotary tables for the N tokens, or None.
            bias: additive bias broadcastable to (B, H, N, N), added to the mixed logits.

        Returns:
            (B, N, D).
        """
        b, n, _ = x.shape
        h, hd = self.num_heads, self.head_dim
        qkv = self.qkv(x).view(b, n, 3, h, hd).permute(2, 0, 3, 1, 4)  # (3, B, H, N, hd)
        q, k, v = self.q_norm(qkv[0]), self.k_norm(qkv[1]), qkv[2]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        logits = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, N, N)
        logits = self.proj_l(logits.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # mixed across H: (B, H, N, N)
        if bias is not None:
            logits = logits + bias.to(logits.dtype)
        if mask is not None:
            if mask.shape != (b, n):
                raise ValueError(f"mask must have shape (B, N)=({b}, {n}), got {tuple(mask.shape)}")
            logits = logits.masked_fill(mask[:, None, None, :], float("-inf"))
        attn = logits.softmax(dim=-1)
        attn = self.proj_w(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # mixed across H: (B, H, N, N)
        out = self.attn_drop(attn) @ v  # (B, H, N, hd)
        out = out.transpose(1, 2).reshape(b, n, h * hd)  # (B, N, H*hd)
        return self.proj_drop(self.proj(out))  # (B, N, D)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, talking_heads=True"


class ClassAttention(nn.Module):
    """Class attention (timm ``ClassAttn``): the first token's query attends over all N tokens.

    Args:
        dim: token width D.
        num_heads: number of heads H.
        head_dim: per-head width hd; None = D // H.
        qkv_bias: biases of the ``q``, ``k`` and ``v`` projections: one flag or (q, k, v).
        proj_bias: bias of the output projection.
        attn_drop: dropout on the attention probabilities (training only).
        proj_drop: dropout after the output projection.
        scale: factor of q·k; None = 1/sqrt(hd).
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        qkv_bias: QkvBias = True,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        scale: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _, self.head_dim = _resolve_heads(dim, num_heads, None, head_dim)
        self.num_heads, self.scale, self.attn_drop = num_heads, scale, attn_drop
        inner = num_heads * self.head_dim
        bq, bk, bv = _three(qkv_bias)
        self.q = Linear(dim, inner, bias=bq, device=device, dtype=dtype)
        self.k = Linear(dim, inner, bias=bk, device=device, dtype=dtype)
        self.v = Linear(dim, inner, bias=bv, device=device, dtype=dtype)
        self.proj = Linear(inner, dim, bias=proj_bias, device=device, dtype=dtype)
        self.proj_drop = _dropout(proj_drop)

    def forward(self, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        """The class token's attention over every token.

        Args:
            x: (B, N, D) tokens, the class token first.
            mask: (B, N) bool, True = padding key.

        Returns:
            (B, 1, D): the class token's update.
        """
        b, n, _ = x.shape
        h, hd = self.num_heads, self.head_dim
        q = self.q(x[:, :1]).view(b, 1, h, hd).transpose(1, 2)  # (B, H, 1, hd)
        k = self.k(x).view(b, n, h, hd).transpose(1, 2)  # (B, H, N, hd)
        v = self.v(x).view(b, n, h, hd).transpose(1, 2)  # (B, H, N, hd)
        keep = None if mask is None else ~mask[:, None, None, :]  # (B, 1, 1, N)
        dropout_p = self.attn_drop if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=self.scale)
        out = out.transpose(1, 2).reshape(b, 1, h * hd)  # (B, 1, H*hd)
        return self.proj_drop(self.proj(out))  # (B, 1, D)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, queries=class token"


def class_token(x: Tensor) -> Tensor:
    """The class token (the first) of (B, N, D) tokens: (B, 1, D)."""
    return x[:, :1]


def join_class_token(x: Tensor, cls: Tensor) -> Tensor:
    """The (B, N, D) tokens with their first replaced by the (B, 1, D) class token ``cls``."""
    return torch.cat((cls, x[:, 1:]), dim=1)  # (B, N, D)
