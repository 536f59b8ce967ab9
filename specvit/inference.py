"""One switch for fast inference: ``specvit.optimize(model, for_="inference")``.

What it does, and why (measured on this project's 2-core x86 CPU, docs/performance.md):

- ``precision="fp32"`` (default): ``torch.compile`` (Inductor) fuses the element-wise work between the
  GEMMs (norms, GELU, residual adds) while the GEMMs keep their BLAS path; outputs equal eager within
  float rounding (< 1e-5 on ViT-B/16). On a CPU whose fp32 GEMM runs at the same rate through MKL and
  oneDNN, eager is already within ~25% of the GEMM ceiling, so this is the fp32 gain available:
  pre-packing weights for oneDNN or Inductor's freezing measured slower here. Compiling costs a warm-up
  on the first call of each input shape (about 20 s for ViT-B/16 on 2 cores).
- ``precision="bf16"``: weights and activations in bfloat16, which runs on AMX / AVX512-BF16 units (and
  tensor cores on GPUs): ~3x faster than fp32 on such a CPU, at ~1% relative error in the outputs, so it
  is an explicit choice, never the default. Inputs are cast on the way in and outputs back to float32.

The result is for inference only (eval mode, no gradients); train, save and convert the original.

The module is ``specvit.inference`` (not ``specvit.optimize``) so that ``specvit.optimize`` stays the
function: importing a submodule named like a package attribute would replace that attribute.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["optimize"]


class _Cast(nn.Module):
    """Runs ``model`` in ``dtype``: floating inputs are cast to it, floating outputs back to float32.

    Args:
        model: the model, already in ``dtype``.
        dtype: the compute dtype.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def cast(v: Any) -> Any:
            return v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

        out = self.model(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})
        return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out


class _WarmUp(nn.Module):
    """Shows progress on a terminal while a compiled model's first call of each input shape compiles.

    Args:
        model: the compiled model.
        show: force the display on or off; default: when standard error is a terminal.
    """

    def __init__(self, model: nn.Module, show: bool | None):
        super().__init__()
        self.model = model
        self.show = show
        self.seen: set[tuple[tuple[int, ...], ...]] = set()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from specvit.progress import stages

        key = tuple(tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        if key in self.seen:
            return self.model(*args, **kwargs)
        shapes = ", ".join("x".join(map(str, k)) for k in key)
        with stages(f"optimize: first call at {shapes}", 1, show=self.show) as step:
            step("torch.compile warm-up, once per input shape")
            out = self.model(*args, **kwargs)
        self.seen.add(key)
        return out


def optimize(
    model: nn.Module,
    for_: Literal["inference"] = "inference",
    *,
    precision: Literal["fp32", "bf16"] = "fp32",
    compile: bool = True,
    progress: bool | None = None,
) -> nn.Module:
    """A faster copy of ``model`` for inference; the original is left unchanged.

    Args:
        model: a compiled specvit model.
        for_: what to optimise for; ``inference`` is the one mode.
        precision: ``fp32`` (outputs equal eager within float rounding) or ``bf16`` (about 1% relative
            error, several times faster where the hardware has bf16 units).
        compile: fuse with ``torch.compile`` (a warm-up on the first call of each input shape).
        progress: show the warm-up's progress on standard error (default: when it is a terminal).

    Returns:
        A module in eval mode to call under ``torch.inference_mode()`` or ``torch.no_grad()``.
    """
    if for_ != "inference":
        raise ValueError(f"optimize supports for_='inference', not {for_!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', not {precision!r}")
    fast: nn.Module = copy.deepcopy(model).eval()
    for p in fast.parameters():
        p.requires_grad_(False)
    if precision == "bf16":
        fast = _Cast(fast.to(torch.bfloat16), torch.bfloat16)
    if not compile:
        return fast
    return _WarmUp(torch.compile(fast), progress)  # type: ignore[arg-type]
