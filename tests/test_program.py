"""A decode step lowered from the graph into one native program (specvit/nn/program.py, gemv.c's
specvit_program): the logits of the model's own step at every position and row count, the same generations,
the models it refuses with the node and why, and controls that break one op."""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import specvit
from specvit.generate import PACK_FROM
from specvit.nn import gemv
from specvit.nn import program as lowering
from specvit.nn.attention import Attention
from specvit.nn.cache import KVCache
from specvit.nn.norm import Norm
from specvit.nn.program import NotLowered, StepProgram, compile_step, lower_step
from specvit.nn.quant import weight_only

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"decoder.depth": 2, "decoder.width": 96, "decoder.block.heads": 6, "decoder.input.vocab": 97}
pytestmark = pytest.mark.skipif(not gemv.available(), reason="specvit's native kernel does not build here")


def _model(spec: str = "llama_smollm_135m", **over: object) -> specvit.SpecModel:
    torch.manual_seed(0)
    model = specvit.build_model(ROOT / "specs" / f"{spec}.yaml", overrides={**SMALL, **over}).eval()
    for norm in (m for m in model.modules() if isinstance(m, Norm | nn.RMSNorm) and m.weight is not None):
        nn.init.normal_(norm.weight, std=0.5)  # weights that are not all one (or zero)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.normal_(p, std=0.1)  # biases that are not zero
    return model


def _steps(model: nn.Module, program: StepProgram, rows: int, prompt: int, steps: int) -> float:
    """The largest logit difference between the model's own cached steps and the program's, after a prompt of
    ``prompt`` tokens, over ``steps`` steps fed the same random tokens."""
    cache, worst = KVCache(), 0.0
    with torch.no_grad():
        model(torch.randint(0, 97, (rows, prompt)), cache=cache)
        program.load(cache)
        for position in range(prompt, prompt + steps):
            if position >= program.capacity:
                program = program.grown()
            token = torch.randint(0, 97, (rows, 1))
            want = model(token, cache=cache, offset=position)[:, -1]  # (M, V)
            got = program(token, position)
            assert got.shape == want.shape
            diff = (got - want).abs().max().item() / want.abs().max().item()
            worst = max(worst, diff if math.isfinite(diff) else math.inf)  # a NaN misses too
    return worst


CASES = [
    ("llama_smollm_135m", {}),  # RMSNorm, RoPE over whole heads, GQA 6:3, a tied head
    ("llama_smollm_135m", {"decoder.block.kv_heads": 1}),  # MQA
    ("llama_smollm_135m", {"decoder.block.norm.unit_offset": True, "decoder.input.scale": True}),  # Gemma's
    (
        "llama_smollm_135m",
        {"decoder.block.qkv_bias": True, "decoder.block.proj_bias": True},
    ),  # Qwen2's biases
    ("llama_smollm_135m", {"decoder.block.attention_scale": 0.3, "head.tied": False}),
    # GPT-NeoX's parallel block, LayerNorm, RoPE over a quarter of each head, the erf GELU, biases
    ("pythia_160m", {}),
    ("gpt2_small", {}),  # learned positions, LayerNorm, the tanh GELU, a tied head
    ("bloom_560m", {"decoder.input.vocab": 97}),  # ALiBi (6 heads: slopes past a power of two)
    ("llama_smollm_135m", {"decoder.block.sliding_window": 8}),  # Mistral's window: a ring of 8 slots
    ("llama_smollm_135m", {"decoder.block.qk_norm": True}),  # Qwen3's QK-norm, per head
    ("llama_smollm_135m", {"decoder.block.qk_norm": "all"}),  # OLMo 2's, over all heads at once
    # Gemma 2's: soft-capped scores and logits, a window, the tanh GeGLU, 1 + w norms, a scaled embedding
    (
        "llama_smollm_135m",
        {
            "decoder.block.attention_softcap": 0.1,  # small enough to bend these scores
            "head.softcap": 3.0,
            "decoder.block.sliding_window": 6,
            "decoder.block.mlp.activation": "geglu_tanh",
            "decoder.block.norm.unit_offset": True,
            "decoder.input.scale": True,
        },
    ),
    # Gemma 3's parts: QK-norm, a window, the tanh GeGLU, 1 + w norms, a scaled embedding
    (
        "llama_smollm_135m",
        {
            "decoder.block.qk_norm": True,
            "decoder.block.sliding_window": 6,
            "decoder.block.mlp.activation": "geglu_tanh",
            "decoder.block.norm.unit_offset": True,
            "decoder.input.scale": True,
        },
    ),
]


@pytest.mark.parametrize(("spec", "over"), CASES)
@pytest.mark.parametrize("rows", [1, 3, gemv.MAX_ROWS])
def test_the_program_computes_the_models_step(spec: str, over: dict[str, object], rows: int) -> None:
    model = _model(spec, **over)
    torch.manual_seed(rows)
    assert _steps(model, lower_step(model, rows, 24), rows, prompt=5, steps=19) < 1e-5


@pytest.mark.parametrize(
    "activation", ["gelu", "gelu_tanh", "quick_gelu", "relu", "relu2", "silu", "geglu", "geglu_tanh"]
)
def test_every_activation_computes_the_models_step(activation: str) -> None:
    model = _model(**{"decoder.block.mlp.activation": activation})
    assert _steps(model, lower_step(model, 2, 24), 2, prompt=5, steps=8) < 1e-5


def test_control_another_gelu_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(**{"decoder.block.mlp.activation": "gelu"})
    monkeypatch.setattr(lowering, "ACTIVATIONS", {**lowering.ACTIVATIONS, nn.GELU: 2})  # quick GELU instead
    assert _steps(model, lower_step(model, 2, 24), 2, prompt=5, steps=3) > 1e-3


@pytest.mark.parametrize(("window", "cache_window"), [(4, None), (None, 4), (6, 3)])
def test_a_prompt_longer_than_the_window_lands_in_the_ring(
    window: int | None, cache_window: int | None
) -> None:
    model = _model(**({"decoder.block.sliding_window": window} if window else {}))
    cache = KVCache(cache_window)
    program = lower_step(model, 2, 24, cache_window)
    prompt, token = torch.randint(0, 97, (2, 13)), torch.randint(0, 97, (2, 1))
    with torch.no_grad():
        model(prompt, cache=cache)  # the cache holds positions 10-12 (or 11-12)
        program.load(cache)
        for position in range(13, 20):
            want = model(token, cache=cache, offset=position)[:, -1]
            torch.testing.assert_close(program(token, position), want, rtol=1e-5, atol=1e-5)


def test_calls_outside_the_program_are_refused() -> None:
    program = lower_step(_model(), 2, 24)
    for tokens, position, error in [
        (torch.tensor([[1], [97]]), 5, "token ids must lie in 0..96, got [1, 97]"),
        (torch.tensor([[1], [-1]]), 5, "token ids must lie in 0..96"),
        (
            torch.tensor([[1], [2]]),
            24,
            "holds 2 rows and 24 positions, got tokens of shape [2, 1] at position 24",
        ),
        (torch.tensor([[1]]), 5, "holds 2 rows"),
    ]:
        with pytest.raises(ValueError, match=re.escape(error)):
            program(tokens, position)
    assert program(torch.tensor([[1], [96]]), 0).shape == (2, 97)  # control: the same call in bounds runs


def test_controls_uncapped_scores_or_logits_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(**{"decoder.block.attention_softcap": 0.1, "head.softcap": 3.0})
    assert _steps(model, lower_step(model, 2, 24), 2, prompt=5, steps=8) < 1e-5
    with monkeypatch.context() as uncapped:
        for core in (m for m in model.modules() if isinstance(m, Attention)):
            uncapped.setattr(core, "softcap", None)
        scores = lower_step(model, 2, 24)
    assert _steps(model, scores, 2, prompt=5, steps=8) > 1e-4
    monkeypatch.setitem(lowering.LOWER, "softcap", lowering.LOWER["dropout"])  # the logits passed through
    assert _steps(model, lower_step(model, 2, 24), 2, prompt=5, steps=8) > 1e-3


def test_the_program_grows_with_its_keys_and_values() -> None:
    model = _model()
    program = lower_step(model, 2, 6)  # 5 prompt positions: doubles at 6, 12 and 24
    assert _steps(model, program, 2, prompt=5, steps=30) < 1e-5
    assert program.grown().capacity == 12


@pytest.mark.parametrize("weights", [torch.bfloat16, torch.int8])
def test_smaller_weights_lower_with_their_own_products(weights: torch.dtype) -> None:
    model = weight_only(_model(), weights)
    assert _steps(model, lower_step(model, 2, 24), 2, prompt=5, steps=12) < 1e-5


def test_controls_a_skipped_cache_or_a_dropped_residual_miss() -> None:
    model = _model()
    program = lower_step(model, 2, 24)
    program.load = lambda cache: None  # type: ignore[method-assign]  # the prompt's keys never copied (garbage)
    assert _steps(model, program, 2, prompt=5, steps=3) > 1e-2

    def no_residual(program: StepProgram, node: str, module: None, p: object, args: dict) -> None:  # type: ignore[type-arg]
        program.values[node] = args["branch"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(lowering.LOWER, "add", no_residual)
        broken = lower_step(model, 2, 24)
    assert _steps(model, broken, 2, prompt=5, steps=3) > 1e-2


@pytest.mark.parametrize(
    ("spec", "over", "rows", "why"),
    [
        (
            "llama_smollm_135m",
            {"decoder.block.mlp.activation": "xielu"},
            1,
            "decoder.blocks.0.mlp: the native step has no XIELU activation",
        ),
        (
            "llama_smollm_135m",
            {"decoder.block.qk_norm": True, "decoder.block.qk_norm_after_rope": True},
            1,
            "decoder.blocks.0.attn: QK-norm after RoPE",
        ),
        ("llama_smollm_135m", {}, gemv.MAX_ROWS + 1, "9 rows: the native step takes 1 to 8"),
    ],
)
def test_what_the_program_has_no_op_for_is_named(
    spec: str, over: dict[str, object], rows: int, why: str
) -> None:
    model = _model(spec, **over)
    with pytest.raises(NotLowered, match="^" + why.replace("(", r"\(")):
        lower_step(model, rows, 24)
    assert compile_step(model, rows, 24) is None


@pytest.mark.parametrize("sample", [False, True])
def test_generation_runs_the_program_with_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch, sample: bool
) -> None:
    model = _model()
    prompt, calls = torch.randint(0, 97, (3, 5)), [0]
    kwargs = {"temperature": 0.8, "top_k": 20} if sample else {}
    with monkeypatch.context() as before:  # the steps as they run without a program
        before.setattr(lowering, "compile_step", lambda *_, **__: None)
        want = model.generate(prompt, 40, generator=torch.Generator().manual_seed(0), **kwargs)
    real = gemv.run_program

    def counted(*args: object) -> None:
        calls[0] += 1
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gemv, "run_program", counted)
    got = model.generate(prompt, 40, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(got, want) and calls[0] == 39  # every step after the prompt's
    calls[0] = 0
    model.generate(prompt, PACK_FROM - 1)  # short generations keep the model's steps
    assert calls[0] == 0


def test_a_bounded_cache_generates_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    prompt, calls = torch.randint(0, 97, (2, 9)), [0]
    with monkeypatch.context() as before:
        before.setattr(lowering, "compile_step", lambda *_, **__: None)
        want = model.generate(prompt, 40, cache_window=6)
    real = gemv.run_program
    monkeypatch.setattr(gemv, "run_program", lambda *a: (calls.__setitem__(0, calls[0] + 1), real(*a)))
    got = model.generate(prompt, 40, cache_window=6)
    assert torch.equal(got, want) and calls[0] == 39
    assert not torch.equal(model.generate(prompt, 40), got)  # control: the window changes the tokens


def test_finished_rows_and_long_generations_match_the_models_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    prompt = torch.randint(0, 97, (4, 3))
    generation = importlib.import_module("specvit.generate")
    monkeypatch.setattr(generation, "PROGRAM_POSITIONS", 16)  # grows three times over 300 tokens
    got = model.generate(prompt, 300, eos_id=46, pad_id=0)
    with monkeypatch.context() as before:
        before.setattr(lowering, "compile_step", lambda *_, **__: None)
        want = model.generate(prompt, 300, eos_id=46, pad_id=0)
    assert torch.equal(got, want) and got.shape == (4, 303)
    assert (got == 46).any(dim=1).tolist() == [False, False, True, True]  # two rows end, two run to 300
