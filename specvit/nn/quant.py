"""Weight-only int8 linear layers, for decoding from a quarter of float32's weight bytes.

Decoding one token reads every weight once and does two FLOPs per weight it reads: on a CPU its time is
the bytes of the weights over the memory's read rate. :class:`Int8Linear` keeps a linear layer's weight as
int8 with one float scale per output channel (symmetric: ``w ≈ q * scale``, ``q = round(w / scale)``,
``scale = max |w| of the row / 127``) and multiplies through ``torch._weight_int8pack_mm``, the kernel that
dequantises inside the product (the one torchao's int8 weight-only layout calls on CPU). It runs with
bfloat16 (or float16) activations: with float32 ones the kernel is not vectorised on AVX2 CPUs and was
slower than the float32 product it replaces. Calls of at most ``MAX_ROWS`` rows (decode steps) take specvit's
own kernel instead (:mod:`specvit.nn.gemv`: the int8 weights streamed once over the threads, about twice the
rate of ``_weight_int8pack_mm`` on the 2-core AVX2 EPYC), where it builds and is measured faster
(:func:`native_is_faster`). :func:`quantize_int8` swaps every linear layer of a model.

Why not torchao: it would be a dependency whose releases each pin a torch version, for the one kernel
above, which torch itself ships.

Dim legend: N output features, K input features, M rows of the input.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from specvit.nn import gemv
from specvit.nn.gemv import MAX_ROWS
from specvit.nn.layers import TiedLinear
from specvit.nn.linear import fastest

__all__ = ["Int8Linear", "native_is_faster", "quantize_int8", "quantize_rows"]


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: ``(q, scale)`` with ``weight ≈ q * scale[:, None]``.

    Args:
        weight: (N, K) floating weight.

    Returns:
        (N, K) int8 and (N,) float32 scales (a row of zeros gets scale 1).
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)  # (N,)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scale


@functools.cache
def native_is_faster(rows: int, threads: int) -> bool:
    """Whether the native kernel runs products of ``rows`` rows (at most ``MAX_ROWS``) with int8 weights faster
    than ``torch._weight_int8pack_mm`` with bfloat16 activations, over 64 MB of (1024, 1024) weights with
    ``threads`` threads; measured once per process (False where the kernel is not available)."""
    if not gemv.available():
        return False
    weights = [torch.ones(1024, 1024, dtype=torch.int8) for _ in range(64)]
    scale, x = torch.ones(1024, dtype=torch.bfloat16), torch.ones(rows, 1024, dtype=torch.bfloat16)
    kernels = [gemv.Gemv(w, scale) for w in weights]
    runs = {
        "native": lambda: [k(x) for k in kernels],
        "torch": lambda: [torch._weight_int8pack_mm(x, w, scale) for w in weights],
    }
    return fastest(runs) == "native"


class Int8Linear(nn.Module):
    """An inference-only linear layer with a weight-only int8 copy of another layer's weight.

    Args:
        linear: the layer to quantise: an ``nn.Linear`` or a tied output layer; its bias is kept as it is.
        dtype: the activations' dtype (bfloat16 or float16); the output has it too.
    """

    weight_int8: Tensor  # (N, K)
    scale: Tensor  # (N,) in ``dtype``

    def __init__(self, linear: nn.Linear | TiedLinear, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        q, scale = quantize_rows(linear.weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(dtype))
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self._native = gemv.Gemv(q, scale, self.bias) if gemv.available() else None  # float32 scale

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        rows = flat.shape[0]
        if (
            self._native is not None
            and rows <= MAX_ROWS
            and native_is_faster(1 if rows == 1 else MAX_ROWS, torch.get_num_threads())
        ):
            return self._native(x).to(self.scale.dtype)  # (..., N)
        if flat.dtype != self.scale.dtype:
            flat = flat.to(self.scale.dtype)
        out = torch._weight_int8pack_mm(flat.contiguous(), self.weight_int8, self.scale)  # (M, N)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)  # (..., N)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int8(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` (specvit's ``Linear`` too) and tied output layer of ``model``
    by an :class:`Int8Linear` running in ``dtype``; returns ``model``. Embeddings, norms and everything else
    keep their weights: cast the model to ``dtype`` for the activations to be in it throughout.

    Args:
        model: the model, changed in place.
        dtype: the activations' dtype.
    """
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear | TiedLinear) and child.weight.is_floating_point()
    ]
    for parent, name, child in found:
        setattr(parent, name, Int8Linear(child, dtype))
    return model
