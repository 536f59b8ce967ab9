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
GB/s there), and specvit's own kernel (:mod:`specvit.nn.gemv`, where it builds) streams the weight at close to
the sum's rate, for float32 and bfloat16 weights alike. Which of them serves calls of a few rows is measured
once per process (:func:`few_rows_path`); the packed weight serves the calls of more rows. Where the repeated
calls (``packed_linears(..., step_rows=B)``: a decode step's B rows) do not take the packed product, nothing
is packed: the reorder (a pass over every weight, 0.2 s for a 135M-parameter model) would serve only the
prompt's one call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn import gemv
from specvit.nn.gemv import MAX_ROWS
from specvit.nn.layers import TiedLinear
from specvit.nn.linear import Linear, fastest, onednn_available, onednn_linear, packed_linear

__all__ = [
    "PackedLinear",
    "can_pack",
    "few_rows_path",
    "pack_linears",
    "packed_linears",
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


Kernel = Literal["native", "split", "packed", "linear"]


def few_rows_path(rows: int, dtype: torch.dtype, threads: int) -> Kernel:
    """The fastest product of ``rows`` rows (at most ``MAX_ROWS``) with ``dtype`` weights on this machine:
    ``native`` (:mod:`specvit.nn.gemv`), ``split`` (:func:`split_linear`; float32, at most ``SPLIT_ROWS`` rows,
    two threads or more), ``packed`` (float32, oneDNN) or ``linear`` (torch's own product: ``F.linear``, or
    ``_weight_int8pack_mm`` with bfloat16 activations for int8; MKL's float32 one-row product streamed at
    about 90% of the read rate on a 2-core AVX-512 Xeon, and at 42% on the AVX2 EPYC). Measured at 1 row up to
    ``SPLIT_ROWS`` rows and at ``MAX_ROWS`` above, once per process, dtype and thread count."""
    return _measured(1 if rows <= SPLIT_ROWS else MAX_ROWS, dtype, threads)


@functools.cache
def _measured(rows: int, dtype: torch.dtype, threads: int) -> Kernel:
    """:func:`few_rows_path` timed over 64 MB of (1024, 1024) weights (more than a cache holds, as a model's
    are)."""
    weights = [torch.ones(1024, 1024, dtype=dtype) for _ in range(64 // dtype.itemsize)]
    act = torch.bfloat16 if dtype == torch.int8 else dtype
    x, scale = torch.ones(rows, 1024, dtype=act), torch.ones(1024, dtype=act)
    runs: dict[str, Callable[[], object]] = {}
    if gemv.available():
        kernels = [gemv.Gemv(w, scale if dtype == torch.int8 else None) for w in weights]
        # int8 as decoding calls it, on float32 rows (torch's int8 kernel converts them to bfloat16); the
        # other dtypes on rows of their own dtype, as a model of that dtype calls its PackedLinear layers
        rows_in = x.float() if dtype == torch.int8 else x
        runs["native"] = lambda: [k(rows_in) for k in kernels]
    if dtype == torch.float32:
        if rows <= SPLIT_ROWS and threads > 1:
            blocks = _blocks(1024)
            runs["split"] = lambda: [split_linear(x, w, None, blocks) for w in weights]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        runs["packed"] = lambda: [packed_linear(x, p, None) for p in packed]
        runs["linear"] = lambda: [F.linear(x, w) for w in weights]
    elif dtype == torch.int8:
        runs["linear"] = lambda: [torch._weight_int8pack_mm(x, w, scale) for w in weights]
    else:
        runs["linear"] = lambda: [F.linear(x, w) for w in weights]
    return cast(Kernel, fastest(runs))


class PackedLinear(nn.Module):
    """An inference-only linear layer for decoding on CPU: a float32 weight also held pre-packed for oneDNN,
    and calls of a few rows run by the kernel measured fastest here (:func:`few_rows_path`).

    It holds the parameters of the layer it replaces under the same names (the state_dict keys stay the same;
    a tied layer's weight stays the embedding's); the packed copy is not saved and does not follow later
    updates of the weight.

    Args:
        linear: the layer to swap: an ``nn.Linear`` or a :class:`~specvit.nn.layers.TiedLinear` output layer,
            with float32 or bfloat16 weights.
        pack: hold the packed copy (float32 weights); without it, calls of more rows run as
            :class:`~specvit.nn.linear.Linear` does (:func:`~specvit.nn.linear.onednn_linear`).
    """

    packed: Tensor | None  # the weight in oneDNN's blocked layout, or None when not packed

    def __init__(self, linear: Packable, pack: bool = True):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        for name, param in linear.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.bias = linear.bias
        weight = linear.weight.detach()
        packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight)
            if pack and weight.dtype == torch.float32
            else None
        )
        self.register_buffer("packed", packed, persistent=False)
        self.blocks = _blocks(self.out_features) if weight.is_contiguous() else 1
        self._plain = (weight,)  # outside the module's tensors (a tied layer's is the embedding's)
        native = gemv.available() and weight.is_contiguous()
        self._native = gemv.Gemv(weight, bias=self.bias) if native else None

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self._plain[0], None if self.bias is None else self.bias.detach()
        rows = x.numel() // self.in_features
        if rows <= MAX_ROWS:
            path = few_rows_path(rows, weight.dtype, torch.get_num_threads())
            if path == "native" and self._native is not None:
                return self._native(x, x.dtype)  # (..., out)
            if path == "split" and rows <= SPLIT_ROWS and self.blocks > 1:
                return split_linear(x, weight, bias, self.blocks)  # (..., out)
            if path == "linear":
                return F.linear(x, weight, bias)  # (..., out)
        if self.packed is None:
            return onednn_linear(x, weight, bias)  # (..., out)
        return packed_linear(x, self.packed, bias)  # (..., out)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def can_pack(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer on the CPU (``nn.Linear``, specvit's or a tied output layer) that a
    :class:`PackedLinear` runs faster: float32 weights with oneDNN there, or bfloat16 ones with the native
    kernel (:mod:`specvit.nn.gemv`)."""
    if type(module) not in (nn.Linear, Linear, TiedLinear):
        return False
    weight = module.weight
    if not isinstance(weight, Tensor) or weight.device.type != "cpu":
        return False
    return (weight.dtype == torch.float32 and onednn_available()) or (
        weight.dtype == torch.bfloat16 and gemv.available()
    )


Swapped = list[tuple[nn.Module, str, Packable]]  # (parent, attribute name, the original layer)


def pack_linears(*models: nn.Module, max_bytes: int | None = None, step_rows: int | None = None) -> Swapped:
    """Replace, in place, every linear layer of ``models`` that :func:`can_pack` accepts by a
    :class:`PackedLinear`.

    Args:
        models: the models (or parts of one) to swap layers in.
        max_bytes: swap nothing when the packed copies would take more than this (None: no limit).
        step_rows: the rows of the calls that repeat (a decode step's: one per sequence), or None; when they
            do not take the packed product (:func:`few_rows_path`), the layers are swapped without packed
            copies.

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
    pack = (
        step_rows is None
        or step_rows > MAX_ROWS
        or few_rows_path(step_rows, torch.float32, torch.get_num_threads()) == "packed"
    )
    packed_bytes = sum(child.weight.nbytes for _, _, child in found if child.weight.dtype == torch.float32)
    if pack and max_bytes is not None and packed_bytes > max_bytes:
        return []
    for parent, name, child in found:
        setattr(parent, name, PackedLinear(child, pack))
    return found


def unpack_linears(swapped: Swapped) -> None:
    """Put back the layers :func:`pack_linears` replaced."""
    for parent, name, child in swapped:
        setattr(parent, name, child)


@contextmanager
def packed_linears(
    *models: nn.Module, max_bytes: int | None = None, step_rows: int | None = None
) -> Iterator[None]:
    """Inside the block, every linear layer of ``models`` that :func:`can_pack` accepts is a :class:`PackedLinear`.

    The packed copies take as much memory again as the weights they pack; they are dropped, and the original
    layers put back, when the block ends (also on an exception). Inference only: the packed copies carry no
    gradient and do not follow updates of the weights made inside the block.

    Args:
        models: the models (or parts of one) to swap layers in, in place.
        max_bytes: pack nothing when the packed copies would take more than this (None: no limit).
        step_rows: the rows of the calls that repeat; see :func:`pack_linears`.
    """
    swapped: Swapped = []
    try:
        swapped = pack_linears(*models, max_bytes=max_bytes, step_rows=step_rows)
        yield
    finally:
        unpack_linears(swapped)
