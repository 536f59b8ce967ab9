"""The families of the BERT-like encoder layout, each a table (specvit/interop/hf_bert.py, hf_encoders.py): from
the config a spec, from the state dict specvit's weights, and the same last hidden state and task logits (fp32,
<= 1e-4) as transformers, on padded batches. Every weight and buffer is moved off its init by N(0, 0.08) noise.

Each config field a table reads is switched in turn: HF's output moves, and specvit's follows it exactly. Table
defaults are the HF config classes' defaults; an unknown field, and a value or class the spec cannot state, is
refused with the field named.
"""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import check_refused, check_table_defaults, converted, hf_config, hf_noised, unswitched
from torch import nn

import specvit
from specvit.convert import convert_state_dict
from specvit.interop.table import TABLES, Table

ROOT = Path(__file__).resolve().parents[1]
VOCAB, N, ATOL, NOISE = 97, 12, 1e-4, 0.08
SIZES = dict(
    vocab_size=VOCAB,
    num_hidden_layers=2,
    hidden_size=48,
    num_attention_heads=4,
    intermediate_size=40,
    max_position_embeddings=40,
)
LABELS = {i: f"L{i}" for i in range(5)}
THREE = {i: f"L{i}" for i in range(3)}
# roberta-base's: one token type, the table's rows the positions + 2
ROBERTA = SIZES | dict(type_vocab_size=1, max_position_embeddings=42)
MLM, SEQ = "ForMaskedLM", "ForSequenceClassification"
ROBERTA_SWITCHES = [("pad_token_id", 2), ("layer_norm_eps", 0.3), ("hidden_act", "relu"),
                    ("type_vocab_size", 2), ("id2label", THREE), ("tie_word_embeddings", False, MLM),
                    ("layer_norm_eps", 0.3, MLM), ("id2label", THREE, SEQ)]  # fmt: skip

TASKS = ("Model", "ForTokenClassification", "ForQuestionAnswering", MLM, SEQ)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)  # within VOCAB
MODERNBERT = SIZES | IDS | dict(num_hidden_layers=4, local_attention=6)  # windows of 3 either side, 12 tokens
GLOBAL_FIRST = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
THETAS = {"full_attention": {"rope_type": "default", "rope_theta": 50.0},
          "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}  # fmt: skip

# family -> (HF class prefix, config fields, [(field, another value[, the class switched, by default the token
# classifier])], the task classes a table maps)
CASES: dict[str, tuple[str, dict[str, Any], list[tuple[Any, ...]], tuple[str, ...]]] = {
    "bert": ("Bert", SIZES, [("type_vocab_size", 3), ("layer_norm_eps", 0.3), ("hidden_act", "relu"),
                             ("id2label", THREE), ("tie_word_embeddings", False, MLM), ("hidden_act", "relu", MLM),
                             ("layer_norm_eps", 0.3, MLM), ("id2label", THREE, SEQ)], TASKS),
    "roberta": ("Roberta", ROBERTA, ROBERTA_SWITCHES, TASKS),
    "xlm-roberta": ("XLMRoberta", ROBERTA, ROBERTA_SWITCHES, TASKS),
    "camembert": ("Camembert", ROBERTA, ROBERTA_SWITCHES, TASKS),
    "data2vec-text": ("Data2VecText", ROBERTA, ROBERTA_SWITCHES, TASKS),
    "electra": ("Electra", SIZES | dict(embedding_size=16),
                [("embedding_size", 48), ("embedding_size", 24), ("layer_norm_eps", 0.3), ("hidden_act", "relu"),
                 ("type_vocab_size", 3), ("id2label", THREE), ("tie_word_embeddings", False, MLM),
                 ("embedding_size", 48, MLM), ("layer_norm_eps", 0.3, MLM)], TASKS),
    "albert": ("Albert", SIZES | dict(num_hidden_layers=4, embedding_size=16, num_hidden_groups=2),
               [("num_hidden_groups", 1), ("num_hidden_groups", 4), ("embedding_size", 24),
                ("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("type_vocab_size", 3), ("id2label", THREE),
                ("tie_word_embeddings", False, MLM), ("hidden_act", "relu", MLM), ("embedding_size", 24, MLM)],
               TASKS),
    "distilbert": ("DistilBert", dict(vocab_size=VOCAB, n_layers=2, dim=48, n_heads=4, hidden_dim=40,
                                      max_position_embeddings=40),
                   [("activation", "relu"), ("id2label", THREE), ("tie_word_embeddings", False, MLM),
                    ("activation", "relu", MLM), ("activation", "relu", SEQ)], TASKS),
    "modernbert": ("ModernBert", MODERNBERT,
                   [("local_attention", 4), ("layer_types", GLOBAL_FIRST), ("rope_parameters", THETAS),
                    ("norm_eps", 0.3), ("norm_bias", True), ("hidden_activation", "silu"), ("mlp_bias", True),
                    ("attention_bias", True), ("tie_word_embeddings", False, MLM), ("decoder_bias", False, MLM),
                    ("norm_eps", 0.3, MLM), ("classifier_bias", True, SEQ), ("classifier_activation", "relu", SEQ),
                    ("classifier_pooling", "mean", SEQ)], TASKS),
}  # fmt: skip

SHAPES_ONLY = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "max_position_embeddings", "dim", "n_layers", "n_heads", "hidden_dim"}  # fmt: skip
"""Read by every table and switched by the sizes of the cases themselves (against the defaults)."""
TRAINING_ONLY = {"hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout",
                 "embedding_dropout", "mlp_dropout"}  # fmt: skip
"""Change nothing in eval; test_training_fields_reach_the_spec checks they are read."""
LEGACY = {"global_attn_every_n_layers", "global_rope_theta", "local_rope_theta"}
"""ModernBERT's fields of older config.json files; test_older_modernbert_configs_are_read switches them."""


def _table(family: str) -> Table:
    import specvit.interop.hf  # noqa: F401  (registers every family)

    return TABLES[family]


def _hf(family: str, suffix: str | None = None, seed: int = 0, **change: Any) -> nn.Module:
    """HF's ``suffix`` class of the family (a base model without its pooler), its weights and buffers moved;
    by default its token classifier (the base model where a table maps none)."""
    import transformers

    prefix, sizes, _, classes = CASES[family]
    suffix = suffix or ("ForTokenClassification" if "ForTokenClassification" in classes else "Model")
    labels = {} if suffix == "ForQuestionAnswering" else {"id2label": LABELS}
    config = getattr(transformers, prefix + "Config")(**(sizes | labels | change))
    model_class = getattr(transformers, prefix + suffix)
    pooled = "add_pooling_layer" in inspect.signature(model_class.__init__).parameters
    return hf_noised(prefix + suffix, config, seed, NOISE, **({"add_pooling_layer": False} if pooled else {}))


_config = hf_config


def _inputs(ref: nn.Module) -> dict[str, torch.Tensor]:
    """Token ids (none a special id) for two rows, the second padded after 7 tokens, and token types when the
    model has two or more."""
    gen = torch.Generator().manual_seed(1)
    mask = torch.ones(2, N, dtype=torch.long)
    mask[1, 7:] = 0  # HF: 1 = keep
    inputs = {"input_ids": torch.randint(3, VOCAB, (2, N), generator=gen), "attention_mask": mask}
    if getattr(ref.config, "type_vocab_size", 0) >= 2:
        inputs["token_type_ids"] = torch.randint(0, 2, (2, N), generator=gen)
    return inputs


def _output(out: Any) -> torch.Tensor:
    """HF's output as specvit gives it: (start, end) logits as the last axis of one tensor."""
    if hasattr(out, "start_logits"):
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _outputs(ref: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """specvit's output (through from_hf and the converter) and HF's, at the tokens HF defines: a padded
    query attends to the real tokens in both, but HF leaves its row undefined."""
    model = converted(ref, specvit.from_hf(_config(ref)))
    inputs = _inputs(ref)
    keep = inputs["attention_mask"].bool()
    types = {"token_type_ids": inputs["token_type_ids"]} if "token_type_ids" in inputs else {}
    with torch.no_grad():
        ours = model(inputs["input_ids"], key_padding_mask=~keep, **types)
        theirs = _output(ref(**inputs))
    ours = ours["logits"] if isinstance(ours, dict) else ours
    if ours.ndim == 2:  # a sequence's logits
        return ours, theirs
    return ours[keep], theirs[keep]


@pytest.mark.parametrize(("family", "suffix"), [(f, s) for f, case in CASES.items() for s in case[3]])
def test_each_class_is_transformers(family: str, suffix: str) -> None:
    ref = _hf(family, suffix)
    ours, theirs = _outputs(ref)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= ATOL
    inputs = _inputs(ref)
    with torch.no_grad():  # the control: the padding changes what HF computes at the real tokens
        unmasked = _output(ref(**(inputs | {"attention_mask": torch.ones_like(inputs["attention_mask"])})))
    assert (unmasked[1, :7] - _output(ref(**inputs))[1, :7]).abs().max().item() > 10 * ATOL


@functools.cache
def _reference(family: str, suffix: str | None) -> torch.Tensor:
    """HF's output of the family's case as it is, which each switched field must move (computed once)."""
    return _outputs(_hf(family, suffix))[1]


@pytest.mark.parametrize(
    ("family", "field", "value", "suffix"),
    [(f, k, v, (*c, None)[0]) for f, case in CASES.items() for k, v, *c in case[2]],
)
def test_each_field_a_table_reads_moves_the_output_as_in_transformers(
    family: str, field: str, value: Any, suffix: str | None
) -> None:
    ref = _hf(family, suffix, **{field: value})
    ours, theirs = _outputs(ref)
    assert (ours - theirs).abs().max().item() <= ATOL
    before = _reference(family, suffix)
    if before.shape == theirs.shape:  # the control: the field changes what HF computes
        assert (before - theirs).abs().max().item() > 10 * ATOL


@pytest.mark.parametrize("family", CASES)
def test_every_field_a_table_reads_is_switched_by_a_test(family: str) -> None:
    untested = unswitched(
        _table(family), {k for k, *_ in CASES[family][2]}, SHAPES_ONLY, TRAINING_ONLY, LEGACY
    )
    assert not untested, f"{family}: fields read but never switched: {untested}"


@pytest.mark.parametrize("family", CASES)
def test_table_defaults_are_the_config_class_defaults(family: str) -> None:
    """Each field's default is the config class's, and a config that leaves every field out is the class's."""
    check_table_defaults(_table(family), CASES[family][0] + "Config", family)


@pytest.mark.parametrize("family", CASES)
def test_a_field_no_table_reads_is_refused(family: str) -> None:
    message = f"config.clip_logits: {family} config has clip_logits=4.0: specvit's"
    check_refused(_config(_hf(family)), {"clip_logits": 4.0}, message)  # every field of the class is read


def test_training_fields_reach_the_spec() -> None:
    """Dropout rates and the padding row change nothing in eval: they are read, not switched above."""
    bert = specvit.from_hf(_config(_hf("bert", hidden_dropout_prob=0.25, attention_probs_dropout_prob=0.5)))
    drop = bert.encoder.dropout
    assert (drop.embedding, drop.attention, drop.projection, drop.mlp) == (0.25, 0.5, 0.25, 0.25)
    distil = specvit.from_hf(_config(_hf("distilbert", dropout=0.25, attention_dropout=0.5))).encoder.dropout
    assert (distil.embedding, distil.attention, distil.projection, distil.mlp) == (0.25, 0.5, 0.0, 0.25)
    assert specvit.from_hf(_config(_hf("electra", pad_token_id=5))).encoder.input.padding_idx == 5
    config = _config(_hf("bert")) | {"pad_token_id": None}
    assert specvit.from_hf(config).encoder.input.padding_idx is None


def test_older_modernbert_configs_are_read() -> None:
    """A config.json of transformers 4 states the layer pattern and the thetas in fields of their own: they
    build the model transformers 5 builds of them."""
    legacy = dict(global_attn_every_n_layers=2, global_rope_theta=50.0, local_rope_theta=20.0)
    ref = _hf("modernbert", "Model", **legacy)
    config = {k: v for k, v in _config(ref).items() if k not in ("layer_types", "rope_parameters")}
    assert ref.config.layer_types == ["full_attention", "sliding_attention"] * 2
    spec = specvit.from_hf(config | legacy)
    assert spec == specvit.from_hf(_config(ref)) != specvit.from_hf(config)  # the control: the fields count
    model = converted(ref, spec)
    inputs = _inputs(ref)
    keep = inputs["attention_mask"].bool()
    with torch.no_grad():
        ours = model(inputs["input_ids"], key_padding_mask=~keep)
        assert (ours[keep] - ref(**inputs).last_hidden_state[keep]).abs().max().item() <= ATOL


def _refused(family: str, suffix: str, change: dict[str, Any], message: str) -> None:
    check_refused(_config(_hf(family, suffix)), change, message)


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("bert", {"is_decoder": True}, "config.is_decoder: bert config has is_decoder=True: a decoder's causal"),
        ("bert", {"add_cross_attention": True}, "config.add_cross_attention: bert config has add_cross_attention"),
        ("bert", {"position_embedding_type": "relative_key"}, "config.position_embedding_type: bert config has "
         "position_embedding_type='relative_key': relative key/query positions"),
        ("bert", {"hidden_act": "mish"}, "config.hidden_act: bert config has hidden_act='mish': specvit has no "
         "such value"),
        ("roberta", {"pad_token_id": None}, "config.pad_token_id: roberta config has pad_token_id=None: RoBERTa "
         "numbers positions from pad_token_id + 1"),
        ("albert", {"inner_group_num": 2}, "config.inner_group_num: albert config has inner_group_num=2: several "
         "layers within a group"),
        ("albert", {"num_hidden_groups": 3}, "config.num_hidden_groups: albert config has num_hidden_groups=3: "
         "the groups do not divide the 4 layers"),
        ("albert", {"embedding_size": 48}, "config.embedding_size: albert config has embedding_size=48: ALBERT "
         "maps its embeddings to the blocks by a linear layer even at equal widths"),
        ("distilbert", {"sinusoidal_pos_embds": True}, "config.sinusoidal_pos_embds: distilbert config has "
         "sinusoidal_pos_embds=True: a frozen sinusoidal table"),
        ("modernbert", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
         "config.rope_parameters.full_attention.rope_type: modernbert config has "
         "rope_parameters.full_attention.rope_type='linear': specvit's rope here is plain RoPE"),
        ("modernbert", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "config.rope_scaling: modernbert "
         "config has rope_scaling={'factor': 2.0, 'rope_type': 'linear'}: scaled RoPE"),
        ("modernbert", {"layer_types": ["full_attention"] * 3}, "config.layer_types: modernbert config has "
         "layer_types=['full_attention', 'full_attention', 'full_attention']: expected full_attention or "
         "sliding_attention for each of the 4 layers"),
    ],
    ids=["decoder", "cross", "relative", "act", "no_pad", "inner_groups", "groups_not_dividing",
         "albert_equal_widths", "sinusoidal", "scaled_rope", "rope_scaling", "layer_types"],
)  # fmt: skip
def test_values_a_table_cannot_state_are_refused(family: str, change: dict[str, Any], message: str) -> None:
    _refused(family, "Model", change, message)


def test_question_answering_needs_two_labels() -> None:
    message = (
        "config.id2label: bert config has id2label={0: 'L0', 1: 'L1', 2: 'L2'}: the head needs exactly 2"
    )
    _refused("bert", "ForQuestionAnswering", {"id2label": THREE}, message)


@pytest.mark.parametrize(
    ("family", "suffix"),
    [
        ("bert", "ForPreTraining"),  # two heads: the masked LM's and next-sentence prediction's
        ("bert", "ForMultipleChoice"),  # (B, choices, N) ids, one logit per choice
        ("roberta", "ForCausalLM"),  # a decoder
        ("electra", "ForPreTraining"),  # one logit per token, (B, N): the language's last axis stays
        ("modernbert", "ForMultipleChoice"),
    ],
)
def test_classes_whose_head_the_language_lacks_are_refused(family: str, suffix: str) -> None:
    prefix, _, _, classes = CASES[family]
    named = ", ".join(prefix + c for c in classes)
    _refused(family, "Model", {"architectures": [prefix + suffix]},
             f"config.architectures: {family} config has architectures=['{prefix}{suffix}']: specvit reads the "
             f"{prefix} classes {named}")  # fmt: skip


@pytest.mark.parametrize("family", ["bert", "albert", "distilbert"])
def test_a_saved_masked_lm_loads_from_the_parameters_it_keeps(family: str, tmp_path: Path) -> None:
    """transformers writes a tied head's parameters once (BERT's decoder weight and bias are the embedding's
    and ``cls.predictions.bias``, and are left out): from_pretrained builds the model transformers loads."""
    from safetensors import safe_open

    ref = _hf(family, MLM)
    ref.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert not any(k.endswith("decoder.weight") or k.endswith("projector.weight") for k in saved)
    model = specvit.from_pretrained(tmp_path)
    inputs = _inputs(ref)
    keep = inputs["attention_mask"].bool()
    types = {"token_type_ids": inputs["token_type_ids"]} if "token_type_ids" in inputs else {}
    with torch.no_grad():
        ours = model(inputs["input_ids"], key_padding_mask=~keep, **types)
        assert (ours[keep] - ref(**inputs).logits[keep]).abs().max().item() <= ATOL


@pytest.mark.parametrize(("family", "keys"), [("bert", "pooler.dense.weight"), ("albert", "pooler.weight")])
def test_a_base_model_with_its_pooler_is_refused_by_the_converter(family: str, keys: str) -> None:
    """HF's base models hold a pooler (dense and tanh on the first token) unless built without it: the base
    model's head is none (only the sequence classifier reads the pooler), so its weights are named, not
    dropped."""
    import transformers

    prefix, sizes, _, _ = CASES[family]
    ref = getattr(transformers, prefix + "Model")(getattr(transformers, prefix + "Config")(**sizes))
    spec = specvit.from_hf(_config(ref))
    with pytest.raises(ValueError, match=r"unexpected source keys \(2\): .*" + re.escape(keys)):
        convert_state_dict(ref.state_dict(), "hf", spec)


@pytest.mark.parametrize(
    ("name", "config", "params"),
    [
        ("bert_base", "BertConfig", 108_891_648),
        ("albert_base_v2", "AlbertConfig", 11_092_992),
    ],
)
def test_presets_are_their_hf_configs(name: str, config: str, params: int) -> None:
    """The BERT-base and ALBERT-base v2 presets are what from_hf reads from their configs."""
    import transformers

    albert_base_v2 = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072)
    kw = albert_base_v2 if config == "AlbertConfig" else {}
    preset = specvit.load_spec(ROOT / "specs" / f"{name}.yaml")
    imported = specvit.from_hf(getattr(transformers, config)(**kw)).model_dump()
    assert {**imported, "name": preset.name, "description": preset.description} == preset.model_dump()
    assert specvit.build_graph(preset).total_params == params
