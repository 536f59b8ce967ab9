"""Linear layers with their weights pre-packed into oneDNN's blocked layout, for inference on CPU.

On CPU, ``F.linear`` hands a float32 weight to MKL as it is stored; at the one-token steps of generation
(a matrix-vector product per layer) that reads weights at a fraction of the memory bandwidth. oneDNN with the
weight reordered once into its blocked layout runs the same products about 1.6-2x faster on the 2-core
AVX-512 AMD EPYC of docs/performance.md (``python -m benchmarks``). :class:`PackedLinear` is such a layer;
:func:`packed_linears` swaps every eligible ``nn.Linear`` of a model for one while a block of inference
code runs (``generate`` does), and :func:`specvit.tuning.prepack` keeps the swap in a copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from specvit.nn.layers import TiedLinear
from specvit.nn.linear import Linear, onednn_available, packed_linear

__all__ = ["PackedLinear", "can_pack", "pack_linears", "packed_linears", "unpack_linears"]


Packable = nn.Linear | TiedLinear


class PackedLinear(nn.Module):
    """An inference-only linear layer whose weight is also held pre-packed for oneDNN.

    It holds the parameters of the layer it replaces under the same names (the state_dict keys stay the same;
    a tied layer's weight stays the embedding's); the forward uses the packed copy, which is not saved and
    does not follow later updates of the weight.

    Args:
        linear: the layer to pack: an ``nn.Linear`` or a :class:`~specvit.nn.layers.TiedLinear` output layer.
    """

    packed: Tensor  # the weight in oneDNN's blocked layout

    def __init__(self, linear: Packable):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        for name, param in linear.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.bias = linear.bias
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.packed, None if self.bias is None else self.bias.detach())  # (..., out)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def can_pack(module: nn.Module) -> bool:
    """Whether ``module`` is a float32 linear layer on the CPU (``nn.Linear``, specvit's or a tied output layer)
    and oneDNN is there to run it packed."""
    return (
        type(module) in (nn.Linear, Linear, TiedLinear)
        and isinstance(module.weight, Tensor)
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and onednn_available()
    )


Swapped = list[tuple[nn.Module, str, Packable]]  # (parent, attribute name, the original layer)


def pack_linears(*models: nn.Module, max_bytes: int | None = None) -> Swapped:
    """Replace, in place, every float32 CPU ``nn.Linear`` of ``models`` by a :class:`PackedLinear`.

    Args:
        models: the models (or parts of one) to swap layers in.
        max_bytes: pack nothing when the packed copies would take more than this (None: no limit).

    Returns:
        What was replaced, for :func:`unpack_linears`.
    """
    found: Swapped = [
        (parent, name, child)
        for model in models
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, Packable) and can_pack(child)
    ]
    if max_bytes is not None and sum(child.weight.nbytes for _, _, child in found) > max_bytes:
        return []
    for parent, name, child in found:
        setattr(parent, name, PackedLinear(child))
    return found


def unpack_linears(swapped: Swapped) -> None:
    """Put back the layers :func:`pack_linears` replaced."""
    for parent, name, child in swapped:
        setattr(parent, name, child)


@contextmanager
def packed_linears(*models: nn.Module, max_bytes: int | None = None) -> Iterator[None]:
    """Inside the block, every float32 CPU ``nn.Linear`` of ``models`` is a :class:`PackedLinear`.

    The packed copies take as much memory again as the weights they pack; they are dropped, and the original
    layers put back, when the block ends (also on an exception). Inference only: the packed copies carry no
    gradient and do not follow updates of the weights made inside the block.

    Args:
        models: the models (or parts of one) to swap layers in, in place.
        max_bytes: pack nothing when the packed copies would take more than this (None: no limit).
    """
    swapped: Swapped = []
    try:
        swapped = pack_linears(*models, max_bytes=max_bytes)
        yield
    finally:
        unpack_linears(swapped)
