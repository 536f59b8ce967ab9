"""Reference models for parity tests: moved off their init, and their weights converted into specvit's."""

from __future__ import annotations

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
