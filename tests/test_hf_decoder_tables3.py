"""GPT-NeoX and BLOOM (tables, specvit/interop/hf_neox.py), and Ministral, Helium, InternLM 3, EXAONE,
IQuest-Coder, Seed-OSS, ERNIE 4.5, Arcee, GLM, GLM-4, Nemotron, Persimmon and Granite (tables over the Llama-like layout,
specvit/interop/hf_decoders3.py): from the config a spec, from the state dict specvit's weights, and the same
logits (fp32, <= 1e-4) and greedy tokens as transformers; every weight and buffer is moved off its init by
N(0, 0.08) noise.

Each config field a table reads is switched in turn: HF's output moves, and specvit's follows it exactly. Table
defaults are the HF config classes' defaults; a field no table reads, or a value no spec states, is refused
with a SpecError naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from decoder_tables import (
    ATOL,
    GQA,
    LLAMA_SWITCHES,
    SIZES,
    THETA,
    VOCAB,
    Case,
    check_defaults,
    check_parity,
    check_round_trip,
    check_switch,
    check_switched,
    check_unread,
    hf,
    tokens,
)
from reference import converted

import specvit
from specvit.errors import SpecError

BIASES = [("attention_bias", True), ("mlp_bias", True)]
HALF = THETA | {"partial_rotary_factor": 0.5}

CASES: dict[str, Case] = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", SIZES | dict(hidden_size=64, rope_parameters=THETA | {"partial_rotary_factor": 0.25}),
                 [("use_parallel_residual", False), ("attention_bias", False), ("layer_norm_eps", 0.3),
                  ("hidden_act", "relu"), ("rope_parameters", HALF), ("tie_word_embeddings", True)]),
    "bloom": ("BloomConfig", "BloomForCausalLM",  # untied: BLOOM's tied head repeats the last token here
              dict(vocab_size=VOCAB, n_layer=2, hidden_size=48, n_head=6, tie_word_embeddings=False),
              [("layer_norm_epsilon", 0.3), ("n_head", 4), ("tie_word_embeddings", True)]),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", GQA | dict(sliding_window=5),
                  [("sliding_window", 3), ("layer_types", ["full_attention", "sliding_attention"]), *LLAMA_SWITCHES]),
    "helium": ("HeliumConfig", "HeliumForCausalLM", GQA, [*BIASES, *LLAMA_SWITCHES[:3], *LLAMA_SWITCHES[4:]]),
    "internlm3": ("InternLM3Config", "LlamaForCausalLM", GQA,  # transformers refuses two bias settings
                  [(("attention_bias", "mlp_bias"), (True, True)), *LLAMA_SWITCHES]),
    "exaone": ("ExaoneConfig", "LlamaForCausalLM", GQA, [*BIASES, *LLAMA_SWITCHES]),
    "iquestcoder": ("IQuestCoderConfig", "LlamaForCausalLM", GQA, [*BIASES, *LLAMA_SWITCHES]),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", GQA,
                 [("attention_bias", False), ("attention_out_bias", True), ("mlp_bias", True), *LLAMA_SWITCHES]),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", GQA,
                 [("use_bias", True), *LLAMA_SWITCHES[:-1], ("tie_word_embeddings", False)]),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", GQA, [*BIASES, *LLAMA_SWITCHES[:2], ("hidden_act", "relu"),
                                                        *LLAMA_SWITCHES[3:]]),
    "glm": ("GlmConfig", "GlmForCausalLM", GQA, [("attention_bias", False), *LLAMA_SWITCHES[:-2],
                                                 ("rope_parameters", THETA | {"partial_rotary_factor": 1.0}),
                                                 ("tie_word_embeddings", True)]),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", GQA, [("attention_bias", False), *LLAMA_SWITCHES]),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", GQA,
                 [("norm_eps", 0.3), *BIASES, ("num_key_value_heads", 4), ("hidden_act", "relu"), ("head_dim", 8),
                  ("rope_parameters", THETA | {"partial_rotary_factor": 1.0}), ("tie_word_embeddings", True)]),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", SIZES,
                  [("qk_layernorm", False), ("layer_norm_eps", 0.3), ("hidden_act", "gelu"),
                   ("rope_parameters", THETA | {"partial_rotary_factor": 1.0}), ("tie_word_embeddings", True)]),
    "granite": ("GraniteConfig", "GraniteForCausalLM", SIZES | dict(num_key_value_heads=2, attention_multiplier=0.3),
                [("attention_multiplier", 0.1), ("logits_scaling", 2.0), *BIASES, *LLAMA_SWITCHES[:3],
                 *LLAMA_SWITCHES[4:]]),
}  # fmt: skip

SHAPES_ONLY = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "n_layer", "n_head"}  # fmt: skip
"""Read by the tables and switched by the sizes of the cases themselves (against the class defaults)."""
TRAINING_ONLY = {"attention_dropout", "hidden_dropout", "residual_dropout"}
"""Change nothing in eval; test_dropout_fields_reach_the_spec checks they are read."""
ROPE = {"partial_rotary_factor", "rope_theta", "rope_scaling"}
"""Switched through rope_parameters, which transformers 5 writes them into."""
ALIASES = {"rotary_pct", "rotary_emb_base", "n_embed", "num_layers", "layer_norm_epsilon", "activation_function",
           "qkv_bias", "bias"}  # fmt: skip
"""The names older config.json files give fields (a class's attribute_map): test_older_field_names_read_alike."""
CHECKED = {"helium": {"head_dim"}}
"""Read only to refuse other values (test_values_a_table_cannot_state_are_refused)."""


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
    check_switched(
        family, CASES[family], SHAPES_ONLY, TRAINING_ONLY, ROPE, ALIASES, CHECKED.get(family, set())
    )


@pytest.mark.parametrize("family", CASES)
def test_table_defaults_are_the_config_class_defaults(family: str) -> None:
    check_defaults(family, CASES[family])


@pytest.mark.parametrize("family", CASES)
def test_a_field_no_table_reads_is_refused(family: str) -> None:
    check_unread(family, CASES[family])


@pytest.mark.parametrize(
    ("family", "old", "new"),
    [
        ("gpt_neox", {"rotary_pct": 0.5, "rotary_emb_base": 50.0}, {"rope_parameters": HALF}),
        ("bloom", {"n_embed": 60}, {"hidden_size": 60}),
        ("internlm3", {"qkv_bias": True, "bias": True}, {"attention_bias": True, "mlp_bias": True}),
        ("exaone", {"num_layers": 2, "layer_norm_epsilon": 0.3, "activation_function": "gelu"},
         {"num_hidden_layers": 2, "rms_norm_eps": 0.3, "hidden_act": "gelu"}),
    ],
)  # fmt: skip
def test_older_field_names_read_alike(family: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    """A config.json of older names (transformers 4's, a class's attribute_map) is the spec of the new ones,
    and its model is HF's under the new names; the control: the names' values matter."""
    base = hf(CASES[family]).config.to_dict()
    rest = {k: v for k, v in base.items() if k not in new and k != "rope_parameters"}
    assert specvit.from_hf(rest | old) == specvit.from_hf(base | new)
    assert specvit.from_hf(rest | old) != specvit.from_hf(base)
    ref = hf(CASES[family], **new)
    model = converted(ref, specvit.from_hf(rest | old | {"architectures": [type(ref).__name__]}))
    with torch.no_grad():
        assert (model(tokens()) - ref(input_ids=tokens()).logits).abs().max().item() <= ATOL


def test_gpt_neox_checkpoints_name_the_head_embed_out() -> None:
    """transformers 4 and Pythia's checkpoints call the LM head embed_out: read as lm_head is."""
    ref = hf(CASES["gpt_neox"])
    state = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in ref.state_dict().items()}
    spec = specvit.from_hf(ref)
    model = specvit.build_model(spec).eval()
    model.load_state_dict(specvit.convert_state_dict(state, "hf", spec))
    with torch.no_grad():
        assert (model(tokens()) - ref(input_ids=tokens()).logits).abs().max().item() <= ATOL


@pytest.mark.parametrize(
    ("family", "fields", "expected"),
    [
        ("gpt_neox", {"hidden_dropout": 0.2, "attention_dropout": 0.3},
         {"embedding": 0.2, "projection": 0.2, "mlp": 0.2, "attention": 0.3}),
        ("bloom", {"hidden_dropout": 0.2, "attention_dropout": 0.3}, {"projection": 0.2, "mlp": 0.2, "attention": 0.3}),
        ("seed_oss", {"residual_dropout": 0.2, "attention_dropout": 0.3},
         {"projection": 0.2, "mlp": 0.2, "attention": 0.3}),
        ("persimmon", {"hidden_dropout": 0.2, "attention_dropout": 0.3}, {"mlp": 0.2, "attention": 0.3}),
    ],
)  # fmt: skip
def test_dropout_fields_reach_the_spec(
    family: str, fields: dict[str, Any], expected: dict[str, float]
) -> None:
    config = hf(CASES[family]).config.to_dict()
    spec = specvit.from_hf(config | fields).decoder.dropout
    none = specvit.from_hf(config | dict.fromkeys(fields, 0.0)).decoder.dropout
    assert {k: getattr(spec, k) for k in expected} == expected
    assert {k: getattr(none, k) for k in expected} == dict.fromkeys(expected, 0.0)  # the control


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("bloom", {"slow_but_exact": True}, "config.slow_but_exact: bloom config has slow_but_exact=True: it slices"),
        ("bloom", {"apply_residual_connection_post_layernorm": True},
         "config.apply_residual_connection_post_layernorm: bloom config has"),
        ("gpt_neox", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
         "config.rope_parameters: gpt_neox config has rope_parameters="),
        ("granite", {"embedding_multiplier": 12.0},
         "config.embedding_multiplier: granite config has embedding_multiplier=12.0: specvit has no constant scale"),
        ("granite", {"residual_multiplier": 0.22}, "config.residual_multiplier: granite config has residual_multiplier"),
        ("granite", {"logits_scaling": 0.0}, "config.logits_scaling: granite config has logits_scaling=0.0: the logits"),
        ("granite", {"architectures": ["GraniteForSequenceClassification"]},
         "config.architectures: granite config has architectures=['GraniteForSequenceClassification']: specvit reads"),
        ("ernie4_5", {"attention_dropout": 0.1}, "config.attention_dropout: ernie4_5 config has attention_dropout=0.1"),
        ("helium", {"head_dim": 8},
         "config.head_dim: helium config has head_dim=8: helium's o_proj takes hidden_size 48 channels, not 4 heads"),
        ("internlm3", {"attention_bias": True},
         "config.mlp_bias: internlm3 config has mlp_bias=False: the attention's biases are True: InternLM 3 has one"),
        ("ministral", {"layer_types": ["full_attention"]},
         "config.layer_types: ministral config has layer_types=['full_attention']: expected full_attention or"),
    ],
)  # fmt: skip
def test_values_a_table_cannot_state_are_refused(family: str, change: dict[str, Any], message: str) -> None:
    config = hf(CASES[family]).config.to_dict()
    specvit.from_hf(config)  # the control
    with pytest.raises(SpecError) as info:
        specvit.from_hf(config | change)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("family", "cls", "backbone"),
    [("gpt_neox", "GPTNeoXModel", "gpt_neox"), ("bloom", "BloomModel", "transformer"),
     ("nemotron", "NemotronModel", "model"), ("persimmon", "PersimmonModel", "model")],
)  # fmt: skip
def test_the_base_model_class_has_no_head(family: str, cls: str, backbone: str) -> None:
    """The base class's state dict (no backbone prefix, no head) converts into a spec without a head."""
    import transformers

    ref = hf(CASES[family])
    base = getattr(transformers, cls)(ref.config).eval()
    base.load_state_dict(getattr(ref, backbone).state_dict())
    spec = specvit.from_hf(base)
    assert spec.head.kind == "none"
    with torch.no_grad():
        diff = (
            (converted(base, spec)(tokens()) - base(input_ids=tokens()).last_hidden_state).abs().max().item()
        )
    assert diff <= ATOL


@pytest.mark.parametrize("family", ["gpt_neox", "bloom"])
@pytest.mark.parametrize(
    "task", ["ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering"]
)
def test_task_classes_are_transformers(family: str, task: str) -> None:
    """GPT-NeoX's and BLOOM's task classes (once read as causal LMs whatever the class) are their heads: the
    last token's score, a classifier on every token, (start, end) logits."""
    import transformers

    name = CASES[family][1].replace("ForCausalLM", task)
    config = getattr(transformers, CASES[family][0])(**(CASES[family][2] | dict(pad_token_id=0)))
    from reference import hf_noised

    ref = hf_noised(name, config, 0, 0.08)
    model = converted(ref, specvit.from_hf(ref))
    with torch.no_grad():
        out = ref(input_ids=tokens())
        want = (
            torch.stack([out.start_logits, out.end_logits], -1) if task.endswith("Answering") else out.logits
        )
        assert (model(tokens()) - want).abs().max().item() <= ATOL
