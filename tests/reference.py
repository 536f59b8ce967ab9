"""Reference models for parity tests: moved off their init, and their weights converted into specvit's."""

from __future__ import annotations

import torch
from torch import nn

from specvit.compile import build_model
from specvit.convert import convert_state_dict
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


def converted(ref: nn.Module, spec: Spec) -> SpecModel:
    """The model of ``spec`` in eval mode, with the HF ``ref``'s weights loaded strictly through the converter."""
    model = build_model(spec).eval()
    model.load_state_dict(convert_state_dict(ref.state_dict(), "hf", spec), strict=True)
    return model
