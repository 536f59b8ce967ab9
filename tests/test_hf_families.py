"""Llama, Mistral, GPT-NeoX, BLOOM and T5: specs from HF configs, weights through the converter, and the
same logits and greedy tokens as transformers, at several sizes (odd head dims, GQA ratios, tied and untied
heads). References are built from configs with random weights, perturbed away from their init."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import converted, perturbed
from torch import nn
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

import specvit
from specvit.convert import convert_state_dict
from specvit.errors import SpecError
from specvit.model import SpecModel

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 97
# fp32: HF and specvit sum the same products in different orders (fused qkv, SDPA); 2.1e-6 seen (T5
# gated, no attention scaling), against the 1e-5.
ATOL = 1e-5


def _ours(ref: nn.Module) -> SpecModel:
    return converted(ref, specvit.from_hf(ref.config))


DECODERS: dict[str, tuple[type, type, dict[str, Any]]] = {
    # head_dim 12, GQA 4:2, untied
    "llama_gqa": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2),
    ),
    # head_dim 10 (not a power of two), MQA, tied, biases, explicit head_dim wider than width / heads
    "llama_odd": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            hidden_size=30,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=14,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    # a window of 5 keys, shorter than the 16-token sequences below
    "mistral_window": (
        MistralConfig,
        MistralForCausalLM,
        dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, sliding_window=5),
    ),
    # parallel residual, a quarter of each 16-wide head rotated
    "neox_parallel": (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        ),
    ),
    # sequential residual, half of each 12-wide head rotated, tied
    "neox_sequential": (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        dict(
            hidden_size=36,
            num_attention_heads=3,
            use_parallel_residual=False,
            tie_word_embeddings=True,
            rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"},
        ),
    ),
    "bloom_6_heads": (
        BloomConfig,
        BloomForCausalLM,
        dict(hidden_size=48, n_head=6),
    ),  # not a power of 2: extra slopes
    "bloom_untied": (
        BloomConfig,
        BloomForCausalLM,
        dict(hidden_size=40, n_head=4, tie_word_embeddings=False),
    ),
    "gpt2": (GPT2Config, GPT2LMHeadModel, dict(n_embd=48, n_head=4, n_positions=64)),
}


def _decoder(name: str) -> nn.Module:
    config_cls, model_cls, kw = DECODERS[name]
    depth = {"n_layer": 2} if config_cls in (BloomConfig, GPT2Config) else {"num_hidden_layers": 2}
    sizes = {} if config_cls in (BloomConfig, GPT2Config) else {"intermediate_size": 40}
    config = config_cls(vocab_size=VOCAB, **depth, **sizes, **kw)
    torch.manual_seed(sum(map(ord, name)))  # HF initialises from the global generator
    return perturbed(model_cls(config), seed=sum(map(ord, name)))


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_logits_match_hf(name: str) -> None:
    ref = _decoder(name)
    model = _ours(ref)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(input_ids=tokens).logits, atol=ATOL, rtol=0)


def _hf_greedy(ref: nn.Module, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """HF's greedy tokens: the prompt and exactly ``new`` more."""
    mask = torch.ones_like(prompt)
    return ref.generate(
        prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generation_matches_hf(name: str) -> None:
    """The KV-cache decode loop gives HF's tokens, past the sliding window and with ALiBi."""
    ref = _decoder(name)
    model = _ours(ref)
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model.generate(prompt, 14), _hf_greedy(ref, prompt, 14)
    assert torch.equal(ours, theirs)
    # not only a degenerate repeat, which a broken cache could reproduce too
    assert any(len(set(row[4:].tolist())) > 1 for row in ours)


def test_a_family_without_new_math_is_a_spec() -> None:
    """Qwen2 is Llama's block with q, k and v biases and RoPE's theta at 1e6: docs/examples/qwen2_tiny.yaml
    states it with no new code (docs/architecture.md, "Adding a family"), HF's weights load through the
    converter as they are, and logits and greedy tokens are HF's. The control, the spec with Llama's
    default theta, fails the same comparison."""
    spec = specvit.load_spec(ROOT / "docs" / "examples" / "qwen2_tiny.yaml")
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    ref = perturbed(Qwen2ForCausalLM(config), seed=5)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    control = specvit.load_spec(spec, overrides={"decoder.position.base": 10000.0})
    with torch.no_grad():
        theirs = ref(input_ids=tokens).logits
        torch.testing.assert_close(converted(ref, spec)(tokens), theirs, atol=ATOL, rtol=0)
        with pytest.raises(AssertionError, match="Tensor-likes are not close"):
            torch.testing.assert_close(converted(ref, control)(tokens), theirs, atol=ATOL, rtol=0)
        prompt = tokens[:, :4]
        ours, hf = converted(ref, spec).generate(prompt, 12), _hf_greedy(ref, prompt, 12)
    assert torch.equal(ours, hf)


def _t5(kw: dict[str, Any], seed: int) -> nn.Module:
    config = T5Config(vocab_size=VOCAB, d_ff=40, num_layers=2, dropout_rate=0.0, **kw)
    torch.manual_seed(seed)  # HF initialises from the global generator
    return perturbed(T5ForConditionalGeneration(config), seed)


T5S = {
    # head_dim 12 (d_kv), 3 decoder layers, relu, tied head fed width**-0.5 times its input
    "t5_relu": dict(d_model=48, d_kv=12, num_heads=4, num_decoder_layers=3),
    # T5 v1.1: gated tanh-GELU, 8 buckets up to distance 10 (the 16-token inputs reach the log buckets)
    "t5_gated": dict(
        d_model=32,
        d_kv=8,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=10,
    ),
}


@pytest.mark.parametrize("name", T5S)
def test_t5_logits_match_hf(name: str) -> None:
    ref = _t5(T5S[name], seed=3)
    model = _ours(ref)
    g = torch.Generator().manual_seed(4)
    src, tgt = torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 18), generator=g)
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, 11:] = True  # right padding in the second source
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=(~pad).long(), decoder_input_ids=tgt).logits
        torch.testing.assert_close(model(src, tgt, src_key_padding_mask=pad), theirs, atol=ATOL, rtol=0)


def test_t5_relative_bias_is_one_table_per_stack() -> None:
    """T5 keeps the bias table in its first layer and shares it: specvit has one node per stack."""
    spec = specvit.load_spec(ROOT / "specs" / "t5_small.yaml")
    graph = specvit.build_graph(spec)
    biases = [n for n in graph if graph[n]["op"] == "relative_bias"]
    assert biases == ["encoder.rel_bias", "decoder.rel_bias"]
    readers = [v for _, v in graph.nx.out_edges("encoder.rel_bias")]
    assert len(readers) == 6 and all(r.endswith(".attn") for r in readers)
    assert graph["encoder.rel_bias"]["p"].bidirectional and not graph["decoder.rel_bias"]["p"].bidirectional


# -- import --------------------------------------------------------------------------------------------


PRESETS = {
    "llama_smollm_135m": (
        LlamaConfig,
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        134_515_008,
    ),
    "mistral_7b": (
        MistralConfig,
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            rms_norm_eps=1e-5,
            sliding_window=4096,
        ),
        7_241_732_096,
    ),
    "pythia_160m": (
        GPTNeoXConfig,
        dict(
            vocab_size=50304,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
        ),
        162_322_944,
    ),
    "bloom_560m": (
        BloomConfig,
        dict(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16),
        559_214_592,
    ),
    "t5_small": (
        T5Config,
        dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8),
        60_506_624,
    ),
}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_are_their_hf_configs(name: str) -> None:
    """Each preset is what from_hf reads from the published config, with the published parameter count."""
    config_cls, kw, params = PRESETS[name]
    preset = specvit.load_spec(ROOT / "specs" / f"{name}.yaml")
    imported = specvit.from_hf(config_cls(**kw)).model_dump()
    assert {**imported, "name": preset.name, "description": preset.description} == preset.model_dump()
    assert specvit.build_graph(preset).total_params == params


def test_import_cli_writes_a_readable_spec(tmp_path: Path) -> None:
    config = MistralConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    config.to_json_file(tmp_path / "config.json")
    out = tmp_path / "spec.yaml"
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "import", "hf", str(tmp_path / "config.json"), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert "Source: config.json" in text
    assert "position: rope\n" in text and "base:" not in text and "eps:" not in text  # defaults left out
    assert "sliding_window: 8" in text and "kv_heads: 2" in text
    written = specvit.load_spec(out).model_copy(update={"description": ""})
    assert written == specvit.from_hf(tmp_path / "config.json").model_copy(update={"description": ""})
    assert specvit.from_hf(tmp_path / "config.json") == specvit.from_hf(config)


def test_import_cli_refuses_and_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(
        json.dumps({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    )
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "import", "hf", str(bad), "-o", str(tmp_path / "s.yaml")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "config.rope_parameters: llama config has rope_parameters=" in run.stderr
    assert "yarn RoPE scaling has no specvit position kind" in run.stderr
    assert not (tmp_path / "s.yaml").exists()


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (LlamaConfig(pretraining_tp=2), "config.pretraining_tp: llama config has pretraining_tp=2"),
        (LlamaConfig(hidden_act="tanh"), "config.hidden_act: llama config has hidden_act='tanh'"),
        (
            GPTNeoXConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "config.rope_parameters: gpt_neox config",
        ),
        (
            BloomConfig(apply_residual_connection_post_layernorm=True),
            "config.apply_residual_connection_post_layernorm: bloom config",
        ),
        (
            T5Config(feed_forward_proj="gated-relu"),
            "config.feed_forward_proj: t5 config has feed_forward_proj='gated-relu'",
        ),
        ({"model_type": "mamba"}, "config.model_type: model_type 'mamba' has no specvit family"),
    ],
    ids=["llama_tp", "llama_act", "neox_rope", "bloom_post_ln", "t5_ff", "unknown"],
)
def test_configs_specvit_cannot_state_are_refused(config: Any, field: str) -> None:
    with pytest.raises(SpecError) as info:
        specvit.from_hf(config)
    assert field in str(info.value)


def test_state_dict_of_another_family_is_refused() -> None:
    llama = _decoder("llama_gqa")
    bloom_spec = specvit.from_hf(_decoder("bloom_6_heads").config)
    with pytest.raises(ValueError, match="cannot convert a HF LlamaForCausalLM"):
        convert_state_dict(llama.state_dict(), "hf", bloom_spec)
