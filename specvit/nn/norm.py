"""Norms over the last dim: torch's LayerNorm and RMSNorm, and the variants published models use.

Dim legend: B batch, N tokens, H heads, hd head dim.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Norm", "NormKind", "make_norm"]

NormKind = Literal["layernorm", "rmsnorm"]


class Norm(nn.Module):
    """LayerNorm or RMSNorm with the variants torch's modules lack.

    Args:
        dim: the features normalised (all heads' together when ``heads`` is set).
        kind: ``layernorm`` or ``rmsnorm``.
        eps: added to the variance (or the mean square).
        bias: a learned bias (layernorm only).
        affine: a learned weight (and bias); false: none (OLMo's LayerNorm).
        unit_offset: the weight is stored as ``w`` and scales by ``1 + w``, initialised to 0 (Gemma's
            RMSNorm, Nemotron's LayerNorm1P).
        heads: normalise (B, H, N, hd) queries or keys over all H * hd channels of a token at once (OLMo 2's
            QK-norm), not per head; None for a (..., dim) input.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        kind: NormKind = "layernorm",
        eps: float = 1e-5,
        *,
        bias: bool = True,
        affine: bool = True,
        unit_offset: bool = False,
        heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"kind must be 'layernorm' or 'rmsnorm', got {kind!r}")
        if unit_offset and not affine:
            raise ValueError("unit_offset needs a learned weight (affine=True)")
        self.dim, self.kind, self.eps = dim, kind, eps
        self.unit_offset, self.heads = unit_offset, heads
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype)) if affine else None
        has_bias = affine and bias and kind == "layernorm"
        self.bias = nn.Parameter(torch.empty(dim, device=device, dtype=dtype)) if has_bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity map: weight 1 (0 with a unit offset), bias 0."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 0.0 if self.unit_offset else 1.0)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Normalise x: (..., dim), or (B, H, N, hd) queries or keys with ``heads``."""
        shape = x.shape
        if self.heads is not None:
            x = x.transpose(-3, -2).flatten(-2)  # (B, N, H*hd)
        weight: Tensor | None = self.weight
        if weight is not None and self.unit_offset:
            weight = weight + 1.0
        if self.kind == "layernorm":
            out = F.layer_norm(x, (self.dim,), weight, self.bias, self.eps)
        else:
            out = F.rms_norm(x, (self.dim,), weight, self.eps)
        if self.heads is not None:
            out = out.unflatten(-1, (shape[-3], shape[-1])).transpose(-3, -2)  # (B, H, N, hd)
        return out

    def extra_repr(self) -> str:
        flags = [f"{self.dim}", self.kind, f"eps={self.eps}"]
        flags += [] if self.weight is not None else ["affine=False"]
        flags += ["unit_offset=True"] if self.unit_offset else []
        flags += [f"heads={self.heads}"] if self.heads is not None else []
        return ", ".join(flags)


def make_norm(
    kind: NormKind,
    dim: int,
    eps: float,
    *,
    bias: bool = True,
    affine: bool = True,
    unit_offset: bool = False,
    heads: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """torch's ``LayerNorm`` / ``RMSNorm`` where they state the norm, else a :class:`Norm`.

    Args:
        kind: ``layernorm`` or ``rmsnorm``.
        dim: the features normalised.
        eps: added to the variance.
        bias: a learned bias (layernorm).
        affine: a learned weight (and bias).
        unit_offset: scale by ``1 + w``.
        heads: normalise all heads of a token together (see :class:`Norm`).
        device: parameter device.
        dtype: parameter dtype.
    """
    if unit_offset or heads is not None:
        return Norm(
            dim,
            kind,
            eps,
            bias=bias,
            affine=affine,
            unit_offset=unit_offset,
            heads=heads,
            device=device,
            dtype=dtype,
        )
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, elementwise_affine=affine, bias=bias, device=device, dtype=dtype)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps, elementwise_affine=affine, device=device, dtype=dtype)
    raise ValueError(f"a norm's kind must be 'layernorm' or 'rmsnorm', got {kind!r}")
