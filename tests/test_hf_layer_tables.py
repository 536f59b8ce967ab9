"""Decoders whose layers differ along the depth, as tables over the Llama-like layout: SmolLM3, OLMo 3, Gemma 3
and Cohere 2 (specvit/interop/hf_layers.py: layers without rotary positions, windows and thetas per layer type)
and the mixtures of experts Qwen2-MoE, Qwen3-MoE and OLMoE (specvit/interop/hf_moe.py: a shared expert
behind its gate, dense layers among the sparse ones). From the config a spec, from the state dict specvit's
weights, and the same logits (fp32, <= 1e-4) and greedy tokens as transformers; every weight and buffer is
moved off its init by N(0, 0.08) noise.

Each config field a table reads is switched in turn: HF's output moves, and specvit's follows it exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from decoder_tables import (
    SIZES,
    THETA,
    Case,
    check_defaults,
    check_parity,
    check_round_trip,
    check_switch,
    check_switched,
    check_unread,
    hf,
)

import specvit
from specvit.errors import SpecError

KV = SIZES | dict(num_key_value_heads=2)
FOUR = KV | dict(num_hidden_layers=4)
TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
COMMON = [("num_key_value_heads", 4), ("hidden_act", "gelu"), ("rope_parameters", THETA),
          ("tie_word_embeddings", True)]  # fmt: skip
PER_TYPE = {"full_attention": THETA, "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}
WINDOWS = dict(use_sliding_window=True, sliding_window=5)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=24)
MOE = [("norm_topk_prob", True), ("num_experts_per_tok", 3), ("moe_intermediate_size", 16),
       ("mlp_only_layers", [1]), ("decoder_sparse_step", 2)]  # fmt: skip

CASES: dict[str, Case] = {
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", KV | dict(tie_word_embeddings=False),
                [("no_rope_layer_interval", 2), ("no_rope_layers", [0, 1]), ("rms_norm_eps", 0.3),
                 ("attention_bias", True), ("mlp_bias", True), ("head_dim", 8),
                 ("use_sliding_window", True, dict(sliding_window=5, no_rope_layer_interval=2)),
                 ("sliding_window", 3, WINDOWS | dict(no_rope_layer_interval=2)),
                 ("layer_types", ["sliding_attention", "full_attention"], dict(sliding_window=5)), *COMMON[:3],
                 ("tie_word_embeddings", True)]),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", FOUR | dict(sliding_window=5),
              [("sliding_window", 3), ("layer_types", TYPES), ("rope_parameters", PER_TYPE), ("rms_norm_eps", 0.3),
               ("attention_bias", True), *COMMON[:2], ("tie_word_embeddings", True)]),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    FOUR | dict(head_dim=12, sliding_window=5, layer_types=TYPES, tie_word_embeddings=False),
                    [("sliding_window", 3), ("layer_types", TYPES[1:] + TYPES[:1]), ("rope_parameters", PER_TYPE),
                     ("query_pre_attn_scalar", 8), ("final_logit_softcapping", 3.0), ("attention_bias", True),
                     ("rms_norm_eps", 0.3), ("hidden_activation", "silu"), ("num_key_value_heads", 4),
                     ("head_dim", 8), ("tie_word_embeddings", True)]),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", FOUR | dict(sliding_window=5, logit_scale=1.0),
                [("sliding_window", 3), ("layer_types", TYPES), ("logit_scale", 0.5), ("layer_norm_eps", 0.3),
                 ("attention_bias", True), ("head_dim", 8), *COMMON[:3], ("tie_word_embeddings", False)]),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  KV | EXPERTS | dict(num_experts=4, shared_expert_intermediate_size=32),
                  [*MOE, ("num_experts", 6), ("shared_expert_intermediate_size", 20), ("qkv_bias", False),
                   ("use_sliding_window", True, dict(sliding_window=5, max_window_layers=2)),
                   ("max_window_layers", 0, WINDOWS | dict(max_window_layers=2)),
                   ("sliding_window", 3, WINDOWS | dict(max_window_layers=2)),
                   ("layer_types", ["full_attention", "sliding_attention"], WINDOWS),
                   ("rms_norm_eps", 0.3), *COMMON]),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", KV | EXPERTS | dict(num_local_experts=4),
                  [*MOE, ("num_local_experts", 6), ("use_sliding_window", True, dict(sliding_window=5)),
                   ("sliding_window", 3, WINDOWS), ("attention_bias", True), ("head_dim", 8),
                   ("rms_norm_eps", 0.3), *COMMON]),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", KV | dict(num_experts=4, num_experts_per_tok=2),
              [("norm_topk_prob", True), ("num_experts_per_tok", 3), ("num_experts", 6), ("attention_bias", True),
               ("rms_norm_eps", 0.3), *COMMON]),
}  # fmt: skip

SHAPES_ONLY = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"}
"""Read by the tables and switched by the sizes of the cases themselves (against the class defaults)."""
TRAINING_ONLY = {"attention_dropout"}
ROPE = {"partial_rotary_factor", "rope_theta", "rope_scaling"}
ALIASES = {"sliding_window_pattern", "num_experts", "num_local_experts"}
"""Older names (Cohere 2's pattern, Qwen3-MoE's count of experts): test_older_field_names_read_alike."""


@pytest.mark.parametrize("family", CASES)
def test_logits_and_greedy_tokens_are_transformers(family: str) -> None:
    check_parity(hf(CASES[family]))


@pytest.mark.parametrize(
    ("family", "field", "value", "others"),
    [(f, k, v, (rest or [{}])[0]) for f, case in CASES.items() for k, v, *rest in case[3]],
)
def test_each_field_a_table_reads_moves_the_output_as_in_transformers(
    family: str, field: str, value: Any, others: dict[str, Any]
) -> None:
    check_switch(CASES[family], field, value, others)


@pytest.mark.parametrize("family", CASES)
def test_to_hf_writes_the_family_back(family: str, tmp_path: Path) -> None:
    check_round_trip(hf(CASES[family]), tmp_path)


@pytest.mark.parametrize("family", CASES)
def test_every_field_a_table_reads_is_switched_by_a_test(family: str) -> None:
    exempt = ALIASES if family in ("cohere2", "qwen2_moe", "qwen3_moe") else set()
    check_switched(family, CASES[family], SHAPES_ONLY, TRAINING_ONLY, ROPE, exempt)


@pytest.mark.parametrize("family", CASES)
def test_table_defaults_are_the_config_class_defaults(family: str) -> None:
    check_defaults(family, CASES[family])


@pytest.mark.parametrize("family", CASES)
def test_a_field_no_table_reads_is_refused(family: str) -> None:
    check_unread(family, CASES[family])


@pytest.mark.parametrize(
    ("family", "old", "new"),
    [
        (
            "cohere2",
            {"sliding_window_pattern": 2},
            {"layer_types": ["sliding_attention", "full_attention"] * 2},
        ),
        ("qwen3_moe", {"num_experts": 6}, {"num_local_experts": 6}),
    ],
)
def test_older_field_names_read_alike(family: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    """A config.json of older names is the spec of the new ones; the control: the names' values matter."""
    base = hf(CASES[family]).config.to_dict()
    rest = {k: v for k, v in base.items() if k not in new}
    assert specvit.from_hf(rest | old) == specvit.from_hf(base | new)
    assert specvit.from_hf(base | new) != specvit.from_hf(base)


def test_dense_layers_are_overrides_of_one_mlp() -> None:
    """Qwen2-MoE's dense layers (mlp_only_layers, and those decoder_sparse_step skips) are one MLP as wide as
    intermediate_size, under Llama's names; a model of dense layers only has no experts at all."""
    case = CASES["qwen2_moe"]
    spec = specvit.from_hf(hf(case, mlp_only_layers=[0]))
    assert spec.decoder.layer(0).mlp.moe is None and spec.decoder.layer(0).mlp.hidden == 40
    assert spec.decoder.layer(1).mlp.moe is not None and spec.decoder.layer(1).mlp.hidden == 24
    dense = specvit.from_hf(hf(case, mlp_only_layers=[0, 1]))
    assert dense.decoder.block.mlp.moe is None and not dense.decoder.overrides
    check_parity(hf(case, mlp_only_layers=[0, 1]))


@pytest.mark.parametrize(
    ("family", "change"),
    [("qwen2_moe", WINDOWS | dict(mlp_only_layers=[0], max_window_layers=2)), ("qwen3_moe", dict(mlp_only_layers=[1])),
     ("qwen2_moe", dict(mlp_only_layers=[0, 1])), ("smollm3", dict(no_rope_layer_interval=2) | WINDOWS)],
)  # fmt: skip
def test_layers_that_differ_go_back(family: str, change: dict[str, Any], tmp_path: Path) -> None:
    """to_hf writes the overrides back as the fields they were read from: dense layers as mlp_only_layers,
    windows as layer_types, layers without rotary positions as no_rope_layers."""
    check_round_trip(hf(CASES[family], **change), tmp_path)


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("smollm3", {"no_rope_layers": [1]},
         "config.no_rope_layers: smollm3 config has no_rope_layers=[1]: expected 0 or 1 for each of the 2 layers"),
        ("olmo3", {"rope_parameters": THETA},
         "config.rope_parameters: olmo3 config has rope_parameters={"),
        ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
         "config.rope_parameters.full_attention: olmo3 config has rope_parameters.full_attention="),
        ("qwen2_moe", {"layer_types": ["sliding_attention", "full_attention"]},
         "config.layer_types: qwen2_moe config has layer_types=['sliding_attention', 'full_attention']: sliding "
         "layers without use_sliding_window"),
        ("qwen2_moe", {"decoder_sparse_step": 0},
         "config.decoder_sparse_step: qwen2_moe config has decoder_sparse_step=0: it must be 1 or more"),
        ("qwen2_moe", {"mlp_only_layers": ["1"]},
         "config.mlp_only_layers: qwen2_moe config has mlp_only_layers=['1']: expected layer indexes"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0},
         "config.attn_logit_softcapping: gemma3_text config has attn_logit_softcapping=50.0: transformers' default"),
        ("olmoe", {"clip_qkv": 8.0}, "config.clip_qkv: olmoe config has clip_qkv=8.0: clipping q, k and v"),
        ("olmoe", {"architectures": ["OlmoeForSequenceClassification"]},
         "config.architectures: olmoe config has architectures=['OlmoeForSequenceClassification']"),
    ],
)  # fmt: skip
def test_values_a_table_cannot_state_are_refused(family: str, change: dict[str, Any], message: str) -> None:
    config = hf(CASES[family]).config.to_dict()
    specvit.from_hf(config)  # the control
    with pytest.raises(SpecError) as info:
        specvit.from_hf(config | change)
    assert message in str(info.value), str(info.value)
