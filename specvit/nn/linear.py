"""The linear layer of every compiled model: ``nn.Linear``, with a faster path for float32 on CPU.

On CPU, ``F.linear`` hands the weight to MKL as it is stored. oneDNN with the weight reordered once into its
blocked layout runs the same products faster: on the 2-core AVX-512 AMD EPYC of docs/performance.md, ViT-B/16's
GEMMs at batch 8 run about 1.2x faster, and a whole training step (forward, backward, AdamW) about 1.1x
faster, the reorders included (``python -m benchmarks``); on the 2-core AVX2 EPYC the same GEMMs run about
1.15x slower through oneDNN. :class:`Linear` takes that path for its float32 forward on a CPU where it is
faster (measured once per process: :func:`onednn_is_faster`), in training and inference alike, from
``MIN_ROWS`` input rows on; both gradients stay MKL
products (oneDNN gains nothing on the input's once the transposed weight is reordered, which costs 10x the
plain reorder). Everywhere else (fewer rows, other dtypes and devices, autocast, DTensor weights,
torch.compile and export, which pick their own kernels, and under dispatch modes such as
``FlopCounterMode``) it is exactly ``nn.Linear``. Results agree with ``F.linear`` to float32 rounding.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "Linear",
    "Recompute",
    "autograd_recompute",
    "eager",
    "eager_cpu_float32",
    "fastest",
    "first_is_faster",
    "hooked",
    "onednn_available",
    "onednn_is_faster",
    "onednn_linear",
    "packed_linear",
    "recomputed_linear",
    "recomputes",
    "tracked",
    "uses_onednn",
]


def onednn_available() -> bool:
    """oneDNN is built in and not disabled (``torch.backends.mkldnn.enabled``)."""
    return torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled)


def eager(t: Tensor) -> bool:
    """Whether ``t`` is seen by eager code, where the fast paths' autograd Functions may run: not traced by a
    compiler or exporter (they pick their own kernels), nor wrapped by a ``torch.func`` transform (grad, vmap,
    jacrev, ..., which refuse a Function without ``setup_context``)."""
    return not torch.compiler.is_compiling() and not torch._C._functorch.is_functorch_wrapped_tensor(t)


def eager_cpu_float32(x: Tensor) -> bool:
    """``x`` is a float32 CPU tensor seen by eager code (:func:`eager`), with no dispatch mode active
    (``FlopCounterMode``, fake tensors ... see the aten ops)."""
    return (
        eager(x)  # first: what a compiler traces, it compiles with its own kernels
        and _get_current_dispatch_mode() is None
        and x.device.type == "cpu"
        and x.dtype == torch.float32
    )


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` by oneDNN, from the weight already in its blocked layout (``packed``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # (..., out)


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` by oneDNN, ``weight`` reordered into its blocked layout first."""
    return packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight), bias)  # (..., out)


def _linear_grads(
    ctx: Any, grad: Tensor, x: Tensor, weight: Tensor, x_grad: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of ``x @ weight.T + bias`` for ``grad`` (..., out): of x (if ``x_grad``), of the weight and
    of the bias where ``ctx.needs_input_grad`` (indexes 1 and 2) asks for them and ``ctx.has_bias``."""
    grad_2d = grad.reshape(-1, grad.shape[-1])  # (M, out)
    grad_x = (grad_2d @ weight).view(*grad.shape[:-1], weight.shape[1]) if x_grad else None  # (..., in)
    grad_w = grad_2d.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None  # (out, in)
    grad_b = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # (out,)
    return grad_x, grad_w, grad_b


class _OneDnnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        return _onednn(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        return _linear_grads(ctx, grad, x, weight, ctx.needs_input_grad[0])


Recompute = Callable[[Tensor], tuple[Tensor, Callable[[Tensor], Tensor]]]
"""A function's pass for a backward: from its input, its output and the map from the output's gradient to the
input's."""


def autograd_recompute(inner: Callable[[Tensor], Tensor]) -> Recompute:
    """``inner``'s :data:`Recompute` by autograd: its output recomputed with a graph, which the map walks back.

    Args:
        inner: a function of one tensor.
    """

    def recompute(h: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        with torch.enable_grad():
            pre = h.detach().requires_grad_()
            x = inner(pre)
        return x.detach(), lambda grad: torch.autograd.grad(x, pre, grad)[0]

    return recompute


class _RecomputedLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        h: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        inner: Callable[[Tensor], Tensor],
        recompute: Recompute,
    ) -> Tensor:
        ctx.save_for_backward(h, weight)
        ctx.has_bias, ctx.recompute = bias is not None, recompute  # type: ignore[attr-defined]
        device = h.device.type  # the backward runs under the forward's autocast, as autograd's nodes would
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        ctx.autocast = torch.get_autocast_dtype(device) if autocast else None  # type: ignore[attr-defined]
        return onednn_linear(inner(h), weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None]:
        h, weight = ctx.saved_tensors
        dtype = ctx.autocast
        autocast = torch.autocast(h.device.type, dtype) if dtype is not None else contextlib.nullcontext()
        with autocast:
            x, grad_of = ctx.recompute(h)  # (..., in) recomputed
            grad_x, grad_w, grad_b = _linear_grads(ctx, grad, x, weight, True)
            grad_h = grad_of(grad_x) if ctx.needs_input_grad[0] else None
        return grad_h, grad_w, grad_b, None, None


def tracked(t: Tensor) -> bool:
    """Whether autograd records what is computed from ``t``: it requires a gradient and grad mode is on."""
    return t.requires_grad and torch.is_grad_enabled()


def hooked(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs forward hooks: its own or global ones. A fast path that skips the call
    must not skip them."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks
    )


def recomputes(h: Tensor, linear: nn.Module) -> bool:
    """Whether :func:`recomputed_linear` may run ``linear`` on a function of ``h``: a gradient flows to ``h``,
    the code is eager (a compiler's partitioner chooses what to recompute itself) without a ``torch.func``
    transform, and ``linear`` is exactly a :class:`Linear` of plain weights without hooks that a call would
    run."""
    return (
        tracked(h)
        and eager(h)
        and type(linear) is Linear
        and type(linear.weight) is nn.Parameter
        and not hooked(linear)
    )


def recomputed_linear(
    h: Tensor, inner: Callable[[Tensor], Tensor], linear: nn.Linear, recompute: Recompute | None = None
) -> Tensor:
    """``linear(inner(h))`` whose backward keeps ``h`` and recomputes ``inner(h)``, where :func:`recomputes`
    holds.

    Autograd would keep both: ``inner``'s input for its own gradient and its output for the weight's. For an
    MLP's activation (``inner`` GELU, or a gated MLP's ``act(gate) * value``) that is a (..., F) tensor of
    each layer's activations less in training, for one more pass of ``inner`` in the backward. The backward
    is once differentiable.

    Args:
        h: (..., F') the input of ``inner``.
        inner: a function without parameters or randomness, (..., F') -> (..., in).
        linear: the layer applied to ``inner(h)``.
        recompute: ``inner``'s pass for the backward (default :func:`autograd_recompute`).
    """
    recompute = autograd_recompute(inner) if recompute is None else recompute
    return _RecomputedLinear.apply(h, linear.weight, linear.bias, inner, recompute)


MIN_ROWS = 256
"""The oneDNN path needs at least this many input rows to repay the weight's reorder (one pass over it)."""


def fastest(runs: Mapping[str, Callable[[], object]], rounds: int = 5) -> str:
    """The name of the kernel that runs fastest: medians of ``rounds`` alternating timed calls each, after one
    untimed call of each, without autograd.

    Args:
        runs: the kernels to time, by name (at least one).
        rounds: timed calls of each.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        for run in runs.values():
            run()
        for _ in range(rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return min(times, key=lambda name: statistics.median(times[name]))


def first_is_faster(first: Callable[[], object], second: Callable[[], object], rounds: int = 5) -> bool:
    """Whether ``first`` runs faster than ``second`` (:func:`fastest` of the two).

    Args:
        first: a kernel to time.
        second: the kernel to time against it.
        rounds: timed calls of each.
    """
    return fastest({"first": first, "second": second}, rounds) == "first"


@functools.cache
def onednn_is_faster(threads: int) -> bool:
    """Whether oneDNN, the weight reordered at each call, runs a ViT-B-sized product (512 rows, 768 -> 3072)
    faster than MKL's ``F.linear`` with ``threads`` threads; measured once per process and thread count."""
    x, weight = torch.ones(512, 768), torch.ones(3072, 768)
    return first_is_faster(lambda: _onednn(x, weight, None), lambda: F.linear(x, weight))


def uses_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`onednn_linear` takes the oneDNN path for these tensors: float32 on a CPU with oneDNN,
    eager (not compiling or exporting, no dispatch mode such as ``FlopCounterMode`` active), no autocast,
    contiguous tensors, at least ``MIN_ROWS`` rows, the weight a plain tensor (not a DTensor), and oneDNN
    measured faster than MKL on this machine."""
    return (
        eager_cpu_float32(x)
        and weight.dtype == torch.float32
        and x.dim() >= 2
        and x.numel() >= MIN_ROWS * weight.shape[1]
        and x.is_contiguous()
        and type(weight) in (nn.Parameter, Tensor)
        and weight.is_contiguous()
        and onednn_available()
        and not torch.is_autocast_enabled("cpu")
        and onednn_is_faster(torch.get_num_threads())
    )


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``, computed by oneDNN when :func:`uses_onednn` says so.

    Args:
        x: (..., in) inputs.
        weight: (out, in).
        bias: (out,) or None.

    Returns:
        (..., out).
    """
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _OneDnnLinear.apply(x, weight, bias)
    return _onednn(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state_dict and init) whose float32 forward on CPU uses oneDNN: see
    :func:`onednn_linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return onednn_linear(x, self.weight, self.bias)  # (..., out)
