"""Weight-only int8 (specvit.nn.quant), and decoding from smaller weights through optimize(for_='generation')."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specvit
from specvit.inference import GENERATION_TOKENS, optimize
from specvit.nn import gemv, packed
from specvit.nn.quant import Bf16Linear, Int8Linear, quantize_int8, quantize_rows, weight_only
from specvit.tuning import (
    INT8_RTOL,
    Candidate,
    bf16_weights,
    bf16_weights_only,
    int8_weights,
    int8_weights_only,
)

TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
# the fixed prompt set the errors are stated over: 4 prompts of 32 tokens, every position's next token
PROMPTS = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(5))


def _llama() -> specvit.SpecModel:
    from transformers import LlamaConfig

    torch.manual_seed(0)
    return specvit.build_model(specvit.from_hf(LlamaConfig(**TINY_LLAMA))).eval()


def test_quantize_rows_values() -> None:
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-2.54, 1.27, 0.01]])
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8
    assert scale.tolist() == pytest.approx([1 / 127, 1.0, 2.54 / 127])
    assert q.tolist() == [[127, -64, 32], [0, 0, 0], [-127, 64, 0]]  # -63.5 and 31.75 round to even / up
    # every weight within half a step of its row's scale
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_rows(w)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("native", [False, True])
def test_int8_linear_is_the_dequantised_product(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    if native and not gemv.available():
        pytest.skip("specvit's native kernel does not build here")
    monkeypatch.setattr(
        packed, "few_rows_path", lambda rows, dtype, threads: "native" if native else "linear"
    )
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    layer = Int8Linear(linear)
    calls = [0]
    if layer._native is not None:
        kernel = layer._native
        monkeypatch.setattr(
            layer, "_native", lambda x, dtype: (calls.__setitem__(0, calls[0] + 1), kernel(x, dtype))[1]
        )
    x = torch.randn(2, 3, 48)  # 6 rows: the few-row kernel's when measured faster
    q, scale = quantize_rows(linear.weight)
    want = F.linear(x.double(), (q.double() * scale.double()[:, None]), linear.bias.double())
    got = layer(x)
    assert calls[0] == int(native)
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.03, rtol=0.02)  # bf16 activations and output
    # the control: the float32 layer differs from the int8 one by the weights' rounding, which is not nothing
    assert (F.linear(x, linear.weight, linear.bias) - want).abs().max() > 1e-4


@pytest.mark.parametrize("width", [40, 50, 64])  # 40 and 50: wrong sums and a crash in torch's AVX-512 kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_of_any_input_width_is_the_dequantised_product(width: int, dtype: torch.dtype) -> None:
    torch.manual_seed(width)
    linear = nn.Linear(width, 24)
    layer = Int8Linear(linear, dtype)
    x = torch.randn(12, width)  # more rows than the few-row kernel takes: torch's products
    q, scale = quantize_rows(linear.weight)
    want = F.linear(x.double(), (q.double() * scale.double()[:, None]), linear.bias.double())
    got = layer(x.to(dtype))
    assert got.shape == (12, 24) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0.02)  # bf16 activations in the kernel


def test_quantize_int8_swaps_every_linear_and_the_tied_head() -> None:
    model = quantize_int8(_llama())
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Int8Linear" in kinds and not {"Linear", "TiedLinear"} & kinds
    assert isinstance(model.head.fc, Int8Linear) and model.head.fc.out_features == 256  # type: ignore[union-attr]


def _errors(module: nn.Module, reference: torch.Tensor) -> tuple[float, float]:
    """(max abs logit difference, share of positions whose greedy next token agrees) on ``PROMPTS``."""
    with torch.inference_mode():
        got = module(PROMPTS).float()
    return (got - reference).abs().max().item(), (
        got.argmax(-1) == reference.argmax(-1)
    ).float().mean().item()


def test_smaller_weights_state_their_error_against_fp32() -> None:
    """bf16 and int8 weights against fp32 on a fixed prompt set. Bounds: bf16 rounds each weight and
    activation by <= 2^-9 relative and int8 each weight by <= half of max|row| / 127, so through 2 layers and
    the head the logits move by a few tenths of a percent of their largest magnitude (measured: bf16 0.3%,
    int8 0.6%; SmolLM-135M's shape with random weights: 1.7% and 4.0%, greedy agreement 95% and 86%, near-ties
    of random weights). The bounds below are 5x the measured ones and all tokens must agree; the control, a
    scale 10% off, breaks them."""
    model = _llama()
    with torch.inference_mode():
        reference = model(PROMPTS)
    peak = reference.abs().max().item()
    bf16_diff, bf16_agree = _errors(bf16_weights(model), reference)
    int8 = int8_weights(model)
    int8_diff, int8_agree = _errors(int8, reference)
    assert bf16_diff <= 0.015 * peak and bf16_agree == 1.0
    assert int8_diff <= 0.03 * peak and int8_agree == 1.0
    assert int8_diff <= INT8_RTOL * peak  # what optimize holds int8 candidates to
    # the same weights with float32 activations (generation's candidates) round only the weights: bf16's
    # error is then the weights' alone (measured 0.0018 against 0.0044); int8's is the weights' in both
    only_bf16, only_bf16_agree = _errors(bf16_weights_only(model), reference)
    only_int8, only_int8_agree = _errors(int8_weights_only(model), reference)
    assert only_bf16 < bf16_diff and only_int8 <= 0.03 * peak and only_bf16_agree == only_int8_agree == 1.0
    for layer in int8.modules():  # the control: every scale 10% off
        if isinstance(layer, Int8Linear):
            layer.scale.mul_(1.1)
    broken_diff, _ = _errors(int8, reference)
    assert broken_diff > 0.03 * peak


def test_optimize_for_generation_decodes_from_the_chosen_weights() -> None:
    """for_='generation' checks the prompt's logits, times generate, and returns a module that generates;
    the candidates are eager (fp32, with and without oneDNN), bf16 and int8 weights, never compilation."""
    model = _llama()
    prompt = PROMPTS[:2, :8]
    fast = optimize(model, (prompt,), "generation", precision="int8", repeat=1, progress=False)
    report = fast.optimize_report
    names = [t.name for t in report.trials]
    assert names == ["eager", "eager, MKL linears (no oneDNN)", "bf16 weights", "int8 weights"]
    assert all(t.rejected is None and t.seconds is not None for t in report.trials)
    with torch.inference_mode():
        out = fast.generate(prompt, 5)  # type: ignore[operator]
        for name, module in report.modules.items():  # each candidate decodes, from its own weights
            tokens = module.generate(prompt, GENERATION_TOKENS)  # type: ignore[operator]
            assert tokens.shape == (2, 8 + GENERATION_TOKENS), name
    assert out.shape == (2, 13) and torch.equal(out[:, :8], prompt)
    assert any(isinstance(m, Int8Linear) for m in report.modules["int8 weights"].modules())
    assert any(isinstance(m, Bf16Linear) for m in report.modules["bf16 weights"].modules())
    # oneDNN off: the same fp32 model, its greedy tokens those of eager (MKL's products round alike here)
    with torch.inference_mode():
        mkl = report.modules["eager, MKL linears (no oneDNN)"].generate(prompt, 5)  # type: ignore[operator]
        assert torch.equal(mkl, report.modules["eager"].generate(prompt, 5))  # type: ignore[operator]


def test_optimize_for_generation_picks_the_fastest_and_refuses_what_it_cannot_measure() -> None:
    model = _llama()
    prompt = PROMPTS[:1, :8]
    now = [0.0]

    def costs(seconds: float) -> Candidate:  # a real candidate whose generate advances the fake clock
        class Timed(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, tokens: torch.Tensor) -> torch.Tensor:
                return self.inner(tokens)  # type: ignore[no-any-return]

            def generate(self, tokens: torch.Tensor, n: int) -> torch.Tensor:
                now[0] += seconds
                return self.inner.generate(tokens, n)  # type: ignore[no-any-return]

        return Candidate(f"cost {seconds}", lambda m: Timed(int8_weights(m) if seconds < 1 else m), "int8")

    eager = Candidate("eager", lambda m: costs(2.0).build(m))
    fast = optimize(
        model, (prompt,), "generation", candidates=[eager, costs(0.5)], timer=lambda: now[0], repeat=2
    )
    assert fast.optimize_report.chosen == "cost 0.5" and fast.optimize_report.speedup == 4.0
    with pytest.raises(ValueError, match="needs a model with generate"):
        optimize(nn.Linear(2, 2), (prompt,), "generation")
    with pytest.raises(ValueError, match=r"example_inputs=\(prompt,\)"):
        optimize(model, (prompt.float(),), "generation")
    with pytest.raises(ValueError, match="'fp32', 'bf16' or 'int8'"):
        optimize(model, (prompt,), "generation", precision="int4")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 3, 40])  # the few-row kernel (where it builds) and torch's products
def test_weight_only_layers_keep_float32_activations(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    model = nn.Sequential(nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 24))
    x = torch.randn(rows, 48)
    with torch.no_grad():
        want = model(x)
        small = weight_only(copy.deepcopy(model), dtype)
        got = small(x)
    kind = Bf16Linear if dtype == torch.bfloat16 else Int8Linear
    assert [type(m) for m in small if not isinstance(m, nn.GELU)] == [kind, kind]
    assert got.dtype == torch.float32 and got.shape == (rows, 24)
    bound = 0.02 if dtype == torch.bfloat16 else 0.05  # the weights' rounding, through two layers
    assert (got - want).abs().max().item() <= bound * want.abs().max().item()
    assert (got - want).abs().max().item() > 0  # the weights were rounded: not the float32 model itself
    with pytest.raises(ValueError, match=r"torch\.bfloat16 or torch\.int8"):
        weight_only(model, torch.float16)
