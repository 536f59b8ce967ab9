"""The edges of a tensor-parallel region that a layer computes by hand (the mixture-of-experts MLP): enter
with the tokens replicated on every rank, leave with every rank's partial result summed.

Megatron-LM's two conjugate operators: :func:`enter_region` is the identity forward and sums the gradients
of the ranks backward (each rank differentiates only its own part); :func:`leave_region` sums the ranks'
partial outputs forward and passes the gradient through backward. Both are the identity without a group.
:func:`local` is a parameter's shard on this rank (a ``DTensor``'s local tensor, or the tensor itself).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx
from torch.distributed.tensor import DTensor

__all__ = ["enter_region", "leave_region", "local"]


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor`` (differentiable), else ``t`` itself.

    Args:
        t: a parameter, sharded or not.
    """
    return t.to_local() if isinstance(t, DTensor) else t


def _all_reduce(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = t.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def enter_region(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``x`` unchanged; backward, the gradient summed over ``group`` (each rank's covers its own part).

    Args:
        x: a tensor every rank of the group holds whole.
        group: the tensor-parallel group, or None (then the identity).
    """
    return x if group is None else _Enter.apply(x, group)


def leave_region(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The sum of ``x`` over ``group`` (each rank's partial result); backward, the gradient unchanged.

    Args:
        x: this rank's partial result.
        group: the tensor-parallel group, or None (then the identity).
    """
    return x if group is None else _Leave.apply(x, group)
