"""Where a gradient flows, the heads of a packed projection, RoPE-rotated by rotate-half tables or not, are one
autograd node (:func:`specvit.nn.qkv.packed_heads`) with the values and gradients of torch's views and ops
(``x * cos + rotate_half(x) * sin``) bit for bit, and a backward that writes the projection's gradient once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from reference import AtenOps
from torch import Tensor

from specvit.nn.attend import split_heads, split_parts, split_rotated
from specvit.nn.position import apply_rope, rope_tables

H, HKV, HD, L = 4, 2, 64, 7


def plain(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """torch's ops: the first r channels rotated (rotate-half), the others kept."""
    r = cos.shape[-1]
    rot, keep = x[..., :r], x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat((rot * cos + torch.cat((-x2, x1), dim=-1) * sin, keep), dim=-1)


def tables(r: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    cos, sin = rope_tables(torch.arange(L), r, 10000.0)
    return cos.to(dtype), sin.to(dtype)


def packed(dtype: torch.dtype = torch.float32) -> Tensor:
    torch.manual_seed(0)
    return torch.randn(2, L, (H + 2 * HKV) * HD, dtype=dtype, requires_grad=True)  # (B, L, (H + 2Hkv) hd)


def plain_split(t: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    heads = split_heads(t, HD)  # (B, H + 2Hkv, L, hd)
    q, k = plain(heads[:, : H + HKV], cos, sin).split((H, HKV), dim=1)
    return q, k, heads[:, H + HKV :]


@pytest.mark.parametrize("r", [HD, HD // 2])  # the whole head; partial rotary
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_rotated_has_torch_s_values_and_gradients_exactly(r: int, dtype: torch.dtype) -> None:
    t = packed(dtype)
    cos, sin = tables(r, torch.float32)  # cast to the heads' dtype, as apply_rope does
    got = split_rotated(t, (H, HKV), HD, (cos, sin))
    want = plain_split(t, cos.to(dtype), sin.to(dtype))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.equal(g, w)
    grads = [torch.randn_like(w) for w in want]
    (grad,) = torch.autograd.grad(got, t, grads)
    (want_grad,) = torch.autograd.grad(want, t, grads)
    assert grad.dtype == dtype and torch.equal(grad, want_grad)


@pytest.mark.parametrize("used", [(0,), (1, 2), (2,)])  # queries alone; keys and values; values alone
def test_outputs_without_gradients_contribute_zeros(used: tuple[int, ...]) -> None:
    t = packed()
    cos, sin = tables(HD, torch.float32)
    got, want = split_rotated(t, (H, HKV), HD, (cos, sin)), plain_split(t, cos, sin)
    (grad,) = torch.autograd.grad([got[i].sum() for i in used], t)
    (want_grad,) = torch.autograd.grad([want[i].sum() for i in used], t)
    assert torch.equal(grad, want_grad) and grad.abs().sum() > 0


def _backward_ops(outputs: Callable[[], tuple[Tensor, ...]], t: Tensor) -> set[str]:
    out = outputs()
    grads = [torch.ones_like(o) for o in out]
    with AtenOps() as ops:
        torch.autograd.grad(out, t, grads)
    return ops.names


def test_the_backward_writes_the_projection_s_gradient_once_without_concatenating() -> None:
    """One node's backward writes the packed projection's gradient in its own layout; torch's ops concatenate
    the halves' gradients, then the rotated heads' with the values', then copy the result to that layout.
    The control: the same assertion fails on torch's ops."""
    t = packed()
    cos, sin = tables(HD, torch.float32)
    ours = _backward_ops(lambda: split_rotated(t, (H, HKV), HD, (cos, sin)), t)
    theirs = _backward_ops(lambda: plain_split(t, cos, sin), t)
    assert not {"aten.cat", "aten.clone"} & ours
    assert {"aten.cat", "aten.clone"} <= theirs


def test_the_control_a_fused_multiply_add_differs_from_torch_s_values() -> None:
    """Why each product is rounded before its sum: ``addcmul`` (a fused multiply-add on this CPU or not)
    is not bit-equal to torch's ops, which the equality above would catch. Where it happens to round the
    same, the two forms agree; the test asserts they differ somewhere on these values."""
    torch.manual_seed(0)
    x1, x2, c, s = (torch.randn(4096) for _ in range(4))
    fused = (x1 * c).addcmul_(x2, s, value=-1)
    if torch.equal(fused, x1 * c - x2 * s):
        pytest.skip("this CPU's addcmul rounds each product: the control shows nothing here")
    assert not torch.equal(fused, x1 * c - x2 * s)


def test_heads_of_their_own_rotate_with_torch_s_values_and_gradients() -> None:
    """apply_rope on (B, H, L, hd) heads (QK-norm's path): the same node, its gradient contiguous."""
    torch.manual_seed(0)
    x = torch.randn(2, H, L, HD, requires_grad=True)
    cos, sin = tables(HD, torch.float32)
    got, want = apply_rope(x, cos, sin), plain(x, cos, sin)
    assert torch.equal(got, want)
    g = torch.randn_like(want)
    (grad,) = torch.autograd.grad(got, x, g)
    (want_grad,) = torch.autograd.grad(want, x, g)
    assert torch.equal(grad, want_grad) and grad.is_contiguous()


def test_tables_with_gradients_take_torch_s_ops_and_get_their_gradients() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, H, L, HD)
    cos, sin = (t.clone().requires_grad_() for t in tables(HD, torch.float32))
    (got,) = torch.autograd.grad(apply_rope(x, cos, sin).square().sum(), cos)
    (want,) = torch.autograd.grad(plain(x, cos, sin).square().sum(), cos)
    assert torch.equal(got, want) and got.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_without_rope_are_views_with_autograd_s_gradient_written_once(dtype: torch.dtype) -> None:
    """A ViT's q, k, v: the same views, the same gradient, no concatenation or copy in the backward (torch's
    views concatenate, then copy: the control)."""
    t = packed(dtype)
    parts = ((H, HD), (HKV, HD), (HKV, HD))
    got = split_parts(t, parts)
    heads = split_heads(t.detach(), HD)
    want = heads.split((H, HKV, HKV), dim=1)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w) and g.data_ptr() == w.data_ptr()  # views of the projection
    grads = [torch.randn_like(w) for w in want]
    (grad,) = torch.autograd.grad(got, t, grads)
    assert grad.dtype == dtype and torch.equal(grad, torch.cat(grads, dim=1).transpose(1, 2).flatten(2))
    ours = _backward_ops(lambda: tuple(split_parts(t, parts)), t)
    theirs = _backward_ops(lambda: tuple(split_heads(t, HD).split((H, HKV, HKV), dim=1)), t)
    assert not {"aten.cat", "aten.clone"} & ours
    assert {"aten.cat", "aten.clone"} <= theirs


def test_without_gradients_the_heads_are_torch_s_views() -> None:
    """No node where no gradient flows (a Function's call costs more than its views and ops save)."""
    t = packed().detach()
    cos, sin = tables(HD, torch.float32)
    with AtenOps() as ops:
        got = split_rotated(t, (H, HKV), HD, (cos, sin))
    for g, w in zip(got, plain_split(t, cos, sin), strict=True):
        assert torch.equal(g, w)
    assert "aten.cat" in ops.names  # torch's rotate_half


def test_torch_func_grad_takes_torch_s_ops_with_autograd_s_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.func`` transforms refuse an autograd Function without ``setup_context``: under one, the heads are
    torch's views and ops, and the gradients those of autograd. The control: the node under the transform."""
    import specvit

    small = {"decoder.depth": 1, "decoder.width": 64, "decoder.block.heads": 4, "decoder.block.kv_heads": 2}
    spec = specvit.load_spec("llama_smollm_135m", overrides={**small, "decoder.input.vocab": 100})
    torch.manual_seed(0)
    model, tokens = specvit.build_model(spec).train(), torch.randint(0, 100, (2, 8))
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, Tensor]) -> Tensor:
        return torch.func.functional_call(model, p, (tokens,)).square().mean()

    got = torch.func.grad(loss)(params)
    model(tokens).square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7)
    monkeypatch.setattr("specvit.nn.qkv.eager", lambda t: True)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(loss)(params)
