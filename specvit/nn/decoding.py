"""A decode step's small steps on CPU in one native call each, while ``generate`` steps.

A decode step's layers are short of arithmetic: beside the products (:mod:`specvit.nn.gemv`), each op costs
a few microseconds however few its rows. torch runs an RMSNorm as seven ops (about 11 µs for a row of 576),
the rotate-half RoPE of queries and keys as six and SwiGLU's gating as three (with three module calls);
``gemv.c`` does each in one call that computes the same values (RoPE exactly, the norm with its sum of
squares in another order, SwiGLU with an exp of its own). Inside :func:`native_steps`, every RMSNorm and
SwiGLU MLP of the models runs them, and every attention core that rotates queries and keys in one call
(``rope_together``) does so natively; calls they do not serve (grad mode on, more than ``MAX_ROWS`` rows,
another dtype or layout) run torch's ops as before.

Dim legend: L positions, H query heads, Hkv key/value heads, hd head dim, r channels rotated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple, TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn import gemv
from specvit.nn.attend import split_parts
from specvit.nn.attend import split_rotated as torch_split_rotated
from specvit.nn.attention import Attention
from specvit.nn.mlp import GluMlp
from specvit.nn.norm import Norm

__all__ = [
    "NormSettings",
    "RowsRMSNorm",
    "RowsSwiGLU",
    "is_rms_norm",
    "is_swiglu",
    "native_steps",
    "norm_settings",
    "split_rotated",
]


def _served(t: Tensor, width: int) -> bool:
    """Whether the native kernels take t: float32 rows of ``width``, at most ``MAX_ROWS``, contiguous on the
    CPU, outside grad mode (they are not differentiable)."""
    return (
        t.dtype == torch.float32
        and t.is_cpu
        and not torch.is_grad_enabled()
        and t.shape[-1] == width
        and t.numel() <= gemv.MAX_ROWS * width
        and t.is_contiguous()
    )


def is_rms_norm(module: nn.Module) -> TypeGuard[nn.RMSNorm | Norm]:
    """Whether ``module`` is an RMSNorm over a token's last dim: torch's, or a :class:`Norm` of one."""
    if isinstance(module, nn.RMSNorm):
        return len(module.normalized_shape) == 1
    return isinstance(module, Norm) and module.kind == "rmsnorm" and module.heads is None


class NormSettings(NamedTuple):
    """What a norm over D channels computes: ``kind`` 0 for RMSNorm and 1 for LayerNorm, its weight (scaling by
    ``offset + weight``), bias and eps."""

    kind: int
    dim: int
    weight: Tensor | None
    bias: Tensor | None
    eps: float
    offset: float


def norm_settings(module: nn.Module) -> NormSettings | None:
    """The settings of torch's RMSNorm or LayerNorm over one dim, or of a :class:`Norm` (with ``heads``: over all
    of a token's heads at once); None for any other module."""
    if isinstance(module, Norm):
        kind = int(module.kind == "layernorm")
        return NormSettings(
            kind, module.dim, module.weight, module.bias, module.eps, float(module.unit_offset)
        )
    if isinstance(module, nn.RMSNorm | nn.LayerNorm) and len(module.normalized_shape) == 1:
        eps = torch.finfo(torch.float32).eps if module.eps is None else module.eps
        kind, bias = int(isinstance(module, nn.LayerNorm)), getattr(module, "bias", None)
        return NormSettings(kind, module.normalized_shape[0], module.weight, bias, eps, 0.0)
    return None


class RowsRMSNorm(nn.Module):
    """An RMSNorm (torch's or a :class:`Norm`) whose calls of a few float32 rows run natively
    (:func:`specvit.nn.gemv.rms_norm`); it holds the norm's weight under the same name.

    Args:
        norm: the norm it stands for (:func:`is_rms_norm`).
    """

    def __init__(self, norm: nn.RMSNorm | Norm) -> None:
        super().__init__()
        settings = norm_settings(norm)
        assert settings is not None, "an RMSNorm (is_rms_norm)"
        self.weight = norm.weight
        self.dim, self.eps, self.offset = settings.dim, settings.eps, settings.offset
        self._plain = (norm,)  # outside the module's children: the state_dict keeps the norm's keys

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if _served(x, self.dim) and (weight is None or weight.dtype == torch.float32):
            return gemv.rms_norm(x, None if weight is None else weight.contiguous(), self.eps, self.offset)
        return self._plain[0](x)


def is_swiglu(module: nn.Module) -> TypeGuard[GluMlp]:
    """Whether ``module`` is a SwiGLU :class:`GluMlp` with no inner norm and no dropout."""
    return (
        isinstance(module, GluMlp)
        and isinstance(module.act, nn.SiLU)
        and module.norm is None
        and isinstance(module.drop1, nn.Identity)
        and isinstance(module.drop2, nn.Identity)
    )


class RowsSwiGLU(nn.Module):
    """A SwiGLU MLP (:func:`is_swiglu`) whose gating of a few float32 rows runs natively
    (:func:`specvit.nn.gemv.swiglu`), and that calls no module of its dropouts and activation; it holds the
    MLP's ``fc1`` and ``fc2`` under their names.

    Args:
        mlp: the MLP it stands for.
    """

    def __init__(self, mlp: GluMlp) -> None:
        super().__init__()
        self.fc1, self.fc2 = mlp.fc1, mlp.fc2

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)  # (B, N, 2F)
        if _served(h, h.shape[-1]):
            return self.fc2(gemv.swiglu(h))  # (B, N, D)
        gate, value = h.chunk(2, dim=-1)  # (B, N, F) each
        return self.fc2(F.silu(gate) * value)  # (B, N, D)


def split_rotated(
    t: Tensor, heads: tuple[int, int], head_dim: int, rope: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`specvit.nn.attend.split_rotated` with the rotation in one native call where it serves (the
    same values).

    Args:
        t: (..., L, (H + 2 Hkv) * hd) the projection.
        heads: (H, Hkv).
        head_dim: hd.
        rope: ``(cos, sin)`` tables of the L positions.
    """
    (h, hkv), (cos, sin) = heads, rope
    tables = all(c.dtype == torch.float32 and c.is_contiguous() and c.dim() == 2 for c in (cos, sin))
    if (
        tables
        and _served(t, (h + 2 * hkv) * head_dim)
        and cos.shape == sin.shape
        and cos.shape[0] == t.shape[-2]
        and cos.shape[1] % 2 == 0
        and cos.shape[1] <= head_dim
    ):
        rotated = gemv.rope_half(t, cos, sin, h + hkv, head_dim)  # (..., L, (H + 2 Hkv) * hd)
        q, k, v = split_parts(rotated, ((h, head_dim), (hkv, head_dim), (hkv, head_dim)))
        return q, k, v  # (..., H, L, hd), (..., Hkv, L, hd), (..., Hkv, L, hd)
    return torch_split_rotated(t, heads, head_dim, rope)


def _stand_in(module: nn.Module) -> nn.Module | None:
    """The module that runs ``module``'s few rows natively, or None."""
    if is_rms_norm(module):
        return RowsRMSNorm(module)
    return RowsSwiGLU(module) if is_swiglu(module) else None


@contextmanager
def native_steps(*models: nn.Module) -> Iterator[None]:
    """Inside the block, the RMSNorms of ``models`` are :class:`RowsRMSNorm`, their SwiGLU MLPs
    :class:`RowsSwiGLU`, and their attention cores rotate queries and keys with :func:`split_rotated`; put back
    as they were when it ends (also on an exception).
    Nothing changes where the kernels are not available (:func:`specvit.nn.gemv.available`).

    Args:
        models: the models (or parts of one) to change, in place.
    """
    if not gemv.available():
        yield
        return
    swapped = [
        (parent, name, child, native)
        for model in models
        for parent in model.modules()
        for name, child in parent.named_children()
        if (native := _stand_in(child)) is not None
    ]
    cores = [m for model in models for m in model.modules() if isinstance(m, Attention) and m.rope_together]
    try:
        for parent, name, _, native in swapped:
            setattr(parent, name, native)
        for core in cores:
            core.native_rope = split_rotated
        yield
    finally:
        for parent, name, child, _ in swapped:
            setattr(parent, name, child)
        for core in cores:
            core.native_rope = None
