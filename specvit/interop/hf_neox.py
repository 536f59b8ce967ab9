"""GPT-NeoX (``GPTNeoXForCausalLM``, Pythia) and BLOOM (``BloomForCausalLM``): fused per-head qkv, LayerNorm.

GPT-NeoX: parallel attention + MLP residual and partial rotary. BLOOM: ALiBi and a norm after the
embedding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Layout, heads_interleaved, one
from specvit.interop.registry import Config, Family, activation, family

__all__: list[str] = []


def _neox(c: Config) -> dict[str, Any]:
    width, heads = c.get("hidden_size", 6144), c.get("num_attention_heads", 64)
    rope = c.sub("rope_parameters")
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise c.refuse(
            "rope_parameters",
            rope.values,
            f"{kind} RoPE scaling has no specvit position kind",
            "use plain RoPE",
        )
    position: dict[str, Any] = {
        "kind": "rope",
        "base": rope.get("rope_theta", c.get("rotary_emb_base", 10000.0)),
    }
    fraction = rope.get("partial_rotary_factor", c.get("rotary_pct", 0.25))
    if fraction != 1.0:
        position["fraction"] = fraction
    bias = bool(c.get("attention_bias", True))
    return {
        "specvit": 1,
        "name": "gpt_neox_from_hf",
        "description": "GPT-NeoX (GPTNeoXForCausalLM; Black et al. 2022), imported from its transformers config.",
        "model": "decoder",
        "decoder": {
            "input": {"kind": "tokens", "vocab": c.get("vocab_size", 50432)},
            "position": position,
            "width": width,
            "depth": c.get("num_hidden_layers", 44),
            "block": {
                "heads": heads,
                "layers": ["masked_self_attention", "mlp"],
                "norm": {"eps": c.get("layer_norm_eps", 1e-5)},
                "parallel": bool(c.get("use_parallel_residual", True)),
                "mlp": {
                    "hidden": c.get("intermediate_size", 24576),
                    "activation": activation(c, default="gelu"),
                },
                "qkv_bias": bias,
                "proj_bias": bias,
            },
        },
        "head": {"kind": "lm", "tied": bool(c.get("tie_word_embeddings", False))},
    }


def _neox_layout(spec: Any, keys: Sequence[str]) -> Layout:
    layer, block = "gpt_neox.layers.{i}.", "decoder.blocks.{i}."
    table = {
        "decoder.tok_embed.weight": one("gpt_neox.embed_in.weight"),
        block + "norm1.{p}": one(layer + "input_layernorm.{p}"),
        block + "attn.qkv.{p}": one(
            layer + "attention.query_key_value.{p}", heads_interleaved(spec.decoder.heads)
        ),
        block + "attn.proj.{p}": one(layer + "attention.dense.{p}"),
        block + "norm2.{p}": one(layer + "post_attention_layernorm.{p}"),
        block + "mlp.fc1.{p}": one(layer + "mlp.dense_h_to_4h.{p}"),
        block + "mlp.fc2.{p}": one(layer + "mlp.dense_4h_to_h.{p}"),
        "decoder.norm.{p}": one("gpt_neox.final_layer_norm.{p}"),
    }
    tied = {"embed_out.weight": "gpt_neox.embed_in.weight", "lm_head.weight": "gpt_neox.embed_in.weight"}
    if not spec.head.tied:
        head = "embed_out.weight" if "embed_out.weight" in keys else "lm_head.weight"
        table["head.fc.weight"] = one(head)
        tied = {}
    buffers = (
        r"gpt_neox\.layers\.\d+\.attention\.(?:bias|masked_bias|rotary_emb\.inv_freq)",
        r".*rotary_emb\.inv_freq",
    )
    return Layout("HF GPTNeoXForCausalLM", table, ignore=buffers, tied=tied)


def _bloom(c: Config) -> dict[str, Any]:
    c.only(
        "apply_residual_connection_post_layernorm", False, [False], "the residual would start after the norm"
    )
    if c.get("slow_but_exact", False):
        c.only("pretraining_tp", 1, [1], "slow_but_exact slices the projections into tensor-parallel parts")
    width = c.get("hidden_size", c.get("n_embed", 64))
    return {
        "specvit": 1,
        "name": "bloom_from_hf",
        "description": "BLOOM (BloomForCausalLM; BigScience 2022), imported from its transformers config.",
        "model": "decoder",
        "decoder": {
            "input": {"kind": "tokens", "vocab": c.get("vocab_size", 250880)},
            "position": "alibi",
            "width": width,
            "depth": c.get("n_layer", c.get("num_hidden_layers", 2)),
            "embed_norm": True,
            "block": {
                "heads": c.get("n_head", c.get("num_attention_heads", 8)),
                "layers": ["masked_self_attention", "mlp"],
                "norm": {"eps": c.get("layer_norm_epsilon", 1e-5)},
                "mlp": {"hidden": 4 * width, "activation": "gelu_tanh"},
            },
        },
        "head": {"kind": "lm", "tied": bool(c.get("tie_word_embeddings", True))},
    }


def _bloom_layout(spec: Any, keys: Sequence[str]) -> Layout:
    pre = "transformer." if any(k.startswith("transformer.") for k in keys) else ""
    layer, block = pre + "h.{i}.", "decoder.blocks.{i}."
    table = {
        "decoder.tok_embed.weight": one(pre + "word_embeddings.weight"),
        "decoder.embed_norm.{p}": one(pre + "word_embeddings_layernorm.{p}"),
        block + "norm1.{p}": one(layer + "input_layernorm.{p}"),
        block + "attn.qkv.{p}": one(
            layer + "self_attention.query_key_value.{p}", heads_interleaved(spec.decoder.heads)
        ),
        block + "attn.proj.{p}": one(layer + "self_attention.dense.{p}"),
        block + "norm2.{p}": one(layer + "post_attention_layernorm.{p}"),
        block + "mlp.fc1.{p}": one(layer + "mlp.dense_h_to_4h.{p}"),
        block + "mlp.fc2.{p}": one(layer + "mlp.dense_4h_to_h.{p}"),
        "decoder.norm.{p}": one(pre + "ln_f.{p}"),
    }
    tied = {"lm_head.weight": pre + "word_embeddings.weight"}
    if not spec.head.tied:
        table["head.fc.weight"] = one("lm_head.weight")
        tied = {}
    return Layout("HF BloomForCausalLM", table, tied=tied)


family(Family("GPTNeoXForCausalLM", ("gpt_neox",), r"gpt_neox\.", _neox, _neox_layout))
family(
    Family(
        "BloomForCausalLM",
        ("bloom",),
        r"(?:transformer\.)?word_embeddings_layernorm\.",
        _bloom,
        _bloom_layout,
    )
)
