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
(:func:`specvit.nn.packed.few_rows_path`). :func:`quantize_int8` swaps every linear layer of a model.

Why not torchao: it would be a dependency whose releases each pin a torch version, for the one kernel
above, which torch itself ships.

Dim legend: N output features, K input features, M rows of the input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn import gemv, packed
from specvit.nn.gemv import MAX_ROWS
from specvit.nn.layers import TiedLinear

__all__ = ["Bf16Linear", "Int8Linear", "quantize_int8", "quantize_rows", "weight_only"]


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


class Int8Linear(nn.Module):
    """An inference-only linear layer with a weight-only int8 copy of another layer's weight.

    Args:
        linear: the layer to quantise: an ``nn.Linear`` or a tied output layer; its bias is kept as it is.
        dtype: the activations' dtype (bfloat16, float16 or float32); the output has it too. With float32,
            calls of more than ``MAX_ROWS`` rows run ``_weight_int8pack_mm`` in bfloat16. Layers whose input
            width is not a multiple of 16 multiply by the dequantised weight instead: torch 2.13's AVX-512
            ``_weight_int8pack_mm`` gives wrong sums or crashes for them.
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
            and packed.few_rows_path(rows, torch.int8, torch.get_num_threads()) == "native"
        ):
            return self._native(x, self.scale.dtype)  # (..., N)
        if self.in_features % 16:  # torch's AVX-512 kernel reads 16 columns at a time: wrong or a crash else
            dequantised = self.weight_int8.to(self.scale.dtype) * self.scale[:, None]  # (N, K)
            out = F.linear(flat.to(self.scale.dtype), dequantised)  # (M, N)
        else:  # the kernel is vectorised for bfloat16 activations: float32 ones run it in bfloat16
            act = torch.bfloat16 if self.scale.dtype == torch.float32 else self.scale.dtype
            out = torch._weight_int8pack_mm(
                flat.to(act).contiguous(), self.weight_int8, self.scale.to(act)
            ).to(self.scale.dtype)  # (M, N)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)  # (..., N)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Bf16Linear(nn.Module):
    """An inference-only linear layer holding a bfloat16 copy of another layer's weight (half the bytes a
    decode step reads), with activations, bias and output in float32.

    Calls of at most ``MAX_ROWS`` rows run the native kernel (:mod:`specvit.nn.gemv`: the bfloat16 weights read
    once, summed in float32) where it is available; more rows cast the weight to float32 for ``F.linear``.

    Args:
        linear: the layer to copy: an ``nn.Linear`` or a tied output layer.
    """

    weight: Tensor  # (N, K) bfloat16

    def __init__(self, linear: nn.Linear | TiedLinear) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).contiguous())
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self._native = gemv.Gemv(self.weight, bias=self.bias) if gemv.available() else None

    def forward(self, x: Tensor) -> Tensor:
        if self._native is not None and x.numel() <= MAX_ROWS * self.in_features:
            return self._native(x, x.dtype)  # (..., N)
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 weights"


def weight_only(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace, in place, every floating ``nn.Linear`` (specvit's ``Linear`` too) and tied output layer of
    ``model`` by one holding its weight in ``dtype``, the activations left as they are (float32): a
    :class:`Bf16Linear` or a float32 :class:`Int8Linear`; returns ``model``. Decoding reads the smaller weights
    and computes everything else at full precision.

    Args:
        model: the model, changed in place.
        dtype: ``torch.bfloat16`` or ``torch.int8``.
    """
    if dtype not in (torch.bfloat16, torch.int8):
        raise ValueError(f"weight_only stores weights as torch.bfloat16 or torch.int8, not {dtype}")
    for parent, name, child in _linears(model):
        layer = Bf16Linear(child) if dtype == torch.bfloat16 else Int8Linear(child, torch.float32)
        setattr(parent, name, layer)
    return model


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear | TiedLinear]]:
    """``(parent, attribute, layer)`` of every floating linear and tied output layer of ``model``."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear | TiedLinear) and child.weight.is_floating_point()
    ]


def quantize_int8(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` (specvit's ``Linear`` too) and tied output layer of ``model``
    by an :class:`Int8Linear` running in ``dtype``; returns ``model``. Embeddings, norms and everything else
    keep their weights: cast the model to ``dtype`` for the activations to be in it throughout.

    Args:
        model: the model, changed in place.
        dtype: the activations' dtype.
    """
    for parent, name, child in _linears(model):
        setattr(parent, name, Int8Linear(child, dtype))
    return model
