"""Normalisation ops: LayerNorm and RMSNorm over the last dim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specvit.ops.base import Op, Params, op

__all__ = ["NORM_KINDS", "NormParams", "norm_params"]


@dataclass(frozen=True)
class NormParams(Params):
    """A norm over the last ``dim`` features.

    Args:
        dim: the features normalised.
        eps: added to the variance.
        bias: a learned bias (LayerNorm only; RMSNorm has none).
    """

    dim: int
    eps: float
    bias: bool = True


def norm_params(kind: str, dim: int, bias: bool) -> int:
    """Parameters of a norm of ``kind`` over ``dim`` features."""
    return dim * (2 if kind == "layernorm" and bias else 1)


class _Norm(Op):
    params_type = NormParams
    category = "norm"

    def params(self, p: NormParams) -> int:
        return norm_params(self.kind, p.dim, p.bias)

    def label(self, p: NormParams) -> tuple[str, ...]:
        return (f"eps {p.eps:g}" + ("" if p.bias or self.kind != "layernorm" else " · no bias"),)


@op
class LayerNorm(_Norm):
    kind = "layernorm"
    module = "torch.nn:LayerNorm"

    def ctor(self, p: NormParams) -> dict[str, Any]:
        return {"normalized_shape": p.dim, "eps": p.eps, "bias": p.bias}


@op
class RMSNorm(_Norm):
    kind = "rmsnorm"
    module = "torch.nn:RMSNorm"

    def ctor(self, p: NormParams) -> dict[str, Any]:
        return {"normalized_shape": p.dim, "eps": p.eps}


NORM_KINDS = ("layernorm", "rmsnorm")
"""The ``norm.kind`` values a spec may write: every registered norm op."""
