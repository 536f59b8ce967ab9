"""A decode step's small steps on CPU in one native call each, while ``generate`` steps.

A decode step's layers are short of arithmetic: beside the products (:mod:`specvit.nn.gemv`), each op costs
a few microseconds however few its rows. torch runs an RMSNorm as seven ops (about 11 µs for a row of 576)
and the rotate-half RoPE of queries and keys as six; ``gemv.c`` does each in one call that computes the same
values (RoPE exactly, the norm with its sum of squares in another order). Inside :func:`native_steps`, every
RMSNorm of the models runs it, and every attention core that rotates queries and keys in one call
(``rope_together``) does so natively; calls it does not serve (grad mode on, more than ``MAX_ROWS`` rows,
another dtype or layout) run torch's ops as before.

Dim legend: L positions, H query heads, Hkv key/value heads, hd head dim, r channels rotated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeGuard

import torch
from torch import Tensor, nn

from specvit.nn import gemv
from specvit.nn.attend import split_parts
from specvit.nn.attend import split_rotated as torch_split_rotated
from specvit.nn.attention import Attention
from specvit.nn.norm import Norm

__all__ = ["RowsRMSNorm", "is_rms_norm", "native_steps", "split_rotated"]


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


class RowsRMSNorm(nn.Module):
    """An RMSNorm (torch's or a :class:`Norm`) whose calls of a few float32 rows run natively
    (:func:`specvit.nn.gemv.rms_norm`); it holds the norm's weight under the same name.

    Args:
        norm: the norm it stands for (:func:`is_rms_norm`).
    """

    def __init__(self, norm: nn.RMSNorm | Norm) -> None:
        super().__init__()
        self.weight = norm.weight
        if isinstance(norm, Norm):
            self.dim, self.eps, self.offset = norm.dim, norm.eps, float(norm.unit_offset)
        else:
            self.dim, self.offset = norm.normalized_shape[0], 0.0
            self.eps = torch.finfo(torch.float32).eps if norm.eps is None else norm.eps
        self._plain = (norm,)  # outside the module's children: the state_dict keeps the norm's keys

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if _served(x, self.dim) and (weight is None or weight.dtype == torch.float32):
            return gemv.rms_norm(x, None if weight is None else weight.contiguous(), self.eps, self.offset)
        return self._plain[0](x)


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


@contextmanager
def native_steps(*models: nn.Module) -> Iterator[None]:
    """Inside the block, the RMSNorms of ``models`` are :class:`RowsRMSNorm` and their attention cores rotate
    queries and keys with :func:`split_rotated`; put back as they were when it ends (also on an exception).
    Nothing changes where the kernels are not available (:func:`specvit.nn.gemv.available`).

    Args:
        models: the models (or parts of one) to change, in place.
    """
    if not gemv.available():
        yield
        return
    norms = [
        (parent, name, child)
        for model in models
        for parent in model.modules()
        for name, child in parent.named_children()
        if is_rms_norm(child)
    ]
    cores = [m for model in models for m in model.modules() if isinstance(m, Attention) and m.rope_together]
    try:
        for parent, name, child in norms:
            setattr(parent, name, RowsRMSNorm(child))
        for core in cores:
            core.native_rope = split_rotated
        yield
    finally:
        for parent, name, child in norms:
            setattr(parent, name, child)
        for core in cores:
            core.native_rope = None
