"""The families of the Llama-like layout, each a table (specvit/interop/hf_decoders.py): from the config a
spec, from the state dict specvit's weights, and the same logits (fp32, <= 1e-4) and greedy tokens as
transformers. Every weight and buffer is moved off its init by N(0, 0.08) noise.

Each config field a table reads is switched in turn: HF's output moves, and specvit's follows it exactly
(a field read into the spec but computed wrongly, or not read at all, fails). Table defaults are the HF
config classes' defaults, so a config.json that leaves a field out means what it means to transformers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import check_refused, check_table_defaults, converted, hf_noised, unswitched
from torch import nn

import specvit
from specvit.interop.table import TABLES, Table

VOCAB, N, ATOL, NOISE = 97, 16, 1e-4, 0.08
SMALL = dict(
    vocab_size=VOCAB, num_hidden_layers=2, hidden_size=48, num_attention_heads=4, intermediate_size=40
)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=None)  # no end token: HF would hold it back

# family -> (config class, model class, config fields beyond SMALL, [(field, another value)], the fields not
# switched here and why)
CASES: dict[str, tuple[str, str, dict[str, Any], list[tuple[str, Any]]]] = {
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1),
        [("sliding_window", 3), ("max_window_layers", 0), ("use_sliding_window", False), ("rms_norm_eps", 0.3),
         ("hidden_act", "gelu"), ("num_key_value_heads", 1), ("head_dim", 8),
         ("rope_parameters", {"rope_type": "default", "rope_theta": 50.0}),
         ("layer_types", ["sliding_attention", "sliding_attention"]), ("tie_word_embeddings", True)],
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, attention_bias=True, use_sliding_window=True, sliding_window=5,
             max_window_layers=1),
        [("attention_bias", False), ("rms_norm_eps", 0.3), ("head_dim", 8), ("use_sliding_window", False),
         ("sliding_window", 3), ("max_window_layers", 0), ("layer_types", ["sliding_attention", "full_attention"]),
         ("hidden_act", "gelu"), ("num_key_value_heads", 4),
         ("rope_parameters", {"rope_type": "default", "rope_theta": 50.0}), ("tie_word_embeddings", True)],
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(num_key_value_heads=1, head_dim=16, tie_word_embeddings=False),  # tied, greedy repeats the prompt
        [("hidden_act", "silu"), ("rms_norm_eps", 0.3), ("head_dim", 8), ("attention_bias", True),
         ("num_key_value_heads", 2),
         ("rope_parameters", {"rope_type": "default", "rope_theta": 50.0}), ("tie_word_embeddings", True)],
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=20, sliding_window=5,
             attn_logit_softcapping=5.0, final_logit_softcapping=3.0, attn_implementation="eager",
             tie_word_embeddings=False),
        [("query_pre_attn_scalar", 4), ("sliding_window", 3), ("attn_logit_softcapping", 2.0),
         ("final_logit_softcapping", 1.5), ("layer_types", ["full_attention", "sliding_attention"]),
         ("hidden_activation", "silu"), ("rms_norm_eps", 0.3), ("attention_bias", True), ("head_dim", 8),
         ("num_key_value_heads", 1),
         ("rope_parameters", {"rope_type": "default", "rope_theta": 50.0}), ("tie_word_embeddings", True)],
    ),
    "olmo": (
        "OlmoConfig",
        "OlmoForCausalLM",
        dict(num_key_value_heads=2),
        [("attention_bias", True), ("hidden_act", "gelu"), ("num_key_value_heads", 1),
         ("rope_parameters", {"rope_type": "default", "rope_theta": 50.0}), ("tie_word_embeddings", True)],
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(num_key_value_heads=2),
        [("rms_norm_eps", 0.3), ("attention_bias", True), ("hidden_act", "gelu"), ("num_key_value_heads", 1),
         ("rope_parameters", {"rope_type": "default", "rope_theta": 50.0}), ("tie_word_embeddings", True)],
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(num_key_value_heads=2, sliding_window=5,
             rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
        [("sliding_window", 3), ("rms_norm_eps", 0.3), ("hidden_act", "gelu"), ("num_key_value_heads", 4),
         ("head_dim", 8),
         ("rope_parameters", {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 1.0}),
         ("tie_word_embeddings", True)],
    ),
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(num_key_value_heads=2, sliding_window=5),
        [("use_bias", False), ("norm_epsilon", 0.3), ("hidden_act", "relu"), ("sliding_window", 3),
         ("num_key_value_heads", 1), ("head_dim", 8),
         ("rope_parameters", {"rope_type": "default", "rope_theta": 50.0}), ("tie_word_embeddings", False)],
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        [("num_experts_per_tok", 1), ("num_local_experts", 3), ("rms_norm_eps", 0.3), ("sliding_window", 3),
         ("num_key_value_heads", 1), ("head_dim", 8),
         ("hidden_act", "gelu"), ("rope_parameters", {"rope_type": "default", "rope_theta": 50.0}),
         ("tie_word_embeddings", True)],
    ),
}  # fmt: skip

SHAPES_ONLY = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"}
"""Read by every table and switched by the sizes of the cases themselves (SMALL against the defaults)."""
TRAINING_ONLY = {"attention_dropout"}
"""Changes nothing in eval; test_dropout_fields_reach_the_spec checks it is read."""


def _table(family: str) -> Table:
    import specvit.interop.hf  # noqa: F401  (registers every family)

    return TABLES[family]


def _hf(family: str, seed: int = 0, **change: Any) -> nn.Module:
    import transformers

    config_name, model_name, kw, _ = CASES[family]
    config = getattr(transformers, config_name)(**(SMALL | IDS | kw | change))
    return hf_noised(model_name, config, seed, NOISE)


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, N), generator=torch.Generator().manual_seed(seed))


def _logits(ref: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """specvit's logits (through from_hf and the converter) and HF's, on the same tokens."""
    model = converted(ref, specvit.from_hf(ref.config))
    with torch.no_grad():
        ours = model(_tokens())
        return ours["logits"] if isinstance(ours, dict) else ours, ref(input_ids=_tokens()).logits


@pytest.mark.parametrize("family", CASES)
def test_logits_and_greedy_tokens_are_transformers(family: str) -> None:
    ref = _hf(family)
    ours, theirs = _logits(ref)
    assert (ours - theirs).abs().max().item() <= ATOL
    model = converted(ref, specvit.from_hf(ref.config))
    prompt = _tokens(2)[:, :4]
    with torch.no_grad():
        got = model.generate(prompt, 12)
        want = ref.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
        )
    assert torch.equal(got, want)
    assert any(len(set(row[4:].tolist())) > 1 for row in got)  # not a degenerate repeat


@pytest.mark.parametrize(
    ("family", "field", "value"), [(f, k, v) for f, case in CASES.items() for k, v in case[3]]
)
def test_each_field_a_table_reads_moves_the_output_as_in_transformers(
    family: str, field: str, value: Any
) -> None:
    base = _hf(family)
    ref = _hf(family, **{field: value})
    ours, theirs = _logits(ref)
    assert (ours - theirs).abs().max().item() <= ATOL
    with torch.no_grad():
        before = base(input_ids=_tokens()).logits
    if before.shape == theirs.shape:  # the control: the field changes what HF computes
        assert (before - theirs).abs().max().item() > 10 * ATOL


@pytest.mark.parametrize("family", CASES)
def test_every_field_a_table_reads_is_switched_by_a_test(family: str) -> None:
    rope = {"partial_rotary_factor", "rope_theta", "rope_scaling", "mlp_bias"}
    untested = unswitched(_table(family), {k for k, _ in CASES[family][3]}, SHAPES_ONLY, TRAINING_ONLY, rope)
    assert not untested, f"{family}: fields read but never switched: {untested}"


@pytest.mark.parametrize("family", CASES)
def test_table_defaults_are_the_config_class_defaults(family: str) -> None:
    check_table_defaults(_table(family), CASES[family][0], family, whole=False)


@pytest.mark.parametrize("family", CASES)
def test_a_field_no_table_reads_is_refused(family: str) -> None:
    message = f"config.clip_logits: {family} config has clip_logits=4.0: specvit's"
    check_refused(
        _hf(family).config.to_dict(), {"clip_logits": 4.0}, message
    )  # every field of the class is read


def test_dropout_fields_reach_the_spec() -> None:
    spec = specvit.from_hf(_hf("qwen2", attention_dropout=0.25).config)
    assert spec.decoder.dropout.attention == 0.25


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("olmo", {"clip_qkv": 8.0}, "config.clip_qkv: olmo config has clip_qkv=8.0: clipping q, k and v"),
        (
            "mixtral",
            {"router_jitter_noise": 0.1},
            "config.router_jitter_noise: mixtral config has router_jitter",
        ),
        ("phi3", {"resid_pdrop": 0.1}, "config.resid_pdrop: phi3 config has resid_pdrop=0.1: dropout there"),
        (
            "gemma",
            {"use_bidirectional_attention": True},
            "config.use_bidirectional_attention: gemma config has",
        ),
        (
            "qwen2",
            {"architectures": ["Qwen2ForQuestionAnswering"]},
            "config.architectures: qwen2 config has",
        ),
    ],
)
def test_values_a_table_cannot_state_are_refused(family: str, change: dict[str, Any], message: str) -> None:
    check_refused(_hf(family).config.to_dict(), change, message)


def test_the_base_model_class_has_no_head() -> None:
    """``Qwen2Model``'s state dict (no ``model.`` prefix, no lm_head) converts into a spec without a head."""
    from transformers import Qwen2Model

    ref = _hf("qwen2")
    base = Qwen2Model(ref.config).eval()
    base.load_state_dict(ref.model.state_dict())
    config = ref.config.to_dict() | {"architectures": ["Qwen2Model"]}
    spec = specvit.from_hf(config)
    assert spec.head.kind == "none"
    model = converted(base, spec)
    with torch.no_grad():
        diff = (model(_tokens()) - base(input_ids=_tokens()).last_hidden_state).abs().max().item()
    assert diff <= ATOL


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3", "mistral_like_starcoder2"])
def test_sequence_classifiers_pool_the_last_real_token(family: str) -> None:
    """``*ForSequenceClassification``: the score of the last token that is not padding, right-padded rows
    included (HF finds them by pad_token_id, specvit by the padding mask)."""
    import transformers

    family = family.removeprefix("mistral_like_")
    config_name, _, kw, _ = CASES[family]
    config = getattr(transformers, config_name)(**(SMALL | IDS | kw | {"num_labels": 3}))
    torch.manual_seed(0)
    name = CASES[family][1].replace("ForCausalLM", "ForSequenceClassification")
    ref = getattr(transformers, name)(config).eval()
    with torch.no_grad():
        for t in ref.state_dict().values():
            t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) * NOISE)
    spec = specvit.from_hf(ref)  # the model: its class is the head (a config built in code names none)
    assert (spec.head.kind, spec.head.pool, spec.head.classes) == ("classifier", "last", 3)
    ids = _tokens()
    pad = torch.zeros_like(ids, dtype=torch.bool)
    pad[1, 11:] = True  # the second row is 11 tokens long
    ids = ids.masked_fill(pad, 0)
    model = converted(ref, spec)
    with torch.no_grad():
        theirs = ref(input_ids=ids, attention_mask=(~pad).long()).logits
        ours = model(ids, key_padding_mask=pad)
        control = model(ids)  # the last token, padding or not
    assert (ours - theirs).abs().max().item() <= ATOL
    assert (control - theirs)[1].abs().max().item() > 10 * ATOL
