"""Whisper (Radford et al. 2022) as a table over the BART-like encoder-decoder layout (:data:`~specvit.interop.
hf_bart.BART`): the same block names (``layers.{i}.self_attn.{q,k,v,out}_proj``, ``self_attn_layer_norm``, the
decoder's ``encoder_attn``, ``fc1``, ``fc2``, ``final_layer_norm``, each stack's ``layer_norm``), pre-norm blocks
and a norm after each stack, no biases on the key projections (``qkv_bias: [true, false, true]``).

What Whisper changes, each a setting of the language: the encoder reads a (B, num_mel_bins, 2 *
max_source_positions) log-mel ``signal`` through a stem of generic map ops (``conv1``: a Conv1d of kernel 3 to
d_model, GELU, ``conv2``: the same of stride 2, GELU), then adds its own sinusoids (``sincos``, sines then cosines,
``tensor2tensor`` frequencies 10000^(-i/(d/2 - 1)), from position 0), which HF keeps as a frozen
``encoder.embed_positions`` table the converter checks; the decoder reads tokens with a learned table from
position 0 (``max_target_positions`` rows); the LM head (``proj_out``) has no bias and is tied to the decoder's
token table. The stacks share no token table.

Read and changing nothing a forward computes: ``scale_embedding`` (HF's Whisper computes ``embed_scale`` and never
multiplies by it), the generation settings, and the training-only LayerDrop and SpecAugment (``apply_spec_augment``,
``mask_*``: HF masks the input features in training only; specvit trains without it, as without LayerDrop).
``use_weighted_layer_sum`` and ``classifier_proj_size`` configure ``WhisperForAudioClassification``, a class this
table does not read (its ``architectures`` are refused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from specvit.interop.hf_bart import BART, padding
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.seq2seq import both
from specvit.interop.table import BARE, D, F, Only, count, lm, register

__all__ = ["WHISPER"]

_ENC, _DEC = "encoder.layers.{i}.", "decoder.layers.{i}."


def _stem(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``conv1`` and ``conv2`` with the GELU after each (fixed in HF's encoder, whatever activation_function says):
    the frames halved into the tokens."""
    width = spec["encoder.width"]
    conv = {"kind": "conv", "channels": width, "kernel": 3, "padding": 1}
    gelu = {"kind": "act", "fn": "gelu"}
    return [conv, gelu, conv | {"stride": 2}, gelu]


def _frames(c: Config, spec: Mapping[str, Any]) -> int:
    """The signal's frames: HF takes exactly ``2 * max_source_positions`` (``conv2`` halves them into the table's
    rows, all of which it adds)."""
    return 2 * c.size("max_source_positions", 1500)


def _write_frames(value: int, get: Callable[[str], Any]) -> dict[str, Any]:
    return {"max_source_positions": value // 2}


def _encoder_layers(c: Config, spec: Mapping[str, Any]) -> int:
    """``encoder_layers``; older config.json files repeat it as ``num_hidden_layers`` (the config class's alias of
    it), which must then agree."""
    depth = c.size("encoder_layers", 4)
    alias = c.get("num_hidden_layers", None, int)
    if alias is not None and alias != depth:
        raise c.refuse(
            "num_hidden_layers",
            alias,
            f"Whisper's config reads it as encoder_layers, which is {depth}",
            f"use {depth}, or leave num_hidden_layers out",
        )
    return depth


def _write_layers(value: int, get: Callable[[str], Any]) -> dict[str, Any]:
    return {"encoder_layers": value}


_ATTENTION = {  # the q and v biases beside the packed weight (the key projection has none)
    "encoder.blocks.{i}.attn.q_bias": _ENC + "self_attn.q_proj.bias",
    "encoder.blocks.{i}.attn.v_bias": _ENC + "self_attn.v_proj.bias",
    "decoder.blocks.{i}.attn.q_bias": _DEC + "self_attn.q_proj.bias",
    "decoder.blocks.{i}.attn.v_bias": _DEC + "self_attn.v_proj.bias",
    "decoder.blocks.{i}.cross_attn.v_bias": _DEC + "encoder_attn.v_proj.bias",
}

WHISPER = register(
    BART.but(
        "Whisper",
        ("whisper",),
        {
            **both(
                {
                    "width": F("d_model", 384),
                    "position.offset": 0,
                    "embed_norm": False,
                    "final_norm": True,
                    "block.norm.placement": "pre",
                    "block.qkv_bias": [True, False, True],
                    "block.mlp.activation": F("activation_function", "gelu", map=ACTIVATIONS),
                    "dropout.embedding": F("dropout", 0.0),
                    "dropout.projection": F("dropout", 0.0),
                    "dropout.mlp": F("dropout", 0.0),
                }
            ),
            "encoder.input.kind": "signal",
            "encoder.input.channels": F("num_mel_bins", 80),
            "encoder.input.length": D(_frames, ("max_source_positions",), _write_frames),
            "encoder.input.stem": D(_stem, ("d_model",)),
            "encoder.position.kind": "sincos",
            "encoder.position.layout": "concat",
            "encoder.position.frequencies": "tensor2tensor",
            "encoder.depth": D(_encoder_layers, ("encoder_layers", "num_hidden_layers"), _write_layers),
            "encoder.block.heads": count("encoder_attention_heads", 6),
            "encoder.block.mlp.hidden": F("encoder_ffn_dim", 1536),
            "decoder.input.vocab": F("vocab_size", 51865),
            "decoder.input.padding_idx": padding(50256),
            "decoder.position.max_len": F("max_target_positions", 448),
            "decoder.depth": F("decoder_layers", 4),
            "decoder.block.heads": count("decoder_attention_heads", 6),
            "decoder.block.mlp.hidden": F("decoder_ffn_dim", 1536),
            "shared_embeddings": False,  # the encoder reads no tokens
        },
        drop=(
            *(f"encoder.input.{key}" for key in ("vocab", "padding_idx", "scale")),
            "decoder.input.scale",  # scale_embedding: see the module's docstring
            "encoder.position.max_len",
            *(o.name for o in BART.only if o.name != "is_decoder"),  # BART's older configs' fields
            "ForSequenceClassification",  # BART's class, which Whisper has not
        ),
        only=(
            Only("is_decoder", False, (False,), "a decoder alone (WhisperForCausalLM) is not this table's"),
        ),
        inert=(
            "scale_embedding",
            "suppress_tokens",  # generation settings
            "begin_suppress_tokens",
            "forced_decoder_ids",
            "max_length",
            "median_filter_width",  # token timestamps from the cross-attention weights, in generate
            "apply_spec_augment",  # training only, as LayerDrop
            *(
                f"mask_{axis}_{what}"
                for axis in ("time", "feature")
                for what in ("prob", "length", "min_masks")
            ),
            "use_weighted_layer_sum",  # WhisperForAudioClassification's
            "classifier_proj_size",
        ),
        names=_ATTENTION | {"encoder.stem.0": "encoder.conv1", "encoder.stem.2": "encoder.conv2"},
        classes={
            "Model": BARE,
            "ForConditionalGeneration": replace(lm(tied=True), names={"head.fc": "proj_out"}),
        },
        keys=r"(?:model\.)?encoder\.conv1\.weight",
    )
)
"""``WhisperModel`` and ``WhisperForConditionalGeneration``."""
