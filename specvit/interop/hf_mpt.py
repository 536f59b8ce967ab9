"""MPT (``MptForCausalLM``) as a table: ``transformer.wte``, ``blocks.{i}.norm_1``, ``attn.Wqkv`` ([q; k; v]),
``attn.out_proj``, ``norm_2``, ``ffn.up_proj`` / ``down_proj``, ``norm_f``; pre-norm blocks, LayerNorms
without biases, no biases anywhere, ALiBi.

HF's MPT always builds this model: ALiBi with MPT's slopes for 8 as ``alibi_bias_max`` (for any head count
the slopes of BLOOM's ALiBi, specvit's; MPT measures the distance from the last key, a shift of each row
that the softmax cancels), an MLP four times as wide with exact GELU, no biases. The fields of
MosaicML's own code that would change that model (``no_bias: false``, ``expansion_ratio``, ``alibi:
false``, ...) are read by no HF class: a config saying them describes a model HF's MPT does not build, and
is refused rather than built as HF builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specvit.interop.registry import Config
from specvit.interop.table import BARE, COMMON, SEQUENCE, D, F, Only, Table, count, lm, per_token, register

__all__ = ["MPT"]

_ATTN = {
    "clip_qkv": (None, "clipping q, k and v has no spec key"),
    "alibi": (True, "HF's MPT always adds ALiBi"),
    "alibi_bias_max": (8, "HF's MPT always uses the slopes of 8"),
    "attn_type": ("multihead_attention", "HF's MPT always projects every head's keys and values"),
    "qk_ln": (False, "HF's MPT has no QK LayerNorm"),
    "prefix_lm": (False, "HF's MPT attends causally"),
    "attn_uses_sequence_id": (False, "HF's MPT attends across packed sequences"),
}
"""``attn_config`` fields whose other values HF's MPT does not compute: the value it computes, and why."""
_ATTN_READ = ("softmax_scale", "attn_pdrop")
_ATTN_INERT = ("attn_impl",)  # the kernel MosaicML's code ran


def _attention(c: Config) -> Config:
    """``attn_config``, every field of it read, checked or inert."""
    sub = c.sub("attn_config")
    for key in sub.values:
        if key not in {*_ATTN, *_ATTN_READ, *_ATTN_INERT, *COMMON}:
            raise sub.refuse(
                key,
                sub.values[key],
                "specvit's Mpt table does not read this field",
                "leave the field out if it is unset, or ask for the field to be mapped",
            )
    for key, (value, why) in _ATTN.items():
        sub.only(key, value, [value], why)
    return sub


def _scale(c: Config, spec: Mapping[str, Any]) -> float | None:
    """``attn_config.softmax_scale``: the scale of q·k; null = 1/sqrt(head_dim)."""
    return _attention(c).get("softmax_scale", None, float)


def _dropout(c: Config, spec: Mapping[str, Any]) -> float:
    """``attn_config.attn_pdrop``, which HF's MPT applies to the attention weights and after each branch
    (specvit's MLP dropout also drops after the activation: training only)."""
    return _attention(c).get("attn_pdrop", 0.0, float)


MPT = register(
    Table(
        name="Mpt",
        model_types=("mpt",),
        role="decoder",
        keys=r"(?:transformer\.)?blocks\.\d+\.attn\.Wqkv\.",
        spec={
            "decoder.input.kind": "tokens",
            "decoder.input.vocab": F("vocab_size", 50368),
            "decoder.position": "alibi",
            "decoder.width": F("d_model", 2048),
            "decoder.depth": F("n_layers", 24),
            "decoder.block.layers": ["masked_self_attention", "mlp"],
            "decoder.block.heads": count("n_heads", 16),
            "decoder.block.norm.eps": F("layer_norm_epsilon", 1e-5),
            "decoder.block.norm.bias": False,
            "decoder.block.qkv_bias": False,
            "decoder.block.proj_bias": False,
            "decoder.block.mlp.activation": "gelu",
            "decoder.block.mlp.bias": False,
            "decoder.block.attention_scale": D(_scale, ("attn_config",)),
            "decoder.dropout.attention": D(_dropout, ("attn_config",)),
            "decoder.dropout.projection": D(_dropout, ("attn_config",)),
            "decoder.dropout.mlp": D(_dropout, ("attn_config",)),
        },
        only=(
            Only("no_bias", True, (True,), "HF's MPT has no biases"),
            Only("expansion_ratio", 4, (4,), "HF's MPT's MLP is four times as wide"),
            Only("logit_scale", None, (None,), "HF's MPT does not scale its logits"),
            Only(
                "norm_type",
                "low_precision_layernorm",
                ("low_precision_layernorm",),
                "HF's MPT uses LayerNorm",
            ),
            Only("embedding_fraction", 1.0, (1.0,), "scaling the embedding's gradient has no spec key"),
        ),
        # read by no HF MPT module: its ALiBi table's length, a position table it never builds, the device
        # MosaicML initialised on, dropouts HF's MPT does not apply
        inert=("max_seq_len", "learned_pos_emb", "init_device", "emb_pdrop", "resid_pdrop"),
        names={
            "decoder.tok_embed": "wte",
            "decoder.blocks.{i}.norm1": "blocks.{i}.norm_1",
            "decoder.blocks.{i}.attn.qkv": "blocks.{i}.attn.Wqkv",
            "decoder.blocks.{i}.attn.proj": "blocks.{i}.attn.out_proj",
            "decoder.blocks.{i}.norm2": "blocks.{i}.norm_2",
            "decoder.blocks.{i}.mlp.fc1": "blocks.{i}.ffn.up_proj",
            "decoder.blocks.{i}.mlp.fc2": "blocks.{i}.ffn.down_proj",
            "decoder.norm": "norm_f",
        },
        classes={
            "Model": BARE,
            "ForCausalLM": lm(tied=True),
            "ForSequenceClassification": SEQUENCE,
            "ForTokenClassification": per_token("classifier"),
        },
        backbone="transformer.",
    )
)
