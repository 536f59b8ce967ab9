"""Linear layers with their weights pre-packed into oneDNN's blocked layout, for inference on CPU.

On CPU, ``F.linear`` hands a float32 weight to MKL as it is stored; at the one-token steps of generation
(a matrix-vector product per layer) that reads weights at a fraction of the memory bandwidth. oneDNN with the
weight reordered once into its blocked layout runs the same products about 1.6-2x faster on the 2-core
AVX-512 AMD EPYC of docs/performance.md (``python -m benchmarks``). :class:`PackedLinear` is such a layer;
:func:`packed_linears` swaps every eligible ``nn.Linear`` of a model for one while a block of inference
code runs (``generate`` does), and :func:`specvit.tuning.prepack` keeps the swap in a copy.

A step that decodes one token per sequence gives each linear a single row, and both MKL and oneDNN run that
matrix-vector product on one thread: on the 2-core AVX2 AMD EPYC, 11 GB/s (MKL) and 13-15 GB/s (oneDNN
packed) of weights, where a sum over the same bytes reads 21-28 GB/s. :func:`split_linear` computes it as
a batch of products over blocks of the weight's rows, which the batched product spreads over the threads (19
GB/s there). Which of the two serves one-row calls is measured once per process and thread count
(:func:`split_is_faster`); the packed weight serves every call of more rows.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from specvit.nn.layers import TiedLinear
from specvit.nn.linear import Linear, first_is_faster, onednn_available, packed_linear

__all__ = [
    "PackedLinear",
    "can_pack",
    "pack_linears",
    "packed_linears",
    "split_is_faster",
    "split_linear",
    "unpack_linears",
]


Packable = nn.Linear | TiedLinear

SPLIT_ROWS = 2
"""Calls of at most this many rows may take :func:`split_linear`; from 4 rows oneDNN's packed product reads the
weights faster than the split one (batch 8: 11 GB/s packed, 10 GB/s split, 6 GB/s MKL on the AVX2 EPYC)."""


def _blocks(out_features: int) -> int:
    """How many row blocks :func:`split_linear` cuts a weight of ``out_features`` rows into: two per thread
    when that divides the rows, else one per thread, else 1 (no split)."""
    threads = torch.get_num_threads()
    return next((p for p in (2 * threads, threads) if p > 1 and out_features % p == 0), 1)


def split_linear(x: Tensor, weight: Tensor, bias: Tensor | None, blocks: int) -> Tensor:
    """``x @ weight.T + bias`` as ``blocks`` batched products over contiguous blocks of the weight's rows.

    Args:
        x: (..., in) inputs, a few rows.
        weight: (out, in), contiguous, ``out`` divisible by ``blocks``.
        bias: (out,) or None.
        blocks: the number of row blocks.

    Returns:
        (..., out), equal to ``F.linear`` to float32 rounding.
    """
    rows = x.reshape(-1, x.shape[-1])  # (R, in)
    parts = weight.view(blocks, -1, weight.shape[1]).transpose(1, 2)  # (P, in, out/P)
    expanded = rows.expand(blocks, *rows.shape)  # (P, R, in), no copy
    if bias is None:
        y = torch.bmm(expanded, parts)  # (P, R, out/P)
    else:
        y = torch.baddbmm(bias.view(blocks, 1, -1), expanded, parts)  # (P, R, out/P)
    return y.transpose(0, 1).reshape(*x.shape[:-1], weight.shape[0])  # (..., out)


@functools.cache
def split_is_faster(threads: int) -> bool:
    """Whether :func:`split_linear` runs one-row products faster than oneDNN's packed weights with ``threads``
    threads, over 64 MB of (1024, 1024) weights (more than a cache holds, as a model's are); measured once per
    process and thread count."""
    if threads < 2:
        return False
    weights = [torch.ones(1024, 1024) for _ in range(16)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    x, blocks = torch.ones(1, 1024), _blocks(1024)
    return first_is_faster(
        lambda: [split_linear(x, w, None, blocks) for w in weights],
        lambda: [packed_linear(x, p, None) for p in packed],
    )


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
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False)
        self.blocks = _blocks(self.out_features)
        # the plain weight for split one-row products, outside the module's tensors (a tied one is the embedding's)
        self._plain = (weight,) if self.blocks > 1 and weight.is_contiguous() else None

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.detach()
        if (
            self._plain is not None
            and x.numel() <= SPLIT_ROWS * self.in_features
            and split_is_faster(torch.get_num_threads())
        ):
            return split_linear(x, self._plain[0], bias, self.blocks)  # (..., out)
        return packed_linear(x, self.packed, bias)  # (..., out)

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
