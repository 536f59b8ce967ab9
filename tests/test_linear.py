"""specvit's Linear (oneDNN for float32 on CPU, equal to F.linear's values and gradients; nn.Linear
everywhere else) and Dropout (float32 CPU training masks from uniform draws, nn.Dropout's distribution)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import specvit
from specvit.nn import linear
from specvit.nn.layers import Dropout
from specvit.nn.linear import MIN_ROWS, Linear, first_is_faster, uses_onednn
from specvit.nn.linear import onednn_is_faster as measured_onednn_is_faster

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.fixture(autouse=True)
def _onednn_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oneDNN path runs wherever it is eligible, whichever kernel this machine measured faster."""
    monkeypatch.setattr(linear, "onednn_is_faster", lambda threads: True)


@contextmanager
def _mkldnn_off() -> Iterator[None]:
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True


def _grads(layer: torch.nn.Linear, x: torch.Tensor, fn: object) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    layer.zero_grad()
    out = fn(x)  # type: ignore[operator]
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]  # type: ignore[list-item]


@pytest.mark.parametrize("bias", [True, False])
def test_training_path_equals_f_linear(bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=bias)
    x = torch.randn(4, 70, 48)  # 280 rows: enough to repay the reorder
    assert uses_onednn(x, layer.weight)
    assert type(layer(x).grad_fn).__name__ == "_OneDnnLinearBackward"
    got = _grads(layer, x, layer)
    want = _grads(layer, x, lambda v: F.linear(v, layer.weight, layer.bias))
    assert len(got) == len(want) == 4 + bias - 1
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


def test_inference_frozen_weight_and_input_without_grad() -> None:
    torch.manual_seed(0)
    layer = Linear(16, 8)
    x = torch.randn(MIN_ROWS, 16)
    want = F.linear(x, layer.weight, layer.bias).detach()
    with torch.no_grad():  # inference: oneDNN without autograd
        got = layer(x)
    assert got.grad_fn is None and (got - want).abs().max().item() <= 1e-5
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()  # a frozen layer still passes the input's gradient
    assert torch.allclose(xg.grad, layer.weight.sum(0).expand(MIN_ROWS, 16), atol=1e-6)  # type: ignore[arg-type]
    layer.weight.requires_grad_(True)
    layer(x).sum().backward()  # the input needs no gradient: only the weight's is computed
    assert layer.weight.grad is not None and layer.weight.grad.shape == (8, 16)


def test_everywhere_else_it_is_nn_linear() -> None:
    layer = Linear(16, 8)
    x = torch.randn(MIN_ROWS, 16)
    assert uses_onednn(x, layer.weight) and not uses_onednn(x[1:], layer.weight)  # too few rows
    assert not uses_onednn(x.double(), layer.weight.double())
    assert not uses_onednn(torch.randn(16, MIN_ROWS).t(), layer.weight)  # not contiguous
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_onednn(x, layer.weight)
        assert layer(x).dtype == torch.bfloat16  # autocast still applies
    with FlopCounterMode(display=False) as counter:
        assert not uses_onednn(x, layer.weight)
        layer(x).sum().backward()
    assert counter.get_total_flops() == 2 * 2 * MIN_ROWS * 16 * 8  # the forward and the weight's gradient
    with _mkldnn_off():
        assert not uses_onednn(x, layer.weight)


def test_where_onednn_measured_slower_it_is_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, x = Linear(16, 8), torch.randn(MIN_ROWS, 16)
    assert uses_onednn(x, layer.weight)
    monkeypatch.setattr(linear, "onednn_is_faster", lambda threads: False)
    assert not uses_onednn(x, layer.weight)
    assert layer(x).grad_fn.__class__.__name__ == "AddmmBackward0"  # F.linear's, not _OneDnnLinear's


def test_first_is_faster_times_both_kernels() -> None:
    calls: list[str] = []

    def slow() -> None:
        calls.append("slow")
        time.sleep(0.003)

    assert first_is_faster(lambda: calls.append("fast"), slow, rounds=3)
    assert not first_is_faster(slow, lambda: None, rounds=3)
    assert calls[:8] == ["fast", "slow"] * 4  # one untimed call each, then alternating rounds
    assert isinstance(measured_onednn_is_faster(torch.get_num_threads()), bool)  # measured, then cached
    assert measured_onednn_is_faster.cache_info().currsize >= 1


def test_a_training_step_equals_the_mkl_one() -> None:
    torch.manual_seed(0)
    model = specvit.build_model(ROOT / "specs" / "vit_tiny_patch16_224.yaml", overrides={"encoder.depth": 2})
    x, y = torch.randn(2, 3, 224, 224), torch.tensor([3, 7])

    def step() -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    loss, grads = step()
    with _mkldnn_off():  # every linear through F.linear (MKL)
        want_loss, want_grads = step()
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_dropout_keeps_one_minus_p_scaled_and_its_gradient_is_the_mask() -> None:
    drop = Dropout(0.3)
    x = torch.rand(200, 500) + 1.0  # no zeros: a kept element is never 0
    torch.manual_seed(0)
    xg = x.clone().requires_grad_()
    out = drop(xg)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.01  # 100k draws: 5 standard deviations is 0.007
    assert torch.allclose(out[kept], x[kept] / 0.7)
    out.sum().backward()
    assert torch.equal(xg.grad, kept.float() / 0.7)  # type: ignore[arg-type]
    torch.manual_seed(0)
    assert torch.equal(drop(x), out.detach())  # the global generator draws the masks: seeds reproduce them
    drop.eval()
    assert torch.equal(drop(x), x)
    drop.train()
    torch.manual_seed(0)
    want = F.dropout(x.double(), 0.3, True)
    torch.manual_seed(0)
    assert torch.equal(drop(x.double()), want)  # other dtypes: exactly nn.Dropout
