"""An honest GEMM ceiling: the rate of the model's own GEMM shapes through every path the machine offers."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ceilings", "gemm_shapes", "shape_rates"]

Shape = tuple[int, int, int]  # (M, K, N): (M, K) @ (K, N)


def gemm_shapes(model: nn.Module, args: Sequence[Any]) -> Counter[Shape]:
    """The (M, K, N) of every GEMM one forward of ``model(*args)`` runs, with how often: each Linear
    (M = all leading dims) and each Conv2d whose stride equals its kernel (a patch embedding: a GEMM of
    M = B * patches, K = C_in * kh * kw, N = C_out)."""
    shapes: Counter[Shape] = Counter()

    def on_linear(mod: nn.Module, inputs: tuple[Any, ...], _out: Any) -> None:
        x = inputs[0]
        shapes[(x.numel() // x.shape[-1], mod.in_features, mod.out_features)] += 1  # type: ignore[arg-type]

    def on_conv(mod: nn.Module, _inputs: tuple[Any, ...], out: torch.Tensor) -> None:
        kh, kw = mod.kernel_size  # type: ignore[misc]
        if tuple(mod.stride) == (kh, kw) and mod.groups == 1:  # type: ignore[arg-type]
            m = out.shape[0] * out.shape[2] * out.shape[3]
            shapes[(m, mod.in_channels * kh * kw, mod.out_channels)] += 1  # type: ignore[operator]

    hooks = []
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            hooks.append(mod.register_forward_hook(on_linear))
        elif isinstance(mod, nn.Conv2d):
            hooks.append(mod.register_forward_hook(on_conv))
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in hooks:
            h.remove()
    return shapes


def _paths() -> dict[str, tuple[torch.dtype, Callable[[torch.Tensor, torch.Tensor], Callable[[], object]]]]:
    """Each path: its dtype and, given x (M, K) and w (N, K), a call computing x @ w.T."""

    def mm(x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
        wt = w.t().contiguous()
        return lambda: torch.mm(x, wt)

    def linear(x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
        return lambda: torch.nn.functional.linear(x, w)

    def onednn(x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    out = {"fp32 torch.mm (MKL)": (torch.float32, mm), "fp32 F.linear": (torch.float32, linear)}
    if torch.backends.mkldnn.is_available():
        out["fp32 oneDNN pre-packed"] = (torch.float32, onednn)
    out["bf16 torch.mm"] = (torch.bfloat16, mm)
    if torch.backends.mkldnn.is_available():
        out["bf16 oneDNN pre-packed"] = (torch.bfloat16, onednn)
    return out


def shape_rates(shapes: Counter[Shape], repeat: int, budget: float = 0.5) -> dict[str, float]:
    """GFLOP/s of the whole shape set (each shape weighted by its count) through every path, and through the
    fastest path of each shape ("best path per shape"), per dtype: total FLOPs over total time, each shape's
    time the fastest of ``repeat`` calls (fewer if they exceed ``budget`` s): a ceiling is the best this
    machine was seen to do, not its typical run."""
    flops = sum(2 * m * k * n * count for (m, k, n), count in shapes.items())
    seconds: dict[str, dict[Shape, float]] = {}  # path -> shape -> best time of one call
    dtypes = {}
    for name, (dtype, make) in _paths().items():
        per_shape = {}
        for m, k, n in shapes:
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            try:
                call = make(x, w)
                call()
            except RuntimeError:
                break  # this path does not take this dtype here
            times: list[float] = []
            while len(times) < max(1, repeat) and sum(times) < budget:
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            per_shape[(m, k, n)] = min(times)
        else:
            seconds[name], dtypes[name] = per_shape, name.split()[0]
    rates = {name: flops / sum(t[s] * c for s, c in shapes.items()) / 1e9 for name, t in seconds.items()}
    for dtype in dict.fromkeys(dtypes.values()):
        paths = [t for name, t in seconds.items() if dtypes[name] == dtype]
        best = sum(min(t[s] for t in paths) * c for s, c in shapes.items())
        rates[f"{dtype} best path per shape"] = flops / best / 1e9
    return rates


def ceilings(rates: dict[str, float]) -> dict[str, float]:
    """The best path per dtype: ``{"fp32": ..., "bf16": ...}``."""
    best: dict[str, float] = {}
    for name, rate in rates.items():
        dtype = name.split()[0]
        best[dtype] = max(best.get(dtype, 0.0), rate)
    return best
