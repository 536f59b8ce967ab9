"""T5 (``T5ForConditionalGeneration``; Raffel et al. 2020): RMSNorm, unscaled attention with a bucketed
relative bias shared by the layers of a stack, no biases, a relu or gated-GELU MLP, and the tied head's
input scaled by width**-0.5."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Layout, cat, one
from specvit.interop.registry import Config, Family, family

__all__: list[str] = []

_FF = {"relu": "relu", "gelu": "gelu", "gated-gelu": "geglu_tanh", "gated-silu": "swiglu", "gated-relu": None}


def _spec(c: Config) -> dict[str, Any]:
    proj = c.get("feed_forward_proj", "relu")
    act = _FF.get(proj)
    if act is None:
        raise c.refuse(
            "feed_forward_proj", proj, "specvit has no such MLP", "use relu, gelu, gated-gelu or gated-silu"
        )
    width, eps = c.size("d_model", 512), c.get("layer_norm_epsilon", 1e-6)
    position = {
        "kind": "relative",
        "buckets": c.get("relative_attention_num_buckets", 32),
        "max_distance": c.get("relative_attention_max_distance", 128),
    }

    def stack(depth: int, layers: list[str]) -> dict[str, Any]:
        return {
            "input": {"kind": "tokens", "vocab": c.get("vocab_size", 32128)},
            "position": position,
            "width": width,
            "depth": depth,
            "block": {
                "heads": c.get("num_heads", 8),
                "head_dim": c.get("d_kv", 64),
                "layers": layers,
                "norm": {"kind": "rmsnorm", "eps": eps},
                "mlp": {"hidden": c.get("d_ff", 2048), "activation": act, "bias": False},
                "qkv_bias": False,
                "proj_bias": False,
                "attention_scale": 1.0,
            },
        }

    depth = c.get("num_layers", 6)
    head: dict[str, Any] = {"kind": "lm", "tied": bool(c.get("tie_word_embeddings", True))}
    if c.get("scale_decoder_outputs", head["tied"]):
        head["scale"] = width**-0.5
    return {
        "specvit": 1,
        "name": "t5_from_hf",
        "description": "T5 (T5ForConditionalGeneration; Raffel et al. 2020), imported from its transformers config.",
        "model": "encoder_decoder",
        "encoder": stack(depth, ["self_attention", "mlp"]),
        "decoder": stack(
            c.get("num_decoder_layers", depth), ["masked_self_attention", "cross_attention", "mlp"]
        ),
        "head": head,
        "shared_embeddings": True,
    }


def _layout(spec: Any, keys: Sequence[str]) -> Layout:
    table: dict[str, Any] = {"encoder.tok_embed.weight": one("shared.weight")}
    gated = spec.encoder.block.mlp.activation in ("geglu_tanh", "swiglu")
    for role, ff in (("encoder", 1), ("decoder", 2)):
        layer, block = role + ".block.{i}.layer.", role + ".blocks.{i}."
        attn = tuple(layer + "0.SelfAttention." + n + ".weight" for n in "qkv")
        table |= {
            f"{role}.rel_bias.embedding.weight": one(
                role + ".block.0.layer.0.SelfAttention.relative_attention_bias.weight"
            ),
            block + "norm1.weight": one(layer + "0.layer_norm.weight"),
            block + "attn.qkv.weight": (attn, cat),
            block + "attn.proj.weight": one(layer + "0.SelfAttention.o.weight"),
            block + f"norm{ff + 1}.weight": one(layer + f"{ff}.layer_norm.weight"),
            block + "mlp.fc2.weight": one(layer + f"{ff}.DenseReluDense.wo.weight"),
            f"{role}.norm.weight": one(role + ".final_layer_norm.weight"),
        }
        wi = layer + f"{ff}.DenseReluDense."
        table[block + "mlp.fc1.weight"] = (
            ((wi + "wi_0.weight", wi + "wi_1.weight"), cat) if gated else one(wi + "wi.weight")
        )
    table |= {
        "decoder.blocks.{i}.norm2.weight": one("decoder.block.{i}.layer.1.layer_norm.weight"),
        "decoder.blocks.{i}.cross_attn.q.weight": one("decoder.block.{i}.layer.1.EncDecAttention.q.weight"),
        "decoder.blocks.{i}.cross_attn.kv.weight": (
            tuple("decoder.block.{i}.layer.1.EncDecAttention." + n + ".weight" for n in "kv"),
            cat,
        ),
        "decoder.blocks.{i}.cross_attn.proj.weight": one(
            "decoder.block.{i}.layer.1.EncDecAttention.o.weight"
        ),
    }
    tied = {f"{r}.embed_tokens.weight": "shared.weight" for r in ("encoder", "decoder")}
    if spec.head.tied:
        tied["lm_head.weight"] = "shared.weight"
    else:
        table["head.fc.weight"] = one("lm_head.weight")
    return Layout("HF T5ForConditionalGeneration", table, tied=tied)


family(
    Family(
        "T5ForConditionalGeneration",
        ("t5",),
        r"encoder\.block\.\d+\.layer\.0\.SelfAttention\.",
        _spec,
        _layout,
    )
)
