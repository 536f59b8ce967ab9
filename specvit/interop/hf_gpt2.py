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

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from specvit.interop.layout import batched, conv1d
from specvit.interop.registry import ACTIVATIONS, Config, listable
from specvit.interop.table import BARE, SEQUENCE, D, F, Only, Renamed, Table, count, lm, per_token, register
from specvit.interop.variants import per_head_qkv, variant

__all__ = ["GPT2"]

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
    if not c.get("scale_attn_by_inverse_layer_idx", False) or not listable(spec["decoder.depth"]):
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
            "decoder.block.mlp.hidden": D(_mlp_hidden, ("n_inner",), lambda value, get: {"n_inner": value}),
            "decoder.block.mlp.activation": F("activation_function", "gelu_new", map=ACTIVATIONS),
            "decoder.block.attention_scale": D(_scale, ("scale_attn_weights",)),
            "decoder.overrides": D(_inverse_layer, ("scale_attn_by_inverse_layer_idx",)),
            **_dropouts("resid_pdrop", "embd_pdrop", "attn_pdrop"),
        },
        only=(
            Only("reorder_and_upcast_attn", False, (False,), "it changes the attention's arithmetic"),
            _CROSS,
        ),
        inert=_SUMMARY,
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
        classes={
            "Model": BARE,
            "LMHeadModel": lm(tied=True),
            "ForSequenceClassification": SEQUENCE,
            "ForTokenClassification": per_token("classifier"),
        },
        default="LMHeadModel",
        ignore=(r"(?:transformer\.)?h\.\d+\.attn\.(?:bias|masked_bias)",),  # causal-mask buffers
        backbone="transformer.",
    )
)


def _multi_query(c: Config, spec: Mapping[str, Any]) -> int | None:
    """One key/value head for all query heads where ``multi_query`` is on (SantaCoder, StarCoder)."""
    return 1 if c.get("multi_query", True) else None


_BIGCODE = variant(GPT2, per_head_qkv(_H + "attn.c_attn")).but(
    "GPTBigCode",
    ("gpt_bigcode",),
    {
        "decoder.block.kv_heads": D(_multi_query, ("multi_query",)),
        "decoder.block.mlp.activation": F("activation_function", "gelu_pytorch_tanh", map=ACTIVATIONS),
    },
    drop=("decoder.overrides", "reorder_and_upcast_attn"),
    names={  # nn.Linear, stored (out, in) as specvit's
        "decoder.blocks.{i}.attn.qkv": _H + "attn.c_attn",  # [q; k; v]: width + 2 * kv_heads * head_dim
        "decoder.blocks.{i}.attn.proj": _H + "attn.c_proj",
        "decoder.blocks.{i}.mlp.fc1": _H + "mlp.c_fc",
        "decoder.blocks.{i}.mlp.fc2": _H + "mlp.c_proj",
    },
)
BIGCODE = register(
    replace(
        _BIGCODE,
        classes={
            "Model": BARE,
            "ForCausalLM": lm(tied=True),
            "ForSequenceClassification": SEQUENCE,
            "ForTokenClassification": per_token("classifier"),
        },
        default="ForCausalLM",
        # the softmax's precision in half precision (fp32 computes the same); num_key_value_heads is
        # multi_query's, which HF recomputes from it. No multiple-choice head.
        inert=("attention_softmax_in_fp32", "scale_attention_softmax_in_fp32", "num_key_value_heads"),
    )
)


def _rotary_dims(c: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
    """GPT-J's RoPE: the first ``rotary_dim`` channels of each head in interleaved pairs, theta 10000.

    A ``rotary_dim`` of null (transformers 4 then rotated a table n_embd wide; 5 refuses it) is refused, not
    read as the class's 64."""
    if "rotary_dim" in c.values and c.values["rotary_dim"] is None:
        raise c.refuse(
            "rotary_dim",
            None,
            "transformers 4 then rotates a table n_embd wide, which only a single head's width fits, and "
            "transformers 5 refuses it",
            "give rotary_dim, the channels of each head rotated",
        )
    return {"kind": "rope", "dims": c.get("rotary_dim", 64), "layout": "interleaved"}


def _write_rotary_dims(position: Mapping[str, Any], get: Callable[[str], Any]) -> dict[str, Any]:
    return {"rotary_dim": position["dims"]}


GPTJ = register(
    Table(
        name="GPTJ",
        model_types=("gptj",),
        role="decoder",
        keys=r"(?:transformer\.)?h\.\d+\.attn\.q_proj\.",
        spec={
            "decoder.input.kind": "tokens",
            "decoder.input.vocab": F("vocab_size", 50400),
            "decoder.width": F("n_embd", 4096),
            "decoder.depth": F("n_layer", 28),
            "decoder.block.layers": ["masked_self_attention", "mlp"],
            "decoder.block.heads": count("n_head", 16),
            "decoder.position": D(_rotary_dims, ("rotary_dim",), _write_rotary_dims),
            "decoder.block.parallel": True,
            "decoder.block.norm.eps": F("layer_norm_epsilon", 1e-5),
            "decoder.block.qkv_bias": False,
            "decoder.block.proj_bias": False,
            "decoder.block.mlp.hidden": D(_mlp_hidden, ("n_inner",), lambda value, get: {"n_inner": value}),
            "decoder.block.mlp.activation": F("activation_function", "gelu_new", map=ACTIVATIONS),
            **_dropouts("resid_pdrop", "embd_pdrop", "attn_pdrop", 0.0),
        },
        # GPT-J checkpoints say "rotary": true and scale_attn_weights, both read by no transformers class;
        # n_positions is the length of HF's rotary table (max_position_embeddings of a RoPE model)
        inert=(*_SUMMARY, "rotary", "scale_attn_weights", "n_positions"),
        names={
            "decoder.tok_embed": "wte",
            "decoder.blocks.{i}.norm1": _H + "ln_1",
            "decoder.blocks.{i}.norm2": _H + "ln_1",  # one norm feeds the attention and the MLP
            "decoder.blocks.{i}.attn.qkv": tuple(_H + f"attn.{n}_proj" for n in "qkv"),
            "decoder.blocks.{i}.attn.proj": _H + "attn.out_proj",
            "decoder.blocks.{i}.mlp.fc1": _H + "mlp.fc_in",
            "decoder.blocks.{i}.mlp.fc2": _H + "mlp.fc_out",
            "decoder.norm": "ln_f",
        },
        classes={"Model": BARE, "ForCausalLM": lm(bias=True), "ForSequenceClassification": SEQUENCE},
        ignore=(r"(?:transformer\.)?h\.\d+\.attn\.(?:bias|masked_bias)",),  # transformers 4's mask buffers
        backbone="transformer.",
    )
)

_OPT = "decoder.layers.{i}."


def _opt_placement(c: Config, spec: Mapping[str, Any]) -> str:
    """``do_layer_norm_before``: pre-norm blocks (OPT-125m and most), or post-norm (OPT-350m)."""
    return "pre" if c.get("do_layer_norm_before", True) else "post"


def _opt_final_norm(c: Config, spec: Mapping[str, Any]) -> bool:
    """The final LayerNorm: pre-norm stacks only, unless ``_remove_final_layer_norm`` says otherwise."""
    return c.get("do_layer_norm_before", True) and not c.get("_remove_final_layer_norm", False)


def _write_opt_final_norm(final: bool, get: Callable[[str], Any]) -> dict[str, Any]:
    """A pre-norm stack without its final norm: ``_remove_final_layer_norm``."""
    return (
        {"_remove_final_layer_norm": True}
        if not final and get("decoder.block.norm.placement") == "pre"
        else {}
    )


def _opt_projection(c: Config, spec: Mapping[str, Any]) -> None:
    """OPT-350m's 512-wide embeddings (``project_in`` before the blocks, ``project_out`` after the last,
    positions added at the model's width) have no spec: specvit's embed_width also narrows the positions."""
    width = spec["decoder.width"]
    narrow = c.get("word_embed_proj_dim", None, int)
    if narrow is not None and narrow != width:
        raise c.refuse(
            "word_embed_proj_dim",
            narrow,
            f"token embeddings of another width than hidden_size {width}, projected in and out around "
            "the blocks, have no spec key",
            f"use {width}",
        )


def _pad(c: Config, spec: Mapping[str, Any]) -> int | None:
    """The embedding row of ``pad_token_id``, which gets no gradient (nn.Embedding's padding_idx)."""
    pad = c.get("pad_token_id", None if "pad_token_id" in c.values else 1, int)  # null: no padding row
    return pad if pad is not None and 0 <= pad < spec["decoder.input.vocab"] else None


OPT = register(
    Table(
        name="OPT",
        model_types=("opt",),
        role="decoder",
        keys=r"(?:model\.)?decoder\.layers\.\d+\.self_attn\.q_proj\.",  # a LayerNorm may have no weights
        spec={
            "decoder.input.kind": "tokens",
            "decoder.input.vocab": F("vocab_size", 50272),
            "decoder.input.padding_idx": D(
                _pad, ("pad_token_id",), lambda value, get: {"pad_token_id": value}
            ),
            "decoder.position.kind": "learned",
            "decoder.position.max_len": F("max_position_embeddings", 2048),
            "decoder.position.offset": 2,  # OPTLearnedPositionalEmbedding starts two rows in
            "decoder.width": F("hidden_size", 768),
            "decoder.embed_width": D(_opt_projection, ("word_embed_proj_dim",)),
            "decoder.depth": F("num_hidden_layers", 12),
            "decoder.final_norm": D(
                _opt_final_norm, ("do_layer_norm_before", "_remove_final_layer_norm"), _write_opt_final_norm
            ),
            "decoder.block.layers": ["masked_self_attention", "mlp"],
            "decoder.block.heads": count("num_attention_heads", 12),
            "decoder.block.norm.placement": D(
                _opt_placement,
                ("do_layer_norm_before",),
                lambda value, get: {"do_layer_norm_before": value == "pre"},
            ),
            "decoder.block.norm.eps": 1e-5,  # nn.LayerNorm's default
            "decoder.block.norm.affine": F("layer_norm_elementwise_affine", True),
            "decoder.block.qkv_bias": F("enable_bias", True),
            "decoder.block.proj_bias": F("enable_bias", True),
            "decoder.block.mlp.hidden": F("ffn_dim", 3072),
            "decoder.block.mlp.activation": F("activation_function", "relu", map=ACTIVATIONS),
            "decoder.block.mlp.bias": F("enable_bias", True),
            "decoder.dropout.attention": F("attention_dropout", 0.0),
            "decoder.dropout.projection": F("dropout", 0.1),
            "decoder.dropout.mlp": F("dropout", 0.1),
        },
        only=(Only("layerdrop", 0.0, (0.0,), "dropping whole layers in training has no spec key"),),
        # activation_dropout: in configs of transformers 4, read by no class since
        inert=("init_std", "activation_dropout"),
        names={
            "decoder.tok_embed": "decoder.embed_tokens",
            "decoder.pos_embed.weight": Renamed("decoder.embed_positions.weight", batched),
            "decoder.blocks.{i}.norm1": _OPT + "self_attn_layer_norm",
            "decoder.blocks.{i}.attn.qkv": tuple(_OPT + f"self_attn.{n}_proj" for n in "qkv"),
            "decoder.blocks.{i}.attn.proj": _OPT + "self_attn.out_proj",
            "decoder.blocks.{i}.norm2": _OPT + "final_layer_norm",
            "decoder.blocks.{i}.mlp.fc1": _OPT + "fc1",
            "decoder.blocks.{i}.mlp.fc2": _OPT + "fc2",
            "decoder.norm": "decoder.final_layer_norm",
        },
        classes={"Model": BARE, "ForCausalLM": lm(tied=True), "ForSequenceClassification": SEQUENCE},
    )
)
