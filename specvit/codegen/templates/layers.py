"""The embeddings and MLPs an ejected file holds, written plainly; each computes what its :mod:`specvit.nn`
counterpart computes for the arguments it takes (see :mod:`specvit.codegen.templates`).

Dim legend: B batch, N tokens, D width, F hidden width, C image channels, (ph, pw) patch, (gh, gw) grid.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["GluMlp", "LearnedPosition", "Mlp", "PatchEmbed", "PrefixTokens", "TokenEmbed"]


class Mlp(nn.Module):
    """Two-layer MLP ``fc2(act(fc1(x)))``.

    Args:
        dim: input and output width D.
        hidden: hidden width F.
        activation: ``gelu``, ``gelu_tanh``, ``relu`` or ``silu``.
        bias: biases in ``fc1`` and ``fc2``.
        dropout: dropout after the activation and after ``fc2``.
        norm: ``layernorm`` or ``rmsnorm`` of the hidden activations, or None.
        norm_eps: its epsilon.
        norm_bias: the LayerNorm has a bias.
        norm_affine: the norm has a weight.
        dwconv: the (gh, gw) grid of a depthwise 3x3 conv after ``fc1`` (PVT v2), or None.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: str = "gelu",
        bias: bool = True,
        dropout: float = 0.0,
        norm: str | None = None,
        norm_eps: float = 1e-6,
        norm_bias: bool = True,
        norm_affine: bool = True,
        dwconv: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.grid = dwconv
        self.dropout = dropout > 0
        self.inner_norm = norm is not None
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        if dwconv is not None:
            self.dwconv = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
        if activation in ("gelu", "geglu"):
            self.act: nn.Module = nn.GELU()
        elif activation in ("gelu_tanh", "geglu_tanh"):
            self.act = nn.GELU(approximate="tanh")
        elif activation == "relu":
            self.act = nn.ReLU()
        else:
            self.act = nn.SiLU()
        if dropout > 0:
            self.drop1 = nn.Dropout(dropout)
        if norm == "layernorm":
            self.norm: nn.Module = nn.LayerNorm(
                hidden, eps=norm_eps, elementwise_affine=norm_affine, bias=norm_bias
            )
        elif norm == "rmsnorm":
            self.norm = nn.RMSNorm(hidden, eps=norm_eps, elementwise_affine=norm_affine)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        if dropout > 0:
            self.drop2 = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)  # (B, N, F)
        if self.grid is not None:  # the hidden activations as a (B, F, gh, gw) map through the conv
            h = self.dwconv(h.transpose(1, 2).reshape(h.shape[0], -1, *self.grid))  # (B, F, gh, gw)
            h = h.flatten(2).transpose(1, 2)  # (B, N, F)
        h = self.act(h)
        if self.dropout:
            h = self.drop1(h)
        if self.inner_norm:
            h = self.norm(h)
        h = self.fc2(h)  # (B, N, D)
        if self.dropout:
            h = self.drop2(h)
        return h


class GluMlp(nn.Module):
    """Gated MLP ``fc2(act(gate) * value)``, the gate and the value from one packed ``fc1``.

    Args:
        dim: input and output width D.
        hidden: hidden width F of the gate and of the value.
        activation: ``swiglu`` (SiLU gate), ``geglu`` (GELU gate) or ``geglu_tanh``.
        bias: biases in ``fc1`` and ``fc2``.
        dropout: dropout after the gating and after ``fc2``.
        norm: ``layernorm`` or ``rmsnorm`` of the hidden activations, or None.
        norm_eps: its epsilon.
        norm_bias: the LayerNorm has a bias.
        norm_affine: the norm has a weight.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: str = "swiglu",
        bias: bool = True,
        dropout: float = 0.0,
        norm: str | None = None,
        norm_eps: float = 1e-6,
        norm_bias: bool = True,
        norm_affine: bool = True,
    ) -> None:
        super().__init__()
        self.dropout = dropout > 0
        self.inner_norm = norm is not None
        self.fc1 = nn.Linear(dim, 2 * hidden, bias=bias)
        if activation in ("gelu", "geglu"):
            self.act: nn.Module = nn.GELU()
        elif activation in ("gelu_tanh", "geglu_tanh"):
            self.act = nn.GELU(approximate="tanh")
        elif activation == "relu":
            self.act = nn.ReLU()
        else:
            self.act = nn.SiLU()
        if dropout > 0:
            self.drop1 = nn.Dropout(dropout)
        if norm == "layernorm":
            self.norm: nn.Module = nn.LayerNorm(
                hidden, eps=norm_eps, elementwise_affine=norm_affine, bias=norm_bias
            )
        elif norm == "rmsnorm":
            self.norm = nn.RMSNorm(hidden, eps=norm_eps, elementwise_affine=norm_affine)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        if dropout > 0:
            self.drop2 = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)  # (B, N, F) each
        h = self.act(gate) * value
        if self.dropout:
            h = self.drop1(h)
        if self.inner_norm:
            h = self.norm(h)
        h = self.fc2(h)  # (B, N, D)
        if self.dropout:
            h = self.drop2(h)
        return h


class PatchEmbed(nn.Module):
    """Images (B, C, H, W) to patch tokens (B, N, D), row-major.

    Args:
        patch: (ph, pw) patch size.
        in_chans: image channels C.
        dim: token width D.
        projection: ``conv`` (kernel = stride = patch) or ``linear`` (of each patch flattened (C, ph, pw)).
        bias: a bias in the projection.
    """

    def __init__(
        self, patch: tuple[int, int], in_chans: int, dim: int, projection: str = "conv", bias: bool = True
    ) -> None:
        super().__init__()
        self.patch = patch
        self.linear = projection == "linear"
        if projection == "linear":
            self.proj: nn.Module = nn.Linear(in_chans * patch[0] * patch[1], dim, bias=bias)
        else:
            self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if not self.linear:
            return self.proj(x).flatten(2).transpose(1, 2)  # (B, D, gh, gw) -> (B, N, D)
        (b, c, h, w), (ph, pw) = x.shape, self.patch
        x = x.reshape(b, c, h // ph, ph, w // pw, pw)  # (B, C, gh, ph, gw, pw)
        x = x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // ph) * (w // pw), c * ph * pw)  # (B, N, C*ph*pw)
        return self.proj(x)  # (B, N, D)


class PrefixTokens(nn.Module):
    """Learned tokens put in front of the sequence.

    The class token, the distillation token (DeiT) and register tokens, in that order.

    Args:
        dim: token width D.
        cls: a class token.
        registers: how many register tokens R.
        distillation: a distillation token.
    """

    def __init__(self, dim: int, cls: bool = True, registers: int = 0, distillation: bool = False) -> None:
        super().__init__()
        self.only_cls = cls and registers == 0 and not distillation
        if cls:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        if distillation:
            self.dist_token = nn.Parameter(torch.zeros(1, 1, dim))
        if registers > 0:
            self.reg_token = nn.Parameter(torch.zeros(1, registers, dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.only_cls:
            return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + N, D)
        tokens = [getattr(self, n) for n in ("cls_token", "dist_token", "reg_token") if hasattr(self, n)]
        return torch.cat([*(t.expand(x.shape[0], -1, -1) for t in tokens), x], dim=1)  # (B, P + N, D)


class LearnedPosition(nn.Module):
    """A learned table of positions added to the tokens.

    Args:
        num_positions: the table's rows.
        dim: token width D.
        start: the row of position 0 (BART's 2).
    """

    def __init__(self, num_positions: int, dim: int, start: int = 0) -> None:
        super().__init__()
        self.start = start
        self.weight = nn.Parameter(torch.randn(1, num_positions, dim) * 0.02)  # (1, num_positions, D)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """x (B, N, D) plus the table's rows of their positions."""
        if self.start == 0 and offset == 0:
            return x + self.weight[:, : x.shape[1]]  # (B, N, D)
        first = self.start + offset
        return x + self.weight[:, first : first + x.shape[1]]  # (B, N, D)


class TokenEmbed(nn.Embedding):
    """Token embeddings scaled by sqrt(D) (the Transformer's, T5's).

    Args:
        vocab: vocabulary size.
        dim: width D.
        padding_idx: the id whose row is zero, or None.
    """

    def __init__(self, vocab: int, dim: int, padding_idx: int | None = None) -> None:
        super().__init__(vocab, dim, padding_idx=padding_idx)

    def forward(self, input: Tensor) -> Tensor:
        return super().forward(input) * math.sqrt(self.embedding_dim)  # (B, N, D)
