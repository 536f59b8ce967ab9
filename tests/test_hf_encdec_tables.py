"""The encoder-decoder families, each a table (specvit/interop/hf_bart.py, hf_bart_families.py, hf_t5.py): from
the config a spec, from the state dict specvit's weights, and the same decoder outputs (fp32, <= 1e-4) on padded
batches and the same greedy tokens as transformers. Every weight and buffer (BART's ``final_logits_bias``
included) is moved off its init by N(0, 0.08) noise; Marian's and Pegasus' frozen sinusoid tables are not
weights, and the converter refuses one unlike the spec's sinusoids.

Each config field a table reads is switched in turn: HF's output moves, and specvit's follows it exactly. Table
defaults are the HF config classes' defaults; an unknown field, and a value or class the spec cannot state, is
refused with the field named.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import check_refused, check_table_defaults, converted, hf_config, hf_model, noised, unswitched
from torch import nn

import specvit
from specvit.convert import convert_state_dict
from specvit.interop.hf import spec_dict
from specvit.interop.table import TABLES, Table
from specvit.spec.loader import parse_spec

VOCAB, S, T, ATOL, NOISE = 97, 13, 9, 1e-4, 0.08
BART_SIZES = dict(
    vocab_size=VOCAB,
    d_model=24,
    encoder_layers=2,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=4,
    encoder_ffn_dim=40,
    decoder_ffn_dim=36,
    max_position_embeddings=32,
)
BART_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
T5_SIZES = dict(
    vocab_size=VOCAB,
    d_model=32,
    d_kv=8,
    num_heads=4,
    d_ff=40,
    num_layers=2,
    num_decoder_layers=2,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=10,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
BART_SWITCHES: list[dict[str, Any]] = [
    {"scale_embedding": True},
    {"activation_function": "relu"},
    {"tie_word_embeddings": False},
]
T5_SWITCHES: list[dict[str, Any]] = [{"layer_norm_epsilon": 0.3}, {"relative_attention_num_buckets": 4},
                                     {"relative_attention_max_distance": 5}, {"d_kv": 12}]  # fmt: skip

# family -> (HF class prefix, the LM class's suffix, config fields, [config fields switched together])
CASES: dict[str, tuple[str, str, dict[str, Any], list[dict[str, Any]]]] = {
    "bart": ("Bart", "ForConditionalGeneration", BART_SIZES | BART_IDS, BART_SWITCHES),
    "mbart": ("MBart", "ForConditionalGeneration", BART_SIZES | BART_IDS, BART_SWITCHES),
    "pegasus": ("Pegasus", "ForConditionalGeneration", BART_SIZES | dict(pad_token_id=0, eos_token_id=1),
                BART_SWITCHES),
    "marian": ("Marian", "MTModel", BART_SIZES | dict(pad_token_id=1, eos_token_id=0, decoder_start_token_id=1),
               [*BART_SWITCHES[:2], {"activation_function": "swish"}, {"tie_word_embeddings": False},
                {"share_encoder_decoder_embeddings": False},
                {"share_encoder_decoder_embeddings": False, "decoder_vocab_size": 50}]),
    "m2m_100": ("M2M100", "ForConditionalGeneration", BART_SIZES | BART_IDS,
                [{"scale_embedding": False}, {"activation_function": "gelu"}, {"tie_word_embeddings": False},
                 {"pad_token_id": 0}]),
    "t5": ("T5", "ForConditionalGeneration", T5_SIZES,
           [{"feed_forward_proj": "gated-gelu"}, {"feed_forward_proj": "gelu"}, {"feed_forward_proj": "gated-silu"},
            {"dense_act_fn": "gelu_new"}, {"is_gated_act": True, "dense_act_fn": "silu"}, *T5_SWITCHES,
            {"tie_word_embeddings": False}]),  # a config.json's dense_act_fn, is_gated_act win
    "mt5": ("MT5", "ForConditionalGeneration", T5_SIZES,
            [{"feed_forward_proj": "relu"}, {"is_gated_act": False}, {"dense_act_fn": "silu"}, *T5_SWITCHES]),
}  # fmt: skip

GREEDY = {family: {"initializer_factor": 0.05} for family in ("t5", "mt5")}
"""T5's init (embeddings of std 1, far larger than every sublayer's output) decodes its input token again and
again; a smaller init leaves the tokens to the noise."""
SHAPES_ONLY = {"vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
               "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings",
               "num_layers", "num_decoder_layers", "num_heads", "d_ff"}  # fmt: skip
"""Read by every table and switched by the sizes of the cases themselves (against the defaults)."""
TRAINING_ONLY = {"dropout", "attention_dropout", "classifier_dropout"}
"""Change nothing in eval; test_training_fields_reach_the_spec (and test_hf_s2s_classifier.py's
test_classifier_dropout_reaches_the_head) check they are read."""
CLASSIFIER = {"decoder_start_token_id"}
"""Read by the sequence classifiers alone, whose fields tests/test_hf_s2s_classifier.py switches."""
TOGETHER = {"scale_decoder_outputs": "tie_word_embeddings"}
"""Fields the config class sets from another (T5's scaling follows tie_word_embeddings)."""


def _table(family: str) -> Table:
    import specvit.interop.hf  # noqa: F401  (registers every family)

    return TABLES[family]


def _hf(family: str, suffix: str | None = None, seed: int = 0, **change: Any) -> nn.Module:
    """HF's ``suffix`` class of the family (by default the LM), its weights and buffers moved, but not its frozen
    sinusoid tables (parameters without gradient: HF computes them, and specvit too)."""
    import transformers

    prefix, lm, sizes, _ = CASES[family]
    config = getattr(transformers, prefix + "Config")(**(sizes | change))
    ref = hf_model(prefix + (suffix or lm), config, seed)
    if hasattr(ref, "lm_head") and (family == "mt5" or change.get("tie_word_embeddings") is False):
        ref.lm_head.weight = nn.Parameter(ref.lm_head.weight.detach().clone())  # T5 classes tie it regardless
    return noised(ref, seed, NOISE, frozen=False)


_config = hf_config


def _inputs() -> dict[str, torch.Tensor]:
    """Ids (none a special id) of two sources and targets (within Marian's smaller decoder vocabulary); the second
    source padded after 7 tokens, the first target after 6 (trailing padding: every query still sees a key)."""
    gen = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, VOCAB, (2, S), generator=gen), torch.randint(3, 50, (2, T), generator=gen)
    src_mask, tgt_mask = torch.ones(2, S, dtype=torch.long), torch.ones(2, T, dtype=torch.long)
    src_mask[1, 7:] = 0
    tgt_mask[0, 6:] = 0
    return dict(
        input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask
    )


def _output(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _outputs(ref: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """specvit's output (through from_hf and the converter) and HF's, on the padded batch."""
    model = converted(ref, specvit.from_hf(_config(ref)))
    x = _inputs()
    with torch.no_grad():
        ours = model(
            x["input_ids"],
            x["decoder_input_ids"],
            src_key_padding_mask=x["attention_mask"] == 0,
            tgt_key_padding_mask=x["decoder_attention_mask"] == 0,
        )
        return ours, _output(ref(**x))


@pytest.mark.parametrize(
    ("family", "suffix"), [(f, s) for f, case in CASES.items() for s in ("Model", case[1])]
)
def test_each_class_is_transformers(family: str, suffix: str) -> None:
    ref = _hf(family, suffix)
    ours, theirs = _outputs(ref)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= ATOL
    x = _inputs()
    with torch.no_grad():  # the control: the source's padding changes what HF computes
        unmasked = _output(ref(**(x | {"attention_mask": torch.ones_like(x["attention_mask"])})))
    assert (unmasked - theirs).abs().max().item() > 10 * ATOL


def _hf_greedy(ref: nn.Module, src: torch.Tensor, mask: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """HF's greedy decoding from ``start``, with none of the logits processors its config may name."""
    return ref.generate(
        input_ids=src,
        attention_mask=mask,
        decoder_start_token_id=start,
        max_new_tokens=n,
        do_sample=False,
        num_beams=1,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
    )


@pytest.mark.parametrize("family", CASES)
def test_greedy_tokens_are_transformers(family: str) -> None:
    """From the decoder's start token, with a KV cache; the head untied (a tied one repeats its input)."""
    ref = _hf(family, seed=2, tie_word_embeddings=False, **GREEDY.get(family, {}))
    model = converted(ref, specvit.from_hf(_config(ref)))
    x = _inputs()
    start, eos, pad = (ref.config.decoder_start_token_id, ref.config.eos_token_id, ref.config.pad_token_id)
    start = pad if start is None else start
    with torch.no_grad():
        want = _hf_greedy(ref, x["input_ids"], x["attention_mask"], start, 8)
        got = model.generate(
            x["input_ids"],
            8,
            bos_id=start,
            eos_id=eos,
            pad_id=pad,
            src_key_padding_mask=x["attention_mask"] == 0,
        )
    assert torch.equal(got, want)
    assert any(len(set(row[1:].tolist())) > 1 for row in got)  # not a degenerate repeat


@pytest.mark.parametrize(("family", "change"), [(f, c) for f, case in CASES.items() for c in case[3]],
                         ids=lambda v: "-".join(f"{k}={w}" for k, w in v.items()) if isinstance(v, dict) else v)  # fmt: skip
def test_each_field_a_table_reads_moves_the_output_as_in_transformers(
    family: str, change: dict[str, Any]
) -> None:
    ref = _hf(family, **change)
    ours, theirs = _outputs(ref)
    assert (ours - theirs).abs().max().item() <= ATOL
    _, before = _outputs(_hf(family))
    if before.shape == theirs.shape:  # the control: the field changes what HF computes
        assert (before - theirs).abs().max().item() > 10 * ATOL


@pytest.mark.parametrize("family", CASES)
def test_every_field_a_table_reads_is_switched_by_a_test(family: str) -> None:
    switched = {k for change in CASES[family][3] for k in change}
    switched |= {k for k, by in TOGETHER.items() if by in switched}
    untested = unswitched(_table(family), switched, SHAPES_ONLY, TRAINING_ONLY, CLASSIFIER)
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
    """Dropout rates change nothing in eval: they are read, not switched above."""
    spec = specvit.from_hf(_config(_hf("bart", dropout=0.25, attention_dropout=0.5)))
    for stack in (spec.encoder, spec.decoder):
        drop = stack.dropout
        assert (drop.embedding, drop.attention, drop.projection, drop.mlp) == (0.25, 0.5, 0.25, 0.25)


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("bart", {"normalize_before": True}, "config.normalize_before: bart config has normalize_before=True: "
         "pre-norm blocks: another value describes another family"),
        ("mbart", {"normalize_before": False}, "config.normalize_before: mbart config has normalize_before=False"),
        ("pegasus", {"static_position_embeddings": False}, "config.static_position_embeddings: pegasus config"),
        ("bart", {"extra_pos_embeddings": 3}, "config.extra_pos_embeddings: bart config has extra_pos_embeddings=3"),
        ("bart", {"is_decoder": True}, "config.is_decoder: bart config has is_decoder=True: a decoder-only model"),
        ("bart", {"activation_function": "mish"}, "config.activation_function: bart config has "
         "activation_function='mish': specvit has no such value here"),
        ("marian", {"decoder_vocab_size": 50}, "config.decoder_vocab_size: marian config has decoder_vocab_size=50: "
         "the stacks share one table of vocab_size 97 rows"),
        ("m2m_100", {"pad_token_id": None}, "config.pad_token_id: m2m_100 config has pad_token_id=None: M2M100 "
         "numbers positions from pad_token_id + 1"),
        ("t5", {"feed_forward_proj": "gated-relu", "is_gated_act": True}, "config.feed_forward_proj: t5 config has "
         "feed_forward_proj='gated-relu'"),
        ("t5", {"dense_act_fn": "mish"}, "config.dense_act_fn: t5 config has dense_act_fn='mish': specvit has no MLP "
         "of activation mish"),
        ("mt5", {"dense_act_fn": "relu"}, "config.dense_act_fn: mt5 config has dense_act_fn='relu': specvit has no "
         "gated MLP (act(wi_0) * wi_1) of activation relu"),
        ("t5", {"architectures": ["T5ForQuestionAnswering"]}, "config.architectures: t5 config has "
         "architectures=['T5ForQuestionAnswering']: specvit reads the T5 classes T5Model, "
         "T5ForConditionalGeneration, T5ForSequenceClassification"),
        ("marian", {"architectures": ["MarianForCausalLM"]}, "specvit reads the Marian classes MarianModel, "
         "MarianMTModel"),
    ],
    ids=["bart_pre_norm", "mbart_post_norm", "pegasus_learned", "rows", "decoder_only", "act", "marian_vocab",
         "m2m_no_pad", "t5_ff", "t5_act", "mt5_gate", "t5_class", "marian_class"],
)  # fmt: skip
def test_values_a_table_cannot_state_are_refused(family: str, change: dict[str, Any], message: str) -> None:
    check_refused(_config(_hf(family)), change, message)


@pytest.mark.parametrize("family", ["marian", "pegasus"])
def test_a_frozen_sinusoid_table_unlike_the_specs_is_refused(family: str) -> None:
    """HF keeps Marian's and Pegasus' sinusoids as frozen parameters: a state dict may leave them out (Marian's
    checkpoints do), and one that holds other values computes something else."""
    ref = _hf(family)
    spec = specvit.from_hf(_config(ref))
    state = dict(ref.state_dict())
    table = "model.encoder.embed_positions.weight"
    convert_state_dict({k: v for k, v in state.items() if "embed_positions" not in k}, "hf", spec)  # left out
    state[table] = state[table] + 0.01
    with pytest.raises(
        ValueError, match=r"frozen tables unlike the ones the spec computes \(1\): " + re.escape(table)
    ):
        convert_state_dict(state, "hf", spec)


def test_final_logits_bias_is_the_heads_bias() -> None:
    """BART's final_logits_bias (noised above, so a test of every class holds it) is the LM head's bias; a spec
    without a head bias (bart_base.yaml's) takes only a bias of zeros."""
    ref = _hf("bart")
    data = spec_dict(_config(ref))
    assert data["head"]["bias"] is True
    data["head"]["bias"] = False
    spec = parse_spec(data, source="bart without a logits bias")
    with pytest.raises(
        ValueError, match=r"nonzero buffers the spec has no place for \(1\): final_logits_bias"
    ):
        convert_state_dict(ref.state_dict(), "hf", spec)
    with torch.no_grad():
        ref.final_logits_bias.zero_()
    converted(ref, spec)  # zeros: the spec without a bias computes the same


def test_t5_scales_a_tied_heads_input_and_mt5_unties_it() -> None:
    t5 = specvit.from_hf(_config(_hf("t5")))
    assert t5.head.tied and t5.head.scale == pytest.approx(32**-0.5)
    untied = specvit.from_hf(_config(_hf("t5", tie_word_embeddings=False)))
    assert not untied.head.tied and untied.head.scale is None
    mt5 = specvit.from_hf(_config(_hf("mt5")))
    assert not mt5.head.tied and mt5.head.scale is None and mt5.encoder.block.mlp.activation == "geglu_tanh"


@pytest.mark.parametrize("family", CASES)
def test_an_imported_model_goes_back_to_transformers(family: str, tmp_path: Path) -> None:
    """HF -> specvit -> HF: transformers loads specvit's directory as the original class, with its outputs; a
    weight changed in specvit comes back changed (the control)."""
    import transformers

    ref = _hf(family)
    ours = converted(ref, specvit.from_hf(_config(ref)))
    x = _inputs()

    def load(directory: Path) -> torch.Tensor:
        back = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
        assert type(back) is type(ref)
        with torch.no_grad():
            return back(**x).logits

    with torch.no_grad():
        want = ref(**x).logits
    assert (load(specvit.to_hf(ours, tmp_path / "back")) - want).abs().max().item() <= 1e-5
    with torch.no_grad():
        ours.decoder.blocks[0].mlp.fc2.weight[0].add_(0.5)  # one channel (a LayerNorm removes a shift of all)
    assert (load(specvit.to_hf(ours, tmp_path / "changed")) - want).abs().max().item() > 10 * ATOL
