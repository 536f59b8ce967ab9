"""EXAONE 4, VaultGemma, Qwen3-VL's text models (dense and MoE), Granite-MoE (and -Shared), HunYuan dense and
Apertus (tables over the Llama-like layout, specvit/interop/hf_decoders4.py) and SplinterModel (BERT's layout,
hf_encoders2.py): from the config a spec, from the state dict specvit's weights, and the same logits or last
hidden state (fp32, <= 1e-4) and greedy tokens as transformers; every weight and buffer is moved off its init
by N(0, 0.08) noise.

Each config field a table reads is switched in turn: HF's output moves, and specvit's follows it exactly. Table
defaults are the HF config classes' defaults; a field no table reads, a value no spec states, or a class whose
head has no spec op (Splinter's QASS) is refused with a SpecError naming it.
"""

from __future__ import annotations

import copy
import json
import re
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
    dump,
    hf,
    tokens,
)
from reference import check_refused, check_table_defaults, converted, hf_noised, unswitched
from torch import nn

import specvit
from specvit.interop.table import TABLES

ALTERNATE = ["full_attention", "sliding_attention"]
NTK_ALPHA = {"rope_type": "dynamic", "alpha": 3.0, "rope_theta": 50.0, "factor": 1.0}
"""HunYuan's NTK-alpha RoPE: plain RoPE at base theta * alpha ** (hd / (hd - 2))."""

CASES: dict[str, Case] = {
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", GQA | dict(sliding_window=5, sliding_window_pattern=2),
                [("sliding_window", 3), ("layer_types", ALTERNATE), ("layer_types", ["sliding_attention"] * 2),
                 (("sliding_window", "layer_types"), (None, ["full_attention"] * 2)), *LLAMA_SWITCHES]),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM",  # untied: Gemma's tied greedy repeats the prompt
                   SIZES | dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=20, sliding_window=5,
                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=False),
                   [("query_pre_attn_scalar", 4), ("sliding_window", 3), ("attn_logit_softcapping", 2.0),
                    ("final_logit_softcapping", 1.5), ("layer_types", ALTERNATE), ("hidden_activation", "silu"),
                    ("rms_norm_eps", 0.3), ("attention_bias", True), ("head_dim", 8), ("num_key_value_heads", 1),
                    ("rope_parameters", THETA), ("tie_word_embeddings", True)]),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   SIZES | dict(num_key_value_heads=2, attention_multiplier=0.3, num_local_experts=4),
                   [("attention_multiplier", 0.1), ("logits_scaling", 2.0), ("attention_bias", True),
                    ("num_local_experts", 3), ("num_experts_per_tok", 1), *LLAMA_SWITCHES[:3], *LLAMA_SWITCHES[4:]]),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                         SIZES | dict(num_key_value_heads=2, attention_multiplier=0.3, num_local_experts=4,
                                      shared_intermediate_size=24),
                         [("shared_intermediate_size", 0), ("shared_intermediate_size", 16), ("attention_multiplier", 0.1),
                          ("logits_scaling", 2.0), ("attention_bias", True), ("num_local_experts", 3),
                          ("num_experts_per_tok", 1), *LLAMA_SWITCHES[:3], *LLAMA_SWITCHES[4:]]),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", GQA,  # HF needs a head_dim
                         [("attention_bias", True), ("rope_parameters", NTK_ALPHA), *LLAMA_SWITCHES]),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", GQA | dict(rope_parameters=THETA),  # not llama3 RoPE
                [("attention_bias", True), ("hidden_act", "relu2"), *LLAMA_SWITCHES[:2], *LLAMA_SWITCHES[3:4],
                 ("rope_parameters", THETA | {"rope_theta": 20.0}), LLAMA_SWITCHES[-1]]),
}  # fmt: skip
BARE: dict[str, Case] = {
    "qwen3_vl_text": ("Qwen3VLTextConfig", "Qwen3VLTextModel",
                      GQA | dict(rope_parameters=THETA | {"mrope_section": [2, 2, 2], "mrope_interleaved": True}),
                      [("attention_bias", True), ("rope_parameters", {"rope_type": "default", "rope_theta": 20.0,
                                                                      "mrope_section": [1, 2, 3]}),
                       *LLAMA_SWITCHES[:-2]]),
    "qwen3_vl_moe_text": ("Qwen3VLMoeTextConfig", "Qwen3VLMoeTextModel",
                          GQA | dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, rope_parameters=THETA),
                          [("attention_bias", True), ("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                           ("num_experts", 3), ("num_experts_per_tok", 1), ("moe_intermediate_size", 16),
                           *LLAMA_SWITCHES[:4], ("rope_parameters", THETA | {"rope_theta": 20.0})]),
}  # fmt: skip
"""Base models alone (no head, no greedy tokens): their last hidden state is compared."""

SHAPES_ONLY = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"}
TRAINING_ONLY = {"attention_dropout"}
ROPE = {"partial_rotary_factor", "rope_theta", "rope_scaling"}
READ_BY_DEFAULT = {"sliding_window_pattern", "num_local_experts"}
"""Read where a config leaves layer_types out (test_layer_types_a_config_leaves_out_are_the_class_s), and
num_experts' name in to_dict (attribute_map), which every Qwen3-VL-MoE case writes."""


@pytest.mark.parametrize("family", CASES)
def test_logits_and_greedy_tokens_are_transformers(family: str) -> None:
    check_parity(hf(CASES[family]))


INHERITED = {"num_key_value_heads", "rms_norm_eps", "hidden_act", "hidden_activation", "head_dim",
             "tie_word_embeddings"}  # fmt: skip
"""Fields of entries the tables take unchanged from Llama's or Gemma 2's (switched in their tests too): their
switches run with the slow tests, the family's own in the default run."""


def _switch(family: str, field: Any, value: Any) -> Any:
    inherited = field in INHERITED or (field == "rope_parameters" and value == THETA)
    return pytest.param(family, field, value, marks=[pytest.mark.slow] if inherited else [])


@pytest.mark.parametrize(
    ("family", "field", "value"), [_switch(f, k, v) for f, case in CASES.items() for k, v in case[3]]
)
def test_each_field_a_table_reads_moves_the_output_as_in_transformers(
    family: str, field: str, value: Any
) -> None:
    check_switch(CASES[family], field, value, {})


@pytest.mark.parametrize("family", CASES)
def test_to_hf_writes_the_family_back(family: str, tmp_path: Path) -> None:
    check_round_trip(hf(CASES[family]), tmp_path)


@pytest.mark.parametrize("family", [*CASES, *BARE])
def test_every_field_a_table_reads_is_switched_by_a_test(family: str) -> None:
    case = {**CASES, **BARE}[family]
    check_switched(family, case, SHAPES_ONLY, TRAINING_ONLY, ROPE, READ_BY_DEFAULT)


@pytest.mark.parametrize("family", [f for f in [*CASES, *BARE] if f != "apertus"])
def test_table_defaults_are_the_config_class_defaults(family: str) -> None:
    check_defaults(family, {**CASES, **BARE}[family])


def test_apertus_defaults_are_the_class_s_and_its_llama3_rope_is_refused() -> None:
    """Apertus's class defaults to Llama 3's RoPE scaling, which no spec states: refused by field, for a
    config of the model type alone as for the class's; every other default is the class's."""
    import transformers

    check_table_defaults(TABLES["apertus"], "ApertusConfig", "apertus", whole=False)
    for config, value in (({"model_type": "apertus"}, "None: Apertus's class then scales RoPE as Llama 3"),
                          (transformers.ApertusConfig(), "{'factor': 8.0")):  # fmt: skip
        with pytest.raises(specvit.SpecError, match=re.escape(f"apertus config has rope_parameters={value}")):
            specvit.from_hf(config)
    plain = {"rope_parameters": {"rope_type": "default", "rope_theta": 12000000.0}}
    assert dump({"model_type": "apertus"} | plain) == dump(transformers.ApertusConfig(**plain))


@pytest.mark.parametrize("family", [*CASES, *BARE])
def test_a_field_no_table_reads_is_refused(family: str) -> None:
    check_unread(family, {**CASES, **BARE}[family])


def test_layer_types_a_config_leaves_out_are_the_class_s() -> None:
    """EXAONE 4 derives its layer types from sliding_window_pattern where a config.json has none: one full
    layer (without rotary positions) in every pattern; the control: the pattern counts."""
    config = hf(CASES["exaone4"], num_hidden_layers=4).config.to_dict()
    assert config["layer_types"] == ALTERNATE[::-1] * 2
    left_out = {k: v for k, v in config.items() if k != "layer_types"}
    spec = specvit.from_hf(left_out)
    assert spec == specvit.from_hf(config)
    assert [o.layers for o in spec.decoder.overrides or []] == [[0, 2], [1, 3]]
    assert specvit.from_hf(left_out | {"sliding_window_pattern": 4}) != spec


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("exaone4", {"sliding_window": None},
         "config.layer_types: exaone4 config has layer_types=['sliding_attention', 'full_attention']: sliding "
         "layers without a sliding_window"),
        ("exaone4", {"sliding_window_pattern": "LG", "layer_types": None},
         "config.sliding_window_pattern: exaone4 config has sliding_window_pattern='LG': expected an integer"),
        ("exaone4", {"architectures": ["Exaone4ForQuestionAnswering"]},
         "config.architectures: exaone4 config has architectures=['Exaone4ForQuestionAnswering']: specvit reads"),
        ("vaultgemma", {"use_bidirectional_attention": True},
         "config.use_bidirectional_attention: vaultgemma config has use_bidirectional_attention=True: specvit's "
         "VaultGemma table does not read this field"),
        ("vaultgemma", {"architectures": ["VaultGemmaForSequenceClassification"]},
         "config.architectures: vaultgemma config has architectures=['VaultGemmaForSequenceClassification']"),
        ("granitemoe", {"embedding_multiplier": 12.0},
         "config.embedding_multiplier: granitemoe config has embedding_multiplier=12.0: specvit has no constant"),
        ("granitemoe", {"residual_multiplier": 0.22},
         "config.residual_multiplier: granitemoe config has residual_multiplier=0.22: specvit has no constant"),
        ("granitemoe", {"logits_scaling": 0.0}, "config.logits_scaling: granitemoe config has logits_scaling=0.0"),
        ("hunyuan_v1_dense", {"rope_parameters": NTK_ALPHA | {"alpha": -1.0}},
         "config.rope_parameters: hunyuan_v1_dense config has rope_parameters={'alpha': -1.0, 'factor': 1.0, "
         "'rope_theta': 50.0, 'rope_type': 'dynamic'}: its base is rope_theta * alpha ** (head_dim / (head_dim - 2))"),
        ("hunyuan_v1_dense", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 50.0}},
         "config.rope_parameters: hunyuan_v1_dense config has rope_parameters="),
        ("hunyuan_v1_dense", {"architectures": ["HunYuanDenseV1ForTokenClassification"]},
         "config.architectures: hunyuan_v1_dense config has architectures=['HunYuanDenseV1ForTokenClassification']"),
        ("qwen3_vl_text", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
         "config.rope_parameters: qwen3_vl_text config has rope_parameters="),
    ],
)  # fmt: skip
def test_values_a_table_cannot_state_are_refused(family: str, change: dict[str, Any], message: str) -> None:
    check_refused(hf({**CASES, **BARE}[family]).config.to_dict(), change, message)


def test_the_multimodal_qwen3_vl_is_refused_by_model_type() -> None:
    """Qwen3-VL's whole model (a vision tower feeding the decoder) is no family; its text model is."""
    import transformers

    config = transformers.Qwen3VLConfig(text_config=BARE["qwen3_vl_text"][2]).to_dict()
    with pytest.raises(specvit.SpecError, match="qwen3_vl"):
        specvit.from_hf(config)
    specvit.from_hf(config["text_config"] | {"model_type": "qwen3_vl_text"})  # the control


# -- base models: the last hidden state ------------------------------------------------------------------


def _hidden(ref: nn.Module, config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    model = converted(ref, specvit.from_hf(ref if config is None else config))
    with torch.no_grad():
        ours = model(tokens())  # an MoE's beside its router loss
        return ours["logits"] if isinstance(ours, dict) else ours, ref(input_ids=tokens()).last_hidden_state


_BEFORE: dict[str, torch.Tensor] = {}


@pytest.mark.parametrize(
    ("family", "field", "value"), [(f, k, v) for f, case in BARE.items() for k, v in [(None, None), *case[3]]]
)
def test_a_base_model_is_transformers_and_follows_each_field(
    family: str, field: str | None, value: Any
) -> None:
    """The last hidden state (field None: the case itself); each field switched moves HF's (the control)."""
    ours, theirs = _hidden(hf(BARE[family], **({field: value} if field else {})))
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= ATOL
    if field is None:
        _BEFORE[family] = theirs
    else:
        before = _BEFORE.get(family)
        before = _hidden(hf(BARE[family]))[1] if before is None else before
        assert (before - theirs).abs().max().item() > 10 * ATOL


def test_a_base_model_goes_back_to_its_class(tmp_path: Path) -> None:
    import transformers

    ref = hf(BARE["qwen3_vl_text"])
    ours = converted(ref, specvit.from_hf(ref))
    specvit.to_hf(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    back = getattr(transformers, config["architectures"][0]).from_pretrained(tmp_path).eval()
    assert type(back) is type(ref)
    with torch.no_grad():
        want = ref(input_ids=tokens()).last_hidden_state
        assert (back(input_ids=tokens()).last_hidden_state - want).abs().max().item() <= 1e-5
        assert (
            want - hf(BARE["qwen3_vl_text"], seed=1)(input_ids=tokens()).last_hidden_state
        ).abs().max() > 0.1


# -- Splinter --------------------------------------------------------------------------------------------

SPLINTER = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=48, num_attention_heads=4, intermediate_size=40,
                max_position_embeddings=40, question_token_id=5)  # fmt: skip
SPLINTER_SWITCHES = [("type_vocab_size", 3), ("layer_norm_eps", 0.3), ("hidden_act", "relu")]


def _splinter(cls: str = "SplinterModel", **change: Any) -> nn.Module:
    import transformers

    return hf_noised(cls, transformers.SplinterConfig(**copy.deepcopy(SPLINTER | change)), 0, 0.08)


def _splinter_outputs(ref: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """specvit's and HF's last hidden states at the real tokens of a padded batch with token types."""
    gen = torch.Generator().manual_seed(1)
    keep = torch.ones(2, 12, dtype=torch.long)
    keep[1, 7:] = 0
    ids, types = torch.randint(3, VOCAB, (2, 12), generator=gen), torch.randint(0, 2, (2, 12), generator=gen)
    model = converted(ref, specvit.from_hf(ref.config.to_dict()))
    with torch.no_grad():
        ours = model(ids, key_padding_mask=~keep.bool(), token_type_ids=types)
        theirs = ref(input_ids=ids, attention_mask=keep, token_type_ids=types).last_hidden_state
    return ours[keep.bool()], theirs[keep.bool()]


@pytest.mark.parametrize(("field", "value"), [(None, None), *SPLINTER_SWITCHES])
def test_splinter_is_transformers_and_follows_each_field(field: str | None, value: Any) -> None:
    ours, theirs = _splinter_outputs(_splinter(**({field: value} if field else {})))
    assert (ours - theirs).abs().max().item() <= ATOL
    if field is not None:  # the control
        assert (_splinter_outputs(_splinter())[1] - theirs).abs().max().item() > 10 * ATOL


def test_splinter_reads_its_fields_and_defaults() -> None:
    table = TABLES["splinter"]
    untested = unswitched(table, {k for k, _ in SPLINTER_SWITCHES}, SHAPES_ONLY | {"max_position_embeddings"},
                          {"hidden_dropout_prob", "attention_probs_dropout_prob"})  # fmt: skip
    assert not untested
    check_table_defaults(table, "SplinterConfig", "splinter")
    check_unread("splinter", ("SplinterConfig", "SplinterModel", SPLINTER, []))


@pytest.mark.parametrize("cls", ["SplinterForQuestionAnswering", "SplinterForPreTraining"])
def test_splinter_s_span_selection_classes_are_refused(cls: str) -> None:
    """QASS gathers the question tokens' states by their id and scores spans bilinearly: no spec op."""
    check_refused(
        _splinter().config.to_dict(),
        {"architectures": [cls]},
        f"config.architectures: splinter config has architectures=['{cls}']: specvit reads the Splinter "
        "classes SplinterModel",
    )


def test_hunyuan_reads_the_hubs_older_rope_scaling_layout() -> None:
    """Published HunYuan config.json files give ``rope_scaling: {type: dynamic, alpha}`` beside a top-level
    ``rope_theta``: the same base as transformers 5's ``rope_parameters``; the control, no scaling, is plain
    RoPE at rope_theta, and dynamic scaling without an alpha stays refused."""
    base = {"model_type": "hunyuan_v1_dense", "head_dim": 12, "architectures": ["HunYuanDenseV1ForCausalLM"]}
    new = specvit.from_hf(base | {"rope_parameters": NTK_ALPHA})
    old = specvit.from_hf(base | {"rope_scaling": {"type": "dynamic", "alpha": 3.0}, "rope_theta": 50.0})
    assert old.decoder.position.base == new.decoder.position.base == pytest.approx(50.0 * 3.0 ** (12 / 10))
    assert specvit.from_hf(base | {"rope_theta": 50.0}).decoder.position.base == 50.0
    with pytest.raises(specvit.SpecError, match="dynamic RoPE scaling has no specvit position kind"):
        specvit.from_hf(base | {"rope_scaling": {"type": "dynamic"}, "rope_theta": 50.0})


def test_splinter_read_from_its_model_has_no_pooler() -> None:
    """SplinterModel holds no pooler: read from the model (not its config), the spec is headless and loads
    every weight strictly; its outputs are the last hidden state."""
    ref = _splinter()
    spec = specvit.from_hf(ref)
    assert spec.head.kind == "none"
    model = converted(ref, spec)  # strict: a pooler's linear would have no weights
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(ids) - ref(input_ids=ids).last_hidden_state).abs().max().item() <= ATOL
