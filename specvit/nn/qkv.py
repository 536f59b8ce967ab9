"""The heads of a packed projection (queries, keys, values), RoPE-rotated or not, as one autograd node.

Autograd's backward of the heads taken as views of one (..., L, heads * hd) projection concatenates their
gradients (queries with keys, then with values), then copies the result back to the projection's layout
for the projection's own backward: two passes over a tensor of the projection's size per layer, and with
RoPE torch's six ops of the rotation (halves, a negation, a concatenation, two products and a sum) and their
gradients. :func:`packed_heads` is one node whose backward writes the projection's gradient once, in that
layout, with torch's values bit for bit. It serves where a gradient flows (:func:`one_node`): without one,
the views and torch's ops cost less than a Function's call, a compiler fuses them itself, and ``torch.func``
transforms refuse a Function without ``setup_context``.

Dim legend: L tokens, hd head dim, r rotated channels (r <= hd).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from specvit.nn.linear import eager, tracked

__all__ = ["one_node", "packed_heads"]


def one_node(x: Tensor, rope: tuple[Tensor, Tensor] | None) -> bool:
    """Whether :func:`packed_heads` serves x: a gradient flows to x, a plain tensor of heads in eager code
    without a ``torch.func`` transform, and ``rope`` is None or rotate-half (L, r) tables without gradients.

    Args:
        x: (..., heads, L, hd) heads.
        rope: ``(cos, sin)`` tables, or None.
    """
    if rope is not None:
        cos, sin = rope
        if cos.dim() != 2 or cos.shape[-1] % 2 or cos.requires_grad or sin.requires_grad:
            return False
    return x.dim() >= 3 and type(x) is Tensor and tracked(x) and eager(x)


def _rotate_into(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> None:
    """Write RoPE's rotate-half rotation of x by (L, r) tables into ``out`` (x's shape, any strides), or with
    ``inverse`` the backward's (back by the angle); channels past r are copied. Each product is rounded before
    its sum, as in torch's ops (a fused multiply-add would differ from them in the last bit)."""
    r = cos.shape[-1]
    half = r // 2
    x1, x2, s1, s2 = x[..., :half], x[..., half:r], sin[..., :half], sin[..., half:r]
    torch.mul(x[..., :r], cos, out=out[..., :r])
    turn = torch.mul(x2, s2 if inverse else s1)  # (..., r/2)
    out[..., :half].add_(turn) if inverse else out[..., :half].sub_(turn)  # x1 cos -/+ x2 sin
    torch.mul(x1, s1 if inverse else s2, out=turn)
    out[..., half:r].sub_(turn) if inverse else out[..., half:r].add_(turn)  # x2 cos +/- x1 sin
    if r < x.shape[-1]:
        out[..., r:].copy_(x[..., r:])


class _PackedHeads(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, sizes: tuple[int, ...], cos: Tensor | None, sin: Tensor | None, rotated: int
    ) -> tuple[Tensor, ...]:
        parts = list(x.split(sizes, dim=-3))  # views of x
        if cos is not None and sin is not None and rotated:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            count = sum(sizes[:rotated])
            heads = x[..., :count, :, :]  # (..., count, L, hd)
            turned = torch.empty(heads.shape, dtype=x.dtype, device=x.device)
            _rotate_into(turned, heads, cos, sin, inverse=False)
            parts[:rotated] = turned.split(sizes[:rotated], dim=-3)
            ctx.save_for_backward(cos, sin)
        ctx.sizes, ctx.rotated = sizes, rotated
        ctx.shape, ctx.options = x.shape, {"dtype": x.dtype, "device": x.device}
        ctx.packed = x.transpose(-3, -2).is_contiguous()  # heads of a packed (..., L, heads * hd) projection
        return tuple(parts)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor, None, None, None, None]:
        *lead, heads, length, width = ctx.shape
        if ctx.packed:  # the gradient in the projection's own layout: its backward reads it as it is
            grad = torch.empty((*lead, length, heads, width), **ctx.options).transpose(-3, -2)
        else:
            grad = torch.empty(ctx.shape, **ctx.options)  # (..., heads, L, hd)
        tables = ctx.saved_tensors  # (cos, sin) if the forward rotated, else none
        for i, (part, into) in enumerate(zip(grads, grad.split(ctx.sizes, dim=-3), strict=True)):
            if part is None:
                into.zero_()
            elif tables and i < ctx.rotated:
                _rotate_into(into, part, tables[0], tables[1], inverse=True)
            else:
                into.copy_(part)
        return grad, None, None, None, None


def packed_heads(
    x: Tensor, sizes: tuple[int, ...], rope: tuple[Tensor, Tensor] | None = None, rotated: int = 0
) -> tuple[Tensor, ...]:
    """x's heads in groups of ``sizes`` heads, the first ``rotated`` groups rotated by RoPE, as one autograd
    node where :func:`one_node` holds (the caller checks it).

    Args:
        x: (..., heads, L, hd) heads, ``sum(sizes) == heads``: of a packed projection (a transposed view of
            (..., L, heads * hd)), whose layout the gradient takes, or of their own.
        sizes: heads per group (queries, keys, values).
        rope: rotate-half ``(cos, sin)`` (L, r) tables, cast to x's dtype, or None.
        rotated: how many groups, from the first, RoPE rotates.

    Returns:
        (..., size, L, hd) per group: the rotated ones views of one new tensor, the others views of x.
    """
    cos, sin = rope if rope is not None else (None, None)
    return tuple(_PackedHeads.apply(x, sizes, cos, sin, rotated))
