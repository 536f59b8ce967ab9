"""An MLP's activation runs over its input in place where autograd keeps what it needs
(:func:`specvit.nn.mlp.activate`), with the values and gradients of the module call."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from reference import AtenOps
from torch import nn

from specvit.nn.linear import autograd_recompute
from specvit.nn.mlp import Mlp, QuickGELU, _activation, _glu, _glu_recompute, activate, build_mlp
from specvit.nn.moe import MoeMlp

NAMES = ["relu", "gelu", "gelu_tanh", "silu"]


@pytest.mark.parametrize("name", NAMES)
def test_without_gradients_each_activation_overwrites_its_input_with_the_module_s_values(name: str) -> None:
    act, h = _activation(name), torch.randn(4, 64)
    want = act(h.clone())
    with torch.no_grad():
        got = activate(act, h)
    assert torch.equal(got, want)
    assert got.data_ptr() == h.data_ptr() and torch.equal(h, want)


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
def test_with_gradients_an_activation_that_reads_its_input_keeps_it(name: str) -> None:
    act, x = _activation(name), torch.randn(4, 64, requires_grad=True)
    h = x * 2.0  # a product autograd tracks, as fc1's output
    before = h.detach().clone()
    got = activate(act, h)
    assert torch.equal(h.detach(), before) and got.data_ptr() != h.data_ptr()
    (grad,) = torch.autograd.grad(got.square().sum(), x)
    (want,) = torch.autograd.grad(act(x * 2.0).square().sum(), x)
    assert torch.equal(grad, want)


def test_the_guard_is_needed_gelu_in_place_under_autograd_loses_its_input() -> None:
    """The control: GELU written over a tracked input fails autograd's check of the input it saved."""
    x = torch.randn(4, 64, requires_grad=True)
    h = x * 2.0
    y = nn.GELU()(h)
    torch.ops.aten.gelu_(h)  # what ``activate`` refuses to do when a gradient flows
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_training_relu_mlp_runs_in_place_with_the_gradients_of_the_module_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    mlp, x = Mlp(32, 48, "relu"), torch.randn(2, 5, 32)
    out = mlp(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()]  # type: ignore[union-attr]
    mlp.zero_grad()
    monkeypatch.setattr("specvit.nn.mlp._IN_PLACE", {})  # every activation a module call
    want = mlp(x)
    want.square().sum().backward()
    assert torch.equal(out, want)
    for got, p in zip(grads, mlp.parameters(), strict=True):
        assert torch.equal(got, p.grad)  # type: ignore[arg-type]


def _saved_bytes(step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``step()`` and the bytes of the distinct storages autograd keeps for its backward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    return out, sum(storages.values())


@pytest.mark.parametrize(
    ("activation", "saved"), [("gelu", 1), ("gelu_tanh", 1), ("silu", 1), ("quick_gelu", 2), ("swiglu", 2)]
)
def test_a_training_mlp_keeps_fc1_s_output_alone_with_the_gradients_of_autograd(
    activation: str, saved: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``saved``: the (B, N, F) tensors less autograd keeps: ``act(h)``, and quick GELU's sigmoid too (plain);
    ``act(gate)`` and the product (gated). The control runs the same module with the recomputation off."""
    torch.manual_seed(0)
    batch, tokens, hidden = 2, 5, 48
    mlp = build_mlp(32, hidden, activation)  # type: ignore[arg-type]
    x = torch.randn(batch, tokens, 32)
    out, kept = _saved_bytes(lambda: mlp(x))
    out.square().sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()]  # type: ignore[union-attr]
    mlp.zero_grad()
    monkeypatch.setattr("specvit.nn.mlp.recomputes", lambda h, linear: False)
    want, kept_plain = _saved_bytes(lambda: mlp(x))
    want.square().sum().backward()
    assert torch.equal(out, want)
    for got, p in zip(grads, mlp.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=1e-6)
    assert kept_plain - kept == saved * batch * tokens * hidden * 4


def test_a_global_hook_keeps_the_activation_s_call() -> None:
    seen: list[nn.Module] = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(m))
    try:
        act, h = nn.GELU(), torch.randn(3, 8)
        with torch.no_grad():
            got = activate(act, h)
    finally:
        handle.remove()
    assert seen == [act] and got.data_ptr() != h.data_ptr()


def test_a_hook_on_fc2_keeps_its_call_in_training() -> None:
    mlp, calls = Mlp(16, 24, "gelu"), []
    mlp.fc2.register_forward_hook(lambda m, i, o: calls.append(o))
    out = mlp(torch.randn(2, 3, 16, requires_grad=True))
    assert len(calls) == 1 and torch.equal(out, calls[0])


def test_a_hook_on_the_activation_keeps_the_module_call() -> None:
    act, seen = nn.ReLU(), []
    act.register_forward_hook(lambda m, i, o: seen.append(o))
    h = torch.randn(3, 8)
    with torch.no_grad():
        got = activate(act, h)
    assert len(seen) == 1 and torch.equal(got, seen[0])


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_an_moe_mlp_without_gradients_equals_its_tracked_products(activation: str) -> None:
    """Untracked, the experts' activation, gating product and routing weights are written over their inputs;
    tracked (a gradient flows), each is a new tensor: the outputs are the same."""
    torch.manual_seed(0)
    moe, x, logits = MoeMlp(32, 48, 4, 2, activation), torch.randn(2, 6, 32), torch.randn(2, 6, 4)  # type: ignore[arg-type]
    with torch.inference_mode():
        got = moe(x, logits=logits)
    want = moe(x, logits=logits)
    assert want.requires_grad and torch.equal(got, want)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_under_autocast_the_recomputed_backward_has_autograd_s_gradients_and_dtypes(
    activation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 autocast: the backward recomputes under the forward's autocast, so its products take autocast's
    dtypes as autograd's nodes would (a bf16 gradient against a float32 weight fails the product)."""
    torch.manual_seed(0)
    mlp, x = build_mlp(32, 48, activation), torch.randn(2, 5, 32)  # type: ignore[arg-type]
    runs = []
    for recompute in (True, False):
        if not recompute:
            monkeypatch.setattr("specvit.nn.mlp.recomputes", lambda h, linear: False)
        mlp.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            out = mlp(x)
        out.float().square().sum().backward()
        runs.append((out, [p.grad.clone() for p in mlp.parameters()]))  # type: ignore[union-attr]
    (out, grads), (want, want_grads) = runs
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    for got, ref in zip(grads, want_grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "geglu_tanh", "quick_gelu"])
def test_the_gated_backward_writes_both_halves_into_one_tensor_with_autograd_s_values(
    activation: str,
) -> None:
    """The gate's and the value's gradients are written into the halves of one tensor, with the values of
    autograd's nodes (which write each, then concatenate them: the control). An activation torch has no
    such backward for (quick GELU) takes autograd's."""
    torch.manual_seed(0)
    act = QuickGELU() if activation == "quick_gelu" else _activation(activation)
    h, grad = torch.randn(2, 5, 96), torch.randn(2, 5, 48)
    x, grad_of = _glu_recompute(h, act)
    want_x, want_grad_of = autograd_recompute(functools.partial(_glu, act=act))(h)
    with AtenOps() as ours:
        got = grad_of(grad)
    with AtenOps() as autograd:
        want = want_grad_of(grad)
    assert torch.equal(x, want_x) and torch.equal(got, want)
    assert "aten.cat" in autograd.names
    assert ("aten.cat" in ours.names) == (activation == "quick_gelu")
