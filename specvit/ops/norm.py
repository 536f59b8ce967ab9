"""Normalisation ops: LayerNorm and RMSNorm over the last dim, with or without a learned weight, scaled by
``w`` or by ``1 + w``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from specvit.ops.base import Op, Params, op

__all__ = ["NORM_KINDS", "NormParams", "NormSettings", "norm_params"]


@dataclass(frozen=True)
class NormParams(Params):
    """A norm over the last ``dim`` features.

    Args:
        dim: the features normalised.
        eps: added to the variance.
        bias: a learned bias (LayerNorm only; RMSNorm has none).
        affine: a learned weight (and bias); false: none (OLMo).
        unit_offset: the weight scales by ``1 + w`` (Gemma's RMSNorm, Nemotron's LayerNorm1P).
    """

    dim: int
    eps: float
    bias: bool = True
    affine: bool = True
    unit_offset: bool = False

    @classmethod
    def of(cls, norm: NormSettings, dim: int) -> NormParams:
        """The params of a spec's ``norm:`` over ``dim`` features."""
        return cls(dim, norm.eps, norm.bias, norm.affine, norm.unit_offset)

    def ctor_args(self) -> dict[str, Any]:
        """The keyword arguments of :func:`specvit.nn.norm.make_norm` past kind and dim, the defaults left out."""
        out: dict[str, Any] = {"eps": self.eps}
        out |= {} if self.bias else {"bias": False}
        out |= {} if self.affine else {"affine": False}
        return out | ({"unit_offset": True} if self.unit_offset else {})


class NormSettings(Protocol):
    """What a norm reads of a spec's ``norm:`` (:class:`specvit.spec.block.NormSpec`)."""

    eps: float
    bias: bool
    affine: bool
    unit_offset: bool


def norm_params(kind: str, dim: int, bias: bool, affine: bool = True) -> int:
    """Parameters of a norm of ``kind`` over ``dim`` features."""
    if not affine:
        return 0
    return dim * (2 if kind == "layernorm" and bias else 1)


class _Norm(Op):
    params_type = NormParams
    category = "norm"

    def params(self, p: NormParams) -> int:
        return norm_params(self.kind, p.dim, p.bias, p.affine)

    def module_for(self, p: NormParams) -> str | None:
        return "specvit.nn.norm:Norm" if p.unit_offset else self.module

    def ctor(self, p: NormParams) -> dict[str, Any]:
        if p.unit_offset:
            return {"dim": p.dim, "kind": self.kind, **p.ctor_args()}
        affine = {} if p.affine else {"elementwise_affine": False}
        bias = {"bias": p.bias} if self.kind == "layernorm" else {}
        return {"normalized_shape": p.dim, "eps": p.eps, **affine, **bias}

    def label(self, p: NormParams) -> tuple[str, ...]:
        flags = [f"eps {p.eps:g}"]
        flags += ["no bias"] if not p.bias and self.kind == "layernorm" and p.affine else []
        flags += [] if p.affine else ["no weight"]
        flags += ["scale 1 + w"] if p.unit_offset else []
        return (" · ".join(flags),)


@op
class LayerNorm(_Norm):
    kind = "layernorm"
    module = "torch.nn:LayerNorm"


@op
class RMSNorm(_Norm):
    kind = "rmsnorm"
    module = "torch.nn:RMSNorm"


NORM_KINDS = ("layernorm", "rmsnorm")
"""The ``norm.kind`` values a spec may write: every registered norm op."""
