"""The GPT-2-like decoder layout: ``transformer.wte``, ``wpe``, ``h.{i}.ln_1``, ``attn.c_attn`` (q, k and v
fused), ``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_f``, learned positions, LayerNorm.
GPT-2 (``Conv1D`` weights, stored (in, out)) is its first table; GPT-BigCode (``nn.Linear``, multi-query)
changes a few entries. GPT-J (``h.{i}.ln_1`` feeding a parallel attention and MLP, rotary) and OPT
(``model.decoder.layers``) share its stack with other names.

The dropout after the MLP (``resid_pdrop``) is read into specvit's ``dropout.mlp``, which also drops after
the activation (as ``specs/gpt2_small.yaml`` states GPT-2): the same model in eval, one dropout more in
training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specvit.interop.layout import batched, conv1d
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.table import BARE, D, F, Only, Renamed, Table, count, lm, register

__all__ = ["GPT2", "HUB"]

HUB = (
    "n_ctx",  # GPT-2's early name of n_positions, read by no transformers class
    "task_specific_params",  # generation settings of pipelines
    "tokenizer_class",
    "gradient_checkpointing",  # a training switch of transformers 4
    "prefix",  # a tokenizer's prefix (OPT's "</s>")
)
"""Fields published config.json files hold that change nothing a forward computes."""

_SUMMARY = (
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "summary_last_dropout",
)
"""The multiple-choice head of ``GPT2DoubleHeadsModel``, a class specvit does not read."""


def _mlp_hidden(c: Config, spec: Mapping[str, Any]) -> int:
    """``n_inner``, or four times the width where a config leaves it out."""
    inner = c.get("n_inner", None, int)
    return inner if inner is not None else 4 * spec["decoder.width"]


def _scale(c: Config, spec: Mapping[str, Any]) -> float | None:
    """q·k unscaled where ``scale_attn_weights`` is false (1, not 1/sqrt(head_dim))."""
    return None if c.get("scale_attn_weights", True) else 1.0


def _inverse_layer(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """``scale_attn_by_inverse_layer_idx``: layer i's scale divided by i + 1, one override per layer."""
    if not c.get("scale_attn_by_inverse_layer_idx", False):
        return None
    head = max(spec["decoder.width"] // spec["decoder.block.heads"], 1)  # a width below 1 is refused later
    base = spec["decoder.block.attention_scale"] or head**-0.5
    return [
        {"layers": [i], "block": {"attention_scale": base / (i + 1)}} for i in range(spec["decoder.depth"])
    ]


def _dropouts(residual: str, embedding: str, attention: str, default: float = 0.1) -> dict[str, F]:
    """The GPT-2 dropouts: after the embeddings, on the attention weights, after each residual branch.

    Args:
        residual: the field of the dropout after the attention's projection and after the MLP.
        embedding: the field of the dropout after the embeddings.
        attention: the field of the dropout on the attention weights.
        default: the class's default of all three.
    """
    return {
        "decoder.dropout.embedding": F(embedding, default),
        "decoder.dropout.attention": F(attention, default),
        "decoder.dropout.projection": F(residual, default),
        "decoder.dropout.mlp": F(residual, default),
    }


_H = "h.{i}."
_CROSS = Only("add_cross_attention", False, (False,), "cross-attention layers in a decoder-only stack")

GPT2 = register(
    Table(
        name="GPT2",
        model_types=("gpt2",),
        role="decoder",
        keys=r"(?:transformer\.)?h\.\d+\.attn\.c_attn\.",
        spec={
            "decoder.input.kind": "tokens",
            "decoder.input.vocab": F("vocab_size", 50257),
            "decoder.position.kind": "learned",
            "decoder.position.max_len": F("n_positions", 1024),
            "decoder.width": F("n_embd", 768),
            "decoder.depth": F("n_layer", 12),
            "decoder.block.layers": ["masked_self_attention", "mlp"],
            "decoder.block.heads": count("n_head", 12),
            "decoder.block.norm.eps": F("layer_norm_epsilon", 1e-5),
            "decoder.block.mlp.hidden": D(_mlp_hidden, ("n_inner",)),
            "decoder.block.mlp.activation": F("activation_function", "gelu_new", map=ACTIVATIONS),
            "decoder.block.attention_scale": D(_scale, ("scale_attn_weights",)),
            "decoder.overrides": D(_inverse_layer, ("scale_attn_by_inverse_layer_idx",)),
            **_dropouts("resid_pdrop", "embd_pdrop", "attn_pdrop"),
        },
        only=(
            Only("reorder_and_upcast_attn", False, (False,), "it changes the attention's arithmetic"),
            _CROSS,
        ),
        inert=(*_SUMMARY, *HUB),
        names={
            "decoder.tok_embed": "wte",
            "decoder.pos_embed.weight": Renamed("wpe.weight", batched),
            "decoder.blocks.{i}.norm1": _H + "ln_1",
            "decoder.blocks.{i}.attn.qkv": Renamed(_H + "attn.c_attn", conv1d),
            "decoder.blocks.{i}.attn.proj": Renamed(_H + "attn.c_proj", conv1d),
            "decoder.blocks.{i}.norm2": _H + "ln_2",
            "decoder.blocks.{i}.mlp.fc1": Renamed(_H + "mlp.c_fc", conv1d),
            "decoder.blocks.{i}.mlp.fc2": Renamed(_H + "mlp.c_proj", conv1d),
            "decoder.norm": "ln_f",
        },
        classes={"Model": BARE, "LMHeadModel": lm(tied=True)},
        default="LMHeadModel",
        ignore=(r"(?:transformer\.)?h\.\d+\.attn\.(?:bias|masked_bias)",),  # causal-mask buffers
        backbone="transformer.",
    )
)
