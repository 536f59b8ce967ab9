"""Whisper as a table over the BART-like encoder-decoder layout (specvit/interop/hf_whisper.py): from the config a
spec (a Conv1d stem over a log-mel signal, Whisper's sinusoids in the encoder, a learned table in the decoder,
pre-norm blocks, a tied LM head), from the state dict specvit's weights, and the same outputs as transformers
(fp32, <= 1e-4, N(0, 0.08) on every weight and buffer but the frozen sinusoid table, which the converter checks);
the same greedy tokens as WhisperForConditionalGeneration.generate; each field the table reads switched, HF's
output moving and specvit's following; from_pretrained of a save_pretrained directory and to_hf back.
"""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import check_refused, check_table_defaults, converted, hf_config, hf_noised, unswitched
from safetensors.torch import load_file, save_file
from torch import nn

import specvit
from specvit.convert import convert_state_dict
from specvit.interop.hf_whisper import WHISPER
from specvit.spec.loader import parse_spec

MELS, SOURCE, VOCAB, T, ATOL = 12, 16, 97, 7, 1e-4
SIZES = dict(vocab_size=VOCAB, num_mel_bins=MELS, d_model=24, encoder_layers=2, decoder_layers=1,
             encoder_attention_heads=2, decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=36,
             max_source_positions=SOURCE, max_target_positions=20, pad_token_id=1, bos_token_id=0, eos_token_id=2,
             decoder_start_token_id=3, begin_suppress_tokens=None)  # fmt: skip
CLASSES = ("WhisperModel", "WhisperForConditionalGeneration")
SWITCHES: list[dict[str, Any]] = [
    {"activation_function": "relu"},  # the MLPs' only: the stem's GELU stays
    {"activation_function": "silu"},
    {"encoder_attention_heads": 4},
    {"decoder_attention_heads": 2},
    {"tie_word_embeddings": False},
]
SHAPES = {"vocab_size", "num_mel_bins", "d_model", "encoder_layers", "decoder_layers", "encoder_ffn_dim",
          "decoder_ffn_dim", "max_source_positions", "max_target_positions"}  # fmt: skip
"""Set by the case itself against the class's defaults (and max_source_positions by the inputs' length)."""
IN_TRAINING = {"dropout", "attention_dropout", "pad_token_id", "num_hidden_layers"}
"""Read but changing nothing in eval (the padding row takes no gradient), or an alias: tested below."""


def _hf(cls: str = CLASSES[1], seed: int = 0, **change: Any) -> nn.Module:
    import transformers

    return hf_noised(cls, transformers.WhisperConfig(**(SIZES | change)), seed)


def _inputs(frames: int = 2 * SOURCE) -> dict[str, torch.Tensor]:
    """Two log-mel signals and two decoder inputs, the first padded after 5 tokens."""
    gen = torch.Generator().manual_seed(1)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, 5:] = 0
    return dict(
        input_features=torch.randn(2, MELS, frames, generator=gen),
        decoder_input_ids=torch.randint(3, VOCAB, (2, T), generator=gen),
        decoder_attention_mask=mask,
    )


def _output(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _run(model: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(
            x["input_features"], x["decoder_input_ids"], tgt_key_padding_mask=x["decoder_attention_mask"] == 0
        )


def _outputs(ref: nn.Module, spec: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """specvit's output (through from_hf and the converter, or ``spec``) and HF's."""
    x = _inputs()
    ours = _run(converted(ref, spec or specvit.from_hf(hf_config(ref))), x)
    with torch.no_grad():
        return ours, _output(ref(**x))


@pytest.mark.parametrize("cls", CLASSES)
def test_each_class_is_transformers(cls: str) -> None:
    ref = _hf(cls)
    ours, theirs = _outputs(ref)
    assert ours.shape == theirs.shape == (2, T, 24 if cls == "WhisperModel" else VOCAB)
    assert (ours - theirs).abs().max().item() <= ATOL
    # the control: the same weights, the sinusoids interleaved
    data = specvit.interop.hf.spec_dict(hf_config(ref))
    data["encoder"]["position"]["layout"] = "interleaved"
    wrong = specvit.build_model(parse_spec(data, source="whisper, interleaved sinusoids")).eval()
    wrong.load_state_dict(converted(ref, specvit.from_hf(hf_config(ref))).state_dict())
    assert (_run(wrong, _inputs()) - theirs).abs().max().item() > 10 * ATOL


def test_the_spec_states_whispers_layers() -> None:
    spec = specvit.from_hf(hf_config(_hf()))
    encoder, decoder = spec.encoder, spec.decoder
    assert [(op.kind, getattr(op, "stride", None)) for op in encoder.input.stem] == [
        ("conv", 1), ("act", None), ("conv", 2), ("act", None)]  # fmt: skip
    assert (encoder.input.channels, encoder.input.length) == (MELS, 2 * SOURCE)
    position = encoder.positions[0]
    assert (position.kind, position.layout, position.frequencies, position.offset) == (
        "sincos", "concat", "tensor2tensor", 0)  # fmt: skip
    assert (decoder.positions[0].kind, decoder.positions[0].max_len, decoder.positions[0].offset) == (
        "learned",
        20,
        0,
    )
    assert list(encoder.block.qkv_bias) == list(decoder.block.qkv_bias) == [True, False, True]
    assert spec.head.tied and not spec.head.bias and not spec.shared_embeddings


def _hf_greedy(ref: nn.Module, features: torch.Tensor, n: int) -> torch.Tensor:
    """WhisperForConditionalGeneration.generate, greedy, with none of the token suppression its config may name."""
    return ref.generate(input_features=features, max_new_tokens=n, do_sample=False, num_beams=1,
                        suppress_tokens=None, begin_suppress_tokens=None)  # fmt: skip


def test_greedy_tokens_are_transformers() -> None:
    """From the decoder start token, with a KV cache; HF's generate leaves the start token out."""
    ref = _hf(seed=2, tie_word_embeddings=False)
    model = converted(ref, specvit.from_hf(ref))
    features = _inputs()["input_features"]
    with torch.no_grad():
        want = _hf_greedy(ref, features, 8)
        got = model.generate(features, 8, bos_id=3, eos_id=2, pad_id=1)
    assert torch.equal(got[:, 1:], want) and (got[:, 0] == 3).all()
    assert any(len(set(row.tolist())) > 2 for row in want)  # not a degenerate repeat


@functools.cache
def _reference() -> torch.Tensor:
    return _outputs(_hf())[1]


@pytest.mark.parametrize("change", SWITCHES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_each_field_the_table_reads_moves_the_output_as_in_transformers(change: dict[str, Any]) -> None:
    ours, theirs = _outputs(_hf(**change))
    assert (ours - theirs).abs().max().item() <= ATOL
    assert (_reference() - theirs).abs().max().item() > 10 * ATOL  # the control: HF's output moved


def test_every_field_the_table_reads_is_switched_by_a_test() -> None:
    assert not unswitched(WHISPER, {k for change in SWITCHES for k in change}, SHAPES, IN_TRAINING)


def test_fields_that_act_in_training_only_reach_the_spec() -> None:
    spec = specvit.from_hf(hf_config(_hf(dropout=0.25, attention_dropout=0.5, pad_token_id=5)))
    for stack in (spec.encoder, spec.decoder):
        drop = stack.dropout
        assert (drop.embedding, drop.attention, drop.projection, drop.mlp) == (0.25, 0.5, 0.25, 0.25)
    assert spec.decoder.input.padding_idx == 5
    assert specvit.from_hf(hf_config(_hf()) | {"pad_token_id": None}).decoder.input.padding_idx is None
    assert specvit.from_hf(hf_config(_hf()) | {"num_hidden_layers": 2}).encoder.depth == 2  # an older alias


@pytest.mark.parametrize(
    "change", [{"scale_embedding": True}, {"apply_spec_augment": True, "mask_time_prob": 0.5}],
    ids=["scale_embedding", "spec_augment"],
)  # fmt: skip
def test_inert_fields_change_nothing_in_transformers(change: dict[str, Any]) -> None:
    """HF's Whisper computes embed_scale and never multiplies by it; SpecAugment masks features in training only."""
    assert torch.equal(_outputs(_hf(**change))[1], _reference())
    assert specvit.from_hf(hf_config(_hf(**change))) == specvit.from_hf(hf_config(_hf()))


def test_table_defaults_are_the_config_class_defaults() -> None:
    check_table_defaults(WHISPER, "WhisperConfig", "whisper")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"clip_logits": 4.0}, "config.clip_logits: whisper config has clip_logits=4.0: specvit's Whisper table"),
        ({"architectures": ["WhisperForAudioClassification"]}, "config.architectures: whisper config has "
         "architectures=['WhisperForAudioClassification']: specvit reads the Whisper classes WhisperModel, "
         "WhisperForConditionalGeneration"),
        ({"is_decoder": True}, "config.is_decoder: whisper config has is_decoder=True: a decoder alone"),
        ({"activation_function": "mish"}, "config.activation_function: whisper config has "
         "activation_function='mish': specvit has no such value here"),
        ({"num_hidden_layers": 3}, "config.num_hidden_layers: whisper config has num_hidden_layers=3: Whisper's "
         "config reads it as encoder_layers, which is 2"),
        ({"max_source_positions": 0}, "config.max_source_positions: whisper config has max_source_positions=0"),
    ],
    ids=["unknown", "audio_classification", "decoder_only", "act", "alias", "frames"],
)  # fmt: skip
def test_values_the_table_cannot_state_are_refused(change: dict[str, Any], message: str) -> None:
    check_refused(hf_config(_hf()), change, message)


def test_a_sinusoid_table_unlike_whispers_is_refused() -> None:
    """The encoder's frozen table is checked against the spec's sinusoids: left out, it loads; half precision
    (as checkpoints are published), it loads; moved, it is refused by name."""
    ref = _hf()
    spec = specvit.from_hf(hf_config(ref))
    state, table = dict(ref.state_dict()), "model.encoder.embed_positions.weight"
    convert_state_dict({k: v for k, v in state.items() if k != table}, "hf", spec)
    convert_state_dict(state | {table: state[table].half()}, "hf", spec)
    convert_state_dict(state | {table: state[table].bfloat16()}, "hf", spec)
    with pytest.raises(
        ValueError, match=r"frozen tables unlike the ones the spec computes \(1\): " + re.escape(table)
    ):
        convert_state_dict(state | {table: state[table] + 0.01}, "hf", spec)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_saved_directory_loads_and_goes_back(cls: str, tmp_path: Path) -> None:
    """save_pretrained -> specvit.from_pretrained -> specvit.to_hf -> transformers: the outputs of
    transformers' own model of the directory all along; a moved tensor moves them (the control)."""
    import transformers

    _hf(cls).save_pretrained(tmp_path / "hf")
    ref = getattr(transformers, cls).from_pretrained(tmp_path / "hf").eval()
    x = _inputs()
    with torch.no_grad():
        want = _output(ref(**x))
    ours = specvit.from_pretrained(tmp_path / "hf")
    assert (_run(ours, x) - want).abs().max().item() <= ATOL
    back = transformers.AutoModel if cls == "WhisperModel" else transformers.AutoModelForSpeechSeq2Seq
    again = back.from_pretrained(specvit.to_hf(ours, tmp_path / "back")).eval()
    assert type(again) is type(ref)
    with torch.no_grad():
        assert (_output(again(**x)) - want).abs().max().item() <= 1e-5
    shutil.copytree(tmp_path / "hf", tmp_path / "moved")
    weights = load_file(tmp_path / "moved" / "model.safetensors")
    key = next(k for k in weights if k.endswith("decoder.layers.0.fc2.weight"))
    weights[key][0] += 0.5  # one channel (a LayerNorm removes a shift of all)
    save_file(weights, tmp_path / "moved" / "model.safetensors", metadata={"format": "pt"})
    assert (_run(specvit.from_pretrained(tmp_path / "moved"), x) - want).abs().max().item() > 10 * ATOL


def test_a_signal_for_generate_is_checked_in_words() -> None:
    model = specvit.build_model(specvit.from_hf(hf_config(_hf())))
    with pytest.raises(ValueError, match=r"the spec's signals have 32 frames, not 30 \(input.length\)"):
        model.generate(torch.randn(1, MELS, 30), 2, bos_id=3)
