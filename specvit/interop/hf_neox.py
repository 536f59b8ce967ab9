"""GPT-NeoX (``GPTNeoX*``, Pythia) and BLOOM (``Bloom*``) as tables: q, k and v fused per head in
``query_key_value`` ([q_h, k_h, v_h] for each head h), ``dense``, ``mlp.dense_h_to_4h`` / ``dense_4h_to_h``,
LayerNorm.

GPT-NeoX: ``gpt_neox.layers.{i}``, a parallel (or sequential) residual with two norms, rotary positions on a
fraction of each head. BLOOM: ``transformer.h.{i}``, ALiBi, a norm after the embedding, an MLP four times the
width. Both read the dropout after each residual branch (``hidden_dropout``) into specvit's projection and MLP
dropouts (the latter also drops after the activation: the same model in eval).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.hf_llama import rope
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.table import (
    BARE,
    SEQUENCE,
    D,
    F,
    Head,
    Only,
    Table,
    count,
    labels,
    lm,
    per_token,
    register,
)
from specvit.interop.variants import per_head_qkv, variant

__all__ = ["BLOOM", "NEOX"]


def _dropouts(field: str, attention: str) -> dict[str, F]:
    """The dropouts after the embedding and after each residual branch (``field``), and on the attention
    weights (``attention``)."""
    return {
        "decoder.dropout.embedding": F(field, 0.0),
        "decoder.dropout.attention": F(attention, 0.0),
        "decoder.dropout.projection": F(field, 0.0),
        "decoder.dropout.mlp": F(field, 0.0),
    }


def _classes(lm_head: Head) -> dict[str, Head]:
    return {
        "Model": BARE,
        "ForCausalLM": lm_head,
        "ForSequenceClassification": SEQUENCE,
        "ForTokenClassification": per_token("classifier"),
        "ForQuestionAnswering": per_token("qa_outputs", labels(2)),
    }


_ROPE = rope(10000.0, fraction=0.25)


def _neox_rope(c: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE from ``rope_parameters``, or from transformers 4's ``rotary_emb_base`` and ``rotary_pct`` where
    they lack theta or the fraction (Pythia's config.json)."""
    position = _ROPE.read(c, spec)
    params = c.sub("rope_parameters").values
    if "rope_theta" not in params and "rotary_emb_base" in c.values:
        position["base"] = c.get("rotary_emb_base", 10000.0)
    if "partial_rotary_factor" not in params and "rotary_pct" in c.values:
        share = c.get("rotary_pct", 0.25)
        position.pop("fraction", None)
        position |= {"fraction": share} if share != 1.0 else {}
    return position


_LAYER = "layers.{i}."

NEOX = register(
    variant(
        Table(
            name="GPTNeoX",
            model_types=("gpt_neox",),
            role="decoder",
            keys=r"(?:gpt_neox\.)?layers\.\d+\.attention\.query_key_value\.",
            spec={
                "decoder.input.kind": "tokens",
                "decoder.input.vocab": F("vocab_size", 50432),
                "decoder.position": D(
                    _neox_rope, (*_ROPE.fields, "rotary_pct", "rotary_emb_base"), _ROPE.inverse
                ),
                "decoder.width": F("hidden_size", 6144),
                "decoder.depth": F("num_hidden_layers", 44),
                "decoder.block.layers": ["masked_self_attention", "mlp"],
                "decoder.block.heads": count("num_attention_heads", 64),
                "decoder.block.norm.eps": F("layer_norm_eps", 1e-5),
                "decoder.block.parallel": F("use_parallel_residual", True),
                "decoder.block.mlp.hidden": F("intermediate_size", 24576),
                "decoder.block.mlp.activation": F("hidden_act", "gelu", map=ACTIVATIONS),
                "decoder.block.qkv_bias": F("attention_bias", True),
                "decoder.block.proj_bias": F("attention_bias", True),
                **_dropouts("hidden_dropout", "attention_dropout"),
            },
            inert=(
                "classifier_dropout",
                "is_decoder",
            ),  # the token classifier's, in training; read by no GPTNeoX class
            names={
                "decoder.tok_embed": "embed_in",
                "decoder.blocks.{i}.norm1": _LAYER + "input_layernorm",
                "decoder.blocks.{i}.attn.proj": _LAYER + "attention.dense",
                "decoder.blocks.{i}.norm2": _LAYER + "post_attention_layernorm",
                "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.dense_h_to_4h",
                "decoder.blocks.{i}.mlp.fc2": _LAYER + "mlp.dense_4h_to_h",
                "decoder.norm": "final_layer_norm",
            },
            classes=_classes(lm()),
            ignore=(
                r"(?:gpt_neox\.)?layers\.\d+\.attention\.(?:bias|masked_bias)",
                r".*rotary_emb\.inv_freq",
            ),
            backbone="gpt_neox.",
        ),
        per_head_qkv(_LAYER + "attention.query_key_value"),
    )
)

register(  # transformers 4 and Hub checkpoints name the LM head embed_out
    NEOX.but(
        "GPTNeoX", (), classes={"ForCausalLM": Head(lm().spec, {"head.fc": "embed_out"})}, keys=r"embed_out\."
    )
)


def _either(names: tuple[str, ...], default: int) -> D:
    """A count a config names by one of several fields (BLOOM's ``n_layer``, ``num_hidden_layers``)."""

    def read(c: Config, spec: Mapping[str, Any]) -> int:
        name = next((n for n in names if c.values.get(n) is not None), names[0])
        return c.size(name, default)

    def write(value: int, get: Callable[[str], Any]) -> dict[str, Any]:
        return {names[0]: value}

    return D(read, names, write)


def _four_times(c: Config, spec: Mapping[str, Any]) -> int:
    return 4 * spec["decoder.width"]


_H = "h.{i}."

BLOOM = register(
    variant(
        Table(
            name="Bloom",
            model_types=("bloom",),
            role="decoder",
            keys=r"(?:transformer\.)?word_embeddings_layernorm\.",
            spec={
                "decoder.input.kind": "tokens",
                "decoder.input.vocab": F("vocab_size", 250880),
                "decoder.position": "alibi",
                "decoder.width": _either(("hidden_size", "n_embed"), 64),
                "decoder.depth": _either(("n_layer", "num_hidden_layers"), 2),
                "decoder.embed_norm": True,
                "decoder.block.layers": ["masked_self_attention", "mlp"],
                "decoder.block.heads": _either(("n_head", "num_attention_heads"), 8),
                "decoder.block.norm.eps": F("layer_norm_epsilon", 1e-5),
                "decoder.block.mlp.hidden": D(_four_times),
                "decoder.block.mlp.activation": "gelu_tanh",
                **_dropouts("hidden_dropout", "attention_dropout"),
                "decoder.dropout.embedding": 0.0,  # BLOOM drops nothing after its embedding
            },
            only=(
                Only(
                    "apply_residual_connection_post_layernorm",
                    False,
                    (False,),
                    "the residual would start after the norm",
                ),
                Only(
                    "slow_but_exact",
                    False,
                    (False,),
                    "it slices the projections into pretraining_tp parts, summed in another order",
                ),
            ),
            inert=("pretraining_tp", "classifier_dropout"),  # read only with slow_but_exact; in training
            names={
                "decoder.tok_embed": "word_embeddings",
                "decoder.embed_norm": "word_embeddings_layernorm",
                "decoder.blocks.{i}.norm1": _H + "input_layernorm",
                "decoder.blocks.{i}.attn.proj": _H + "self_attention.dense",
                "decoder.blocks.{i}.norm2": _H + "post_attention_layernorm",
                "decoder.blocks.{i}.mlp.fc1": _H + "mlp.dense_h_to_4h",
                "decoder.blocks.{i}.mlp.fc2": _H + "mlp.dense_4h_to_h",
                "decoder.norm": "ln_f",
            },
            classes=_classes(lm(tied=True)),
            backbone="transformer.",
        ),
        per_head_qkv(_H + "self_attention.query_key_value"),
    )
)
