"""A decode step's RMSNorm, SwiGLU gating and RoPE in one native call each (specvit/nn/decoding.py, gemv.c):
the values of torch's ops, only where they serve, swapped in and put back whole, and the same generations."""

from __future__ import annotations

import importlib
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specvit
from specvit.generate import PACK_FROM
from specvit.nn import attend, gemv
from specvit.nn import program as lowering
from specvit.nn.attention import Attention
from specvit.nn.decoding import RowsRMSNorm, RowsSwiGLU, is_rms_norm, is_swiglu, native_steps, split_rotated
from specvit.nn.gemv import MAX_ROWS
from specvit.nn.mlp import GluMlp
from specvit.nn.norm import Norm

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not gemv.available(), reason="specvit's native kernel does not build here")


@pytest.mark.parametrize("dim", [1, 37, 64, 576])  # below, at and past the 32-wide loop
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize(("weighted", "offset"), [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_rms_norm_equals_torch(dim: int, rows: int, weighted: bool, offset: float) -> None:
    torch.manual_seed(dim + rows)
    x, weight = torch.randn(rows, 1, dim) * 3, torch.randn(dim) if weighted else None
    want = F.rms_norm(x, (dim,), None if weight is None else offset + weight, 1e-5)
    got = gemv.rms_norm(x, weight, 1e-5, offset)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)  # the sum of squares in another order
    if weighted:  # control: Gemma's 1 + w read as w (or w as 1 + w) misses
        wrong = gemv.rms_norm(x, weight, 1e-5, 1.0 - offset)
        assert not torch.allclose(wrong, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("width", [1, 7, 8, 17, 1536])  # below, at and past the 8- and 16-wide loops
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_swiglu_equals_torch(width: int, rows: int) -> None:
    torch.manual_seed(width + rows)
    h = torch.randn(rows, 1, 2 * width) * 4
    if width >= 3:
        h[0, 0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # gates past exp's clamp, and 0
    gate, value = h.chunk(2, dim=-1)
    got = gemv.swiglu(h)
    assert got.shape == (rows, 1, width)
    torch.testing.assert_close(got, F.silu(gate) * value, rtol=1e-6, atol=1e-30)
    assert not torch.allclose(got, F.silu(value) * gate, rtol=1e-6)  # control: the halves read the other way


def test_swiglu_is_within_3_ulp_of_the_exact_silu() -> None:
    g = torch.cat([torch.linspace(-80, 80, 100_001), torch.randn(100_000) * 5])
    got = gemv.swiglu(torch.stack([g, torch.ones_like(g)], dim=-1))[:, 0]  # silu(g) * 1
    exact = g.double() / (1 + torch.exp(-g.double()))
    ulp = (torch.nextafter(exact.float().abs(), torch.tensor(float("inf"))) - exact.float().abs()).double()
    assert ((got.double() - exact).abs() / ulp).max().item() <= 3.0
    assert ((F.silu(g).double() - exact).abs() / ulp).max().item() <= 3.0  # torch's, for comparison


@pytest.mark.parametrize("rotated", [64, 16])  # every channel of a head, or the first quarter (Pythia's)
@pytest.mark.parametrize(("batch", "length"), [(1, 1), (2, 1), (2, 3)])
def test_one_native_rope_call_equals_torchs_ops_exactly(rotated: int, batch: int, length: int) -> None:
    torch.manual_seed(rotated + length)
    h, hkv, hd = 6, 2, 64
    t = torch.randn(batch, length, (h + 2 * hkv) * hd)
    cos, sin = torch.randn(length, rotated), torch.randn(length, rotated)
    want = attend.split_rotated(t, (h, hkv), hd, (cos, sin))
    with torch.no_grad():  # the native kernel serves no grad mode
        got = split_rotated(t.clone(), (h, hkv), hd, (cos, sin))
        other = split_rotated(t.clone(), (h, hkv), hd, (cos.roll(1, dims=-1), sin))  # control: other tables
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))  # q, k rotated; v as it was
    assert [g.shape for g in got] == [
        (batch, h, length, hd),
        (batch, hkv, length, hd),
        (batch, hkv, length, hd),
    ]
    assert not torch.equal(other[0], want[0]) and torch.equal(other[2], want[2])


def test_what_the_kernels_do_not_serve_runs_torchs_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("the native kernel ran")

    monkeypatch.setattr(gemv, "rope_half", refuse)
    monkeypatch.setattr(gemv, "rms_norm", refuse)
    monkeypatch.setattr(gemv, "swiglu", refuse)
    h, hkv, hd = 2, 1, 8
    rope = (torch.randn(1, hd), torch.randn(1, hd))
    norm = RowsRMSNorm(nn.RMSNorm(hd * 4, eps=1e-5))
    plain_mlp = GluMlp(hd * 4, 24, "swiglu", bias=False)
    mlp = RowsSwiGLU(plain_mlp)
    served = torch.randn(1, 1, (h + 2 * hkv) * hd)
    with pytest.raises(AssertionError, match="native kernel ran"), torch.no_grad():  # control: served
        split_rotated(served, (h, hkv), hd, rope)
    for module in (norm, mlp):
        with pytest.raises(AssertionError, match="native kernel ran"), torch.no_grad():
            module(served)
    unserved = [
        served.double(),  # another dtype
        torch.randn(MAX_ROWS + 1, 1, (h + 2 * hkv) * hd),  # more rows than a few
        torch.randn(2, 1, 2 * (h + 2 * hkv) * hd)[..., ::2],  # not contiguous
    ]
    with torch.no_grad():
        for t in unserved:
            want = attend.split_rotated(t, (h, hkv), hd, tuple(c.to(t.dtype) for c in rope))
            got = split_rotated(t, (h, hkv), hd, tuple(c.to(t.dtype) for c in rope))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            if t.dtype == torch.float32:
                assert torch.equal(norm(t), norm._plain[0](t))
            if t.shape[0] > MAX_ROWS:  # the MLP's product is contiguous: only the rows decide
                assert torch.equal(mlp(t), plain_mlp(t))
    assert torch.is_grad_enabled()  # grad mode: torch's differentiable ops
    split_rotated(served, (h, hkv), hd, rope)
    norm(served), mlp(served)


def _llama(**over: object) -> specvit.SpecModel:
    torch.manual_seed(0)
    overrides = {
        "decoder.depth": 2,
        "decoder.width": 96,
        "decoder.block.heads": 6,
        "decoder.input.vocab": 97,
        **over,
    }
    return specvit.build_model(ROOT / "specs" / "llama_smollm_135m.yaml", overrides=overrides).eval()


def test_native_steps_swap_in_and_put_back_whole() -> None:
    model = _llama()

    def swappable() -> dict[str, nn.Module]:
        return {name: m for name, m in model.named_modules() if is_rms_norm(m) or is_swiglu(m)}

    before = swappable()
    cores = [m for m in model.modules() if isinstance(m, Attention)]
    keys = list(model.state_dict())
    assert len(before) == 7 and len(cores) == 2  # per block two norms and the MLP; the final norm
    with native_steps(model):
        natives = {
            name: type(m) for name, m in model.named_modules() if isinstance(m, RowsRMSNorm | RowsSwiGLU)
        }
        assert natives == {name: RowsSwiGLU if is_swiglu(m) else RowsRMSNorm for name, m in before.items()}
        assert all(core.native_rope is split_rotated for core in cores)
        assert list(model.state_dict()) == keys  # the weights under their own names
    assert swappable() == before
    assert all(core.native_rope is None for core in cores)
    with pytest.raises(RuntimeError, match="inside"), native_steps(model):
        raise RuntimeError("inside")
    assert swappable() == before
    assert all(core.native_rope is None for core in cores)
    assert not is_swiglu(GluMlp(8, 4, "geglu")) and not is_swiglu(GluMlp(8, 4, "swiglu", dropout=0.1))


@pytest.mark.parametrize(
    ("spec", "over"),
    [
        ("llama_smollm_135m", {}),  # RMSNorm, RoPE over whole heads, GQA
        ("llama_smollm_135m", {"decoder.block.norm.unit_offset": True}),  # Gemma's 1 + w
        ("pythia_160m", {"decoder.block.heads": 6}),  # LayerNorm (not swapped), RoPE over a quarter
    ],
)
def test_models_compute_the_same_inside_native_steps(spec: str, over: dict[str, object]) -> None:
    torch.manual_seed(0)
    overrides = {"decoder.depth": 2, "decoder.width": 96, "decoder.block.heads": 6, "decoder.input.vocab": 97}
    model = specvit.build_model(ROOT / "specs" / f"{spec}.yaml", overrides={**overrides, **over}).eval()
    for norm in (m for m in model.modules() if isinstance(m, Norm | nn.RMSNorm) and m.weight is not None):
        nn.init.normal_(norm.weight, std=0.5)  # weights that are not all one (or zero)
    tokens = torch.randint(0, 97, (2, 4))  # 8 rows: every call served
    with torch.no_grad():
        want = model(tokens)
        with native_steps(model):
            got = model(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def unrotated_keys(t, heads, hd, rope):  # type: ignore[no-untyped-def]  # control: keys left as they are
        q, _, v = split_rotated(t, heads, hd, rope)
        return q, attend.split_parts(t, ((heads[0], hd), (heads[1], hd), (heads[1], hd)))[1], v

    cores = [m for m in model.modules() if isinstance(m, Attention)]
    with torch.no_grad(), native_steps(model):
        for core in cores:
            core.native_rope = unrotated_keys
        wrong = model(tokens)
    assert not torch.allclose(wrong, want, rtol=1e-5, atol=1e-5)


def test_generation_steps_natively_with_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama()
    calls = [0]
    real = gemv.rope_half

    def counted(*args: object) -> torch.Tensor:
        calls[0] += 1
        return real(*args)  # type: ignore[arg-type]

    prompt = torch.randint(0, 97, (2, 5))
    generation = importlib.import_module("specvit.generate")
    monkeypatch.setattr(
        lowering, "compile_step", lambda *_, **__: None
    )  # a model the step program does not lower
    with monkeypatch.context() as torch_ops:  # the steps as they ran before native_steps
        torch_ops.setattr(generation, "native_steps", lambda *_: nullcontext())
        want = model.generate(prompt, PACK_FROM)
    monkeypatch.setattr(gemv, "rope_half", counted)
    got = model.generate(prompt, PACK_FROM)
    assert torch.equal(got, want) and calls[0] == 2 * (
        PACK_FROM - 1
    )  # two layers, each step after the prompt
    calls[0] = 0
    model.generate(prompt, PACK_FROM - 1)  # shorter generations do not swap
    assert calls[0] == 0
