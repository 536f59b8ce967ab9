"""StableLM, Cohere and Phi (tables over the Llama-like layout, specvit/interop/hf_decoders2.py), GPT-2,
GPT-BigCode, GPT-J and OPT (tables of the GPT-2-like stack, specvit/interop/hf_gpt2.py), Falcon and MPT
(specvit/interop/hf_falcon.py, hf_mpt.py): from the config a
spec, from the state dict specvit's weights, and the same logits (fp32, <= 1e-4) and greedy tokens as
transformers. Every weight and persistent buffer is moved off its init by N(0, 0.08) noise.

Each config field a table reads is switched in turn: HF's output moves, and specvit's follows it exactly.
Table defaults are the HF config classes' defaults, and a field no table reads, or a value no spec states,
is refused with a SpecError naming it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from decoder_tables import (
    ATOL,
    VOCAB,
    check_defaults,
    check_parity,
    check_switch,
    check_switched,
    check_unread,
    hf,
    tokens,
)
from reference import converted
from torch import nn

import specvit
from specvit.errors import SpecError

SIZES = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=48, num_attention_heads=4)
LLAMA_NAMED = SIZES | dict(intermediate_size=40)
GPT2_NAMED = dict(vocab_size=VOCAB, n_layer=2, n_embd=48, n_head=4, n_positions=64)
THETA = {"rope_type": "default", "rope_theta": 50.0}
FALCON_40B = dict(new_decoder_architecture=True, num_kv_heads=2)  # two kv groups, ln_attn and ln_mlp

# family -> (config class, model class, config fields, [(field, another value[, the base's other fields])])

CASES: dict[str, tuple[str, str, dict[str, Any], list[tuple[Any, ...]]]] = {
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        LLAMA_NAMED | dict(hidden_size=64, num_key_value_heads=2),  # a quarter of 16 channels rotates
        [("use_parallel_residual", True), ("use_qkv_bias", True), ("layer_norm_eps", 0.3), ("hidden_act", "gelu"),
         ("num_key_value_heads", 4), ("rope_parameters", THETA | {"partial_rotary_factor": 0.5}),
         ("rope_parameters", THETA | {"partial_rotary_factor": 0.25}), ("tie_word_embeddings", True)],
    ),
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        LLAMA_NAMED | dict(num_key_value_heads=2, logit_scale=1.0, tie_word_embeddings=False),
        [("logit_scale", 0.5), ("layer_norm_eps", 0.3), ("attention_bias", True), ("num_key_value_heads", 1),
         ("hidden_act", "gelu"), ("head_dim", 8), ("rope_parameters", THETA), ("tie_word_embeddings", True)],
    ),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        LLAMA_NAMED | dict(num_key_value_heads=2),
        [("qk_layernorm", True), ("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("num_key_value_heads", 4),
         ("head_dim", 8), ("rope_parameters", THETA | {"partial_rotary_factor": 1.0}),
         ("tie_word_embeddings", True)],
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        GPT2_NAMED,
        [("n_inner", 40), ("activation_function", "relu"), ("layer_norm_epsilon", 0.3),
         ("scale_attn_weights", False), ("scale_attn_by_inverse_layer_idx", True), ("tie_word_embeddings", False)],
    ),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        GPT2_NAMED,
        [("multi_query", False), ("n_inner", 40), ("activation_function", "relu"), ("layer_norm_epsilon", 0.3),
         ("scale_attn_weights", False), ("tie_word_embeddings", False)],
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        GPT2_NAMED | dict(n_embd=88, n_head=2, rotary_dim=30, n_inner=40),  # 30 of each 44-wide head rotate
        [("rotary_dim", 16), ("n_inner", 24), ("activation_function", "relu"), ("layer_norm_epsilon", 0.3),
         ("tie_word_embeddings", True)],
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        SIZES | dict(ffn_dim=40, max_position_embeddings=64, tie_word_embeddings=False),
        [("do_layer_norm_before", False), ("_remove_final_layer_norm", True), ("layer_norm_elementwise_affine", False),
         ("enable_bias", False), ("activation_function", "gelu"), ("tie_word_embeddings", True)],
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        SIZES | dict(ffn_hidden_size=40),  # multi-query, one norm, in parallel
        [("multi_query", False), ("bias", True), ("parallel_attn", False), ("new_decoder_architecture", True),
         ("num_kv_heads", 1, FALCON_40B), ("num_ln_in_parallel_attn", 1, FALCON_40B), ("ffn_hidden_size", 24),
         ("activation", "relu"), ("layer_norm_epsilon", 0.3), ("rope_parameters", THETA),
         ("tie_word_embeddings", False)],
    ),
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        dict(vocab_size=VOCAB, n_layers=2, d_model=48, n_heads=6, max_seq_len=64),  # 6 heads: 8 slopes interleaved
        [("n_heads", 4), ("attn_config", {"softmax_scale": 0.5}), ("layer_norm_epsilon", 0.3),
         ("tie_word_embeddings", False)],
    ),
}  # fmt: skip

SHAPES_ONLY = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "n_embd", "n_layer", "n_head", "n_positions", "ffn_dim", "d_model", "n_layers"}  # fmt: skip
"""Read by the tables and switched by the sizes of the cases themselves (against the class defaults)."""
TRAINING_ONLY = {"attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"}
"""Change nothing in eval; test_dropout_fields_reach_the_spec checks they are read."""
ROPE = {"partial_rotary_factor", "rope_theta", "rope_scaling"}
"""Switched through rope_parameters, which transformers 5 writes them into."""
CHECKED = {"word_embed_proj_dim"}
"""Read only to refuse other values (test_values_a_table_cannot_state_are_refused)."""


def _hf(family: str, seed: int = 0, **change: Any) -> nn.Module:
    return hf(CASES[family], seed, **change)


def _config(ref: nn.Module) -> Any:
    return ref.config  # these families are read from their configs


@pytest.mark.parametrize("family", CASES)
def test_logits_and_greedy_tokens_are_transformers(family: str) -> None:
    check_parity(_hf(family), _config)


@pytest.mark.parametrize(
    ("family", "field", "value", "others"),
    [(f, k, v, (rest or [{}])[0]) for f, case in CASES.items() for k, v, *rest in case[3]],
)
def test_each_field_a_table_reads_moves_the_output_as_in_transformers(
    family: str, field: str, value: Any, others: dict[str, Any]
) -> None:
    check_switch(CASES[family], field, value, others, _config)


@pytest.mark.parametrize("family", CASES)
def test_every_field_a_table_reads_is_switched_by_a_test(family: str) -> None:
    check_switched(family, CASES[family], SHAPES_ONLY, TRAINING_ONLY, ROPE, CHECKED)


@pytest.mark.parametrize("family", CASES)
def test_table_defaults_are_the_config_class_defaults(family: str) -> None:
    """Each field's default is the class's, and a config that gives no field at all (a config.json of the
    model type alone) is the spec of the class's defaults, derived values (n_inner, multi_query) included."""
    check_defaults(family, CASES[family])


@pytest.mark.parametrize("family", CASES)
def test_a_field_no_table_reads_is_refused(family: str) -> None:
    check_unread(family, CASES[family])  # every field of the class is read


@pytest.mark.parametrize(
    ("family", "fields", "expected"),
    [
        ("stablelm", {"attention_dropout": 0.1, "hidden_dropout": 0.2}, {"attention": 0.1, "mlp": 0.2}),
        ("phi", {"embd_pdrop": 0.1, "resid_pdrop": 0.2, "attention_dropout": 0.3},
         {"embedding": 0.1, "projection": 0.2, "mlp": 0.2, "attention": 0.3}),
        ("gpt2", {"embd_pdrop": 0.1, "resid_pdrop": 0.2, "attn_pdrop": 0.3},
         {"embedding": 0.1, "projection": 0.2, "mlp": 0.2, "attention": 0.3}),
        ("gptj", {"embd_pdrop": 0.1, "resid_pdrop": 0.2, "attn_pdrop": 0.3},
         {"embedding": 0.1, "projection": 0.2, "mlp": 0.2, "attention": 0.3}),
        ("opt", {"dropout": 0.2, "attention_dropout": 0.3}, {"projection": 0.2, "mlp": 0.2, "attention": 0.3}),
        ("mpt", {"attn_config": {"attn_pdrop": 0.2}}, {"projection": 0.2, "mlp": 0.2, "attention": 0.2}),
    ],
)  # fmt: skip
def test_dropout_fields_reach_the_spec(
    family: str, fields: dict[str, Any], expected: dict[str, float]
) -> None:
    zero = {k: dict.fromkeys(v, 0.0) if isinstance(v, dict) else 0.0 for k, v in fields.items()}
    none = specvit.from_hf(_hf(family).config.to_dict() | zero).decoder.dropout
    spec = specvit.from_hf(_hf(family).config.to_dict() | fields).decoder.dropout
    assert {k: getattr(spec, k) for k in expected} == expected
    assert {k: getattr(none, k) for k in expected} == dict.fromkeys(expected, 0.0)  # the control


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("stablelm", {"qk_layernorm": True},
         "config.qk_layernorm: stablelm config has qk_layernorm=True: a QK LayerNorm with weights of its own "
         "for each head has no spec key"),
        ("stablelm", {"head_dim": 8}, "config.head_dim: stablelm config has head_dim=8: specvit's StableLm table"),
        ("cohere", {"use_qk_norm": True}, "config.use_qk_norm: cohere config has use_qk_norm=True: a QK LayerNorm"),
        ("cohere", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
         "config.rope_parameters: cohere config has rope_parameters="),
        ("gpt2", {"reorder_and_upcast_attn": True},
         "config.reorder_and_upcast_attn: gpt2 config has reorder_and_upcast_attn=True: it changes the attention's"),
        ("gpt2", {"add_cross_attention": True}, "config.add_cross_attention: gpt2 config has add_cross_attention=True"),
        ("gpt2", {"architectures": ["GPT2DoubleHeadsModel"]},
         "config.architectures: gpt2 config has architectures=['GPT2DoubleHeadsModel']: specvit reads the GPT2 "
         "classes GPT2Model, GPT2LMHeadModel"),
        ("gpt_bigcode", {"add_cross_attention": True}, "config.add_cross_attention: gpt_bigcode config has"),
        ("gptj", {"rotary_dim": None},
         "config.rotary_dim: gptj config has rotary_dim=None: transformers 4 then rotates a table n_embd wide"),
        ("opt", {"word_embed_proj_dim": 32},
         "config.word_embed_proj_dim: opt config has word_embed_proj_dim=32: token embeddings of another width "
         "than hidden_size 48"),
        ("opt", {"layerdrop": 0.1}, "config.layerdrop: opt config has layerdrop=0.1: dropping whole layers"),
        ("falcon", {"alibi": True}, "config.alibi: falcon config has alibi=True: Falcon's ALiBi is scaled by"),
        ("falcon", {"new_decoder_architecture": True, "parallel_attn": False},
         "config.parallel_attn: falcon config has parallel_attn=False: the new decoder architecture reads ln_attn"),
        ("falcon", {"num_ln_in_parallel_attn": 2},
         "config.num_ln_in_parallel_attn: falcon config has num_ln_in_parallel_attn=2: the old decoder"),
        ("falcon", {"hidden_dropout": 0.1}, "config.hidden_dropout: falcon config has hidden_dropout=0.1: a dropout"),
        ("falcon", {"apply_residual_connection_post_layernorm": True},
         "config.apply_residual_connection_post_layernorm: falcon config has"),
        ("mpt", {"attn_config": {"clip_qkv": 8.0}},
         "config.attn_config.clip_qkv: mpt config has attn_config.clip_qkv=8.0: clipping q, k and v has no spec key"),
        ("mpt", {"attn_config": {"alibi_bias_max": 16}},
         "config.attn_config.alibi_bias_max: mpt config has attn_config.alibi_bias_max=16: HF's MPT always uses"),
        ("mpt", {"attn_config": {"window": 4}}, "config.attn_config.window: mpt config has attn_config.window=4: "
         "specvit's Mpt table does not read this field"),
        ("mpt", {"no_bias": False}, "config.no_bias: mpt config has no_bias=False: HF's MPT has no biases"),
        ("mpt", {"expansion_ratio": 2}, "config.expansion_ratio: mpt config has expansion_ratio=2: HF's MPT's MLP"),
    ],
)  # fmt: skip
def test_values_a_table_cannot_state_are_refused(family: str, change: dict[str, Any], message: str) -> None:
    config = _hf(family).config.to_dict()
    specvit.from_hf(config)  # the control
    with pytest.raises(SpecError) as info:
        specvit.from_hf(config | change)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("family", "base_class", "backbone"),
    [("gpt2", "GPT2Model", "transformer"), ("opt", "OPTModel", "model"), ("gptj", "GPTJModel", "transformer"),
     ("phi", "PhiModel", "model")],
)  # fmt: skip
def test_the_base_model_class_has_no_head(family: str, base_class: str, backbone: str) -> None:
    """The base class's state dict (no backbone prefix, no lm_head) converts into a spec without a head."""
    import transformers

    ref = _hf(family)
    base = getattr(transformers, base_class)(ref.config).eval()
    base.load_state_dict(getattr(ref, backbone).state_dict())
    spec = specvit.from_hf(ref.config.to_dict() | {"architectures": [base_class]})
    assert spec.head.kind == "none"
    model = converted(base, spec)
    with torch.no_grad():
        diff = (model(tokens()) - base(input_ids=tokens()).last_hidden_state).abs().max().item()
    assert diff <= ATOL


def test_gpt2_defaults_are_the_gpt2_small_preset() -> None:
    """``GPT2Config()`` is specs/gpt2_small.yaml, dropouts included (its MLP written as 3072 wide, not ratio 4)."""
    from transformers import GPT2Config

    imported = specvit.from_hf(GPT2Config())
    preset = specvit.load_spec(
        "gpt2_small", overrides={"decoder.block.mlp.hidden": 3072, "decoder.block.mlp.ratio": None}
    )
    assert imported.model_dump(exclude={"name", "description"}) == preset.model_dump(
        exclude={"name", "description"}
    )
    assert specvit.build_graph(imported).total_params == 124_439_808
