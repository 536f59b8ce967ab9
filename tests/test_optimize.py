"""The inference switch: equal outputs in fp32, a stated accuracy in bf16, the original untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specvit
from specvit.inference import optimize

ROOT = Path(__file__).resolve().parents[1]


def _vit() -> specvit.SpecModel:
    torch.manual_seed(0)
    model = specvit.build_model(
        ROOT / "specs" / "vit_tiny_patch16_224.yaml", overrides={"encoder.depth": 2}
    ).eval()
    torch.nn.init.normal_(model.head.fc.weight, std=0.05)  # type: ignore[union-attr]
    return model


def test_fp32_compiled_equals_eager_within_1e4() -> None:
    model = _vit()
    fast = optimize(model, for_="inference")
    x = torch.randn(3, 3, 224, 224)
    with torch.inference_mode():
        # fp32, compiled kernels summing in another order: 1.4e-6 seen on logits near 2.6 (AMD EPYC)
        torch.testing.assert_close(fast(x), model(x), atol=1e-4, rtol=0)
    assert all(p.requires_grad for p in model.parameters())  # the original is left as it was
    assert model.training is False


def test_bf16_is_close_and_returns_float32() -> None:
    model = _vit()
    fast = optimize(model, precision="bf16", compile=False)
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        got, want = fast(x), model(x)
    assert got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) < 3e-2  # 7.5e-3 seen (bf16 keeps 8 bits: 3.9e-3 per op)
    assert next(model.parameters()).dtype == torch.float32


def test_token_inputs_stay_integers_in_bf16() -> None:
    torch.manual_seed(0)
    lm = specvit.build_model(
        ROOT / "specs" / "gpt2_small.yaml", overrides={"decoder.depth": 1, "decoder.input.vocab": 100}
    ).eval()
    fast = optimize(lm, precision="bf16", compile=False)
    tokens = torch.randint(0, 100, (2, 7))
    with torch.inference_mode():
        assert fast(tokens).shape == (2, 7, 100)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="for_='inference'"):
        optimize(_vit(), for_="training")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="precision must be"):
        optimize(_vit(), precision="fp8")  # type: ignore[arg-type]


def test_warm_up_progress_once_per_input_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    import specvit.progress
    from specvit.inference import _WarmUp

    shown: list[tuple[str, bool | None]] = []

    @contextlib.contextmanager
    def stages(title: str, total: int, show: bool | None = None):  # type: ignore[no-untyped-def]
        shown.append((title, show))
        yield lambda text: None

    monkeypatch.setattr(specvit.progress, "stages", stages)
    wrapped = _WarmUp(torch.nn.Identity(), show=False)
    for shape in [(2, 3), (2, 3), (4, 3), (2, 3)]:
        assert wrapped(torch.ones(shape)).shape == shape
    assert shown == [("optimize: first call at 2x3", False), ("optimize: first call at 4x3", False)]
    model = specvit.build_model("mnist_vit").eval()
    assert isinstance(specvit.optimize(model, progress=False), _WarmUp)  # compiled lazily, on first call
