"""Reference models for parity tests: moved off their init, and their weights converted into specvit's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from specvit.compile import build_model
from specvit.convert import Source, convert_state_dict
from specvit.model import SpecModel
from specvit.spec.schema import Spec


def perturbed(model: nn.Module, seed: int) -> nn.Module:
    """``model`` in eval mode with every parameter moved off its init by N(0, 0.1): zero-initialised parts
    (biases, layer scales) cannot hide a wrong mapping."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def noised(model: nn.Module, seed: int, std: float = 0.08) -> nn.Module:
    """``model`` in eval mode with N(0, std) added to every weight and persistent buffer (what a checkpoint
    holds), as the import issue asks of its references."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=gen) * std)
    return model.eval()


def converted(ref: nn.Module, spec: Spec, source: Source = "hf") -> SpecModel:
    """The model of ``spec`` in eval mode, with ``ref``'s weights loaded strictly through the converter."""
    model = build_model(spec).eval()
    model.load_state_dict(convert_state_dict(ref.state_dict(), source, spec), strict=True)
    return model


def timm_model(name: str, seed: int, **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, **kwargs)`` with seeded random weights, perturbed (see :func:`perturbed`)."""
    import timm  # a test dependency; tests/conftest.py makes it importable on CPU-only torch

    torch.manual_seed(seed)
    return perturbed(timm.create_model(name, pretrained=False, **kwargs), seed)


def timm_parity(ref: nn.Module, seed: int = 0, batch: int = 2) -> tuple[SpecModel, float]:
    """specvit's model of ``from_timm(ref)`` with ref's weights, and the max abs difference of their outputs
    on random images of the size ``ref`` takes (fp32, eval)."""
    import specvit

    model = converted(ref, specvit.from_timm(ref), "timm")
    image = model.spec.stacks["encoder"].input
    size = (image.size, image.size) if isinstance(image.size, int) else tuple(image.size)
    images = torch.randn(batch, image.channels, *size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        diff = (model(images) - ref(images)).abs().max().item()
    return model, diff


@contextmanager
def float64_reference() -> Iterator[None]:
    """Run an HF reference in float64 as written, minus its float32 upcasts.

    HF upcasts norms, softmaxes and attention scores to float32 for half precision (``.to(torch.float32)``,
    ``.float()``, ``softmax(..., dtype=torch.float32)``); on float64 tensors that is a downcast, which would
    cap any comparison at ~1e-7. Inside this context those casts keep float64 tensors float64; nothing else
    changes. Use it around the reference's forward only, never around specvit's.
    """
    to, to_float, softmax = torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax

    def keep_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = to(self, *args, **kwargs)
        return self if self.dtype == torch.float64 and out.dtype == torch.float32 else out

    def keep_float(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    def keep_softmax(
        x: torch.Tensor, *args: Any, dtype: torch.dtype | None = None, **kwargs: Any
    ) -> torch.Tensor:
        return softmax(x, *args, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)

    torch.Tensor.to, torch.Tensor.float = keep_to, keep_float  # type: ignore[method-assign]
    torch.nn.functional.softmax = keep_softmax
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float = to, to_float  # type: ignore[method-assign]
        torch.nn.functional.softmax = softmax
