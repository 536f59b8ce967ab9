"""ViT and BERT (``ViTModel`` / ``ViTForImageClassification``, ``BertModel``); GPT-2 is a table (``hf_gpt2.py``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import (
    Layout,
    batched,
    cat,
    check_blocks,
    one,
    patches,
    prefix,
    same,
)
from specvit.interop.registry import Config, Family, activation, family
from specvit.spec.schema import ImageInput, Spec

__all__: list[str] = []


def _common(c: Config) -> None:
    c.only(
        "position_embedding_type",
        "absolute",
        ["absolute"],
        "relative key/query positions are not BERT's default",
    )


def _bert(c: Config) -> dict[str, Any]:
    c.only(
        "position_embedding_type",
        "absolute",
        ["absolute"],
        "relative key/query positions are not BERT's default",
    )
    return {
        "specvit": 1,
        "name": "bert_from_hf",
        "description": "BERT (BertModel without pooler; Devlin et al. 2019), imported from its transformers config.",
        "model": "encoder",
        "encoder": {
            "input": {
                "kind": "tokens",
                "vocab": c.get("vocab_size", 30522),
                "type_vocab": c.get("type_vocab_size", 2),
            },
            "position": {"kind": "learned", "max_len": c.get("max_position_embeddings", 512)},
            "width": c.get("hidden_size", 768),
            "depth": c.get("num_hidden_layers", 12),
            "embed_norm": True,
            "final_norm": False,
            "block": {
                "heads": c.get("num_attention_heads", 12),
                "norm": {"placement": "post", "eps": c.get("layer_norm_eps", 1e-12)},
                "mlp": {
                    "hidden": c.get("intermediate_size", 3072),
                    "activation": activation(c, default="gelu"),
                },
            },
        },
        "head": "none",
    }


def _vit(c: Config) -> dict[str, Any]:
    labels = c.get("id2label", kind=dict) or {}
    head: Any = "none"
    if "ViTForImageClassification" in (c.get("architectures", kind=list) or []):
        head = {"kind": "classifier", "classes": len(labels), "pool": "cls"}
    return {
        "specvit": 1,
        "name": "vit_from_hf",
        "description": "ViT (ViTModel; Dosovitskiy et al. 2021), imported from its transformers config.",
        "model": "encoder",
        "encoder": {
            "input": {
                "kind": "image",
                "size": c.get("image_size", 224),
                "patch": c.get("patch_size", 16),
                "channels": c.get("num_channels", 3),
            },
            "prefix": {"cls": True},
            "position": "learned",
            "width": c.get("hidden_size", 768),
            "depth": c.get("num_hidden_layers", 12),
            "block": {
                "heads": c.get("num_attention_heads", 12),
                "norm": {"eps": c.get("layer_norm_eps", 1e-12)},
                "mlp": {
                    "hidden": c.get("intermediate_size", 3072),
                    "activation": activation(c, default="gelu"),
                },
                "qkv_bias": bool(c.get("qkv_bias", True)),
            },
        },
        "head": head,
    }


def _hf_vit(spec: Spec, keys: Sequence[str]) -> Layout:
    name = "HF ViTModel / ViTForImageClassification"
    stack = check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "pre")
    pre = prefix(keys, "vit.")
    legacy = any(k.startswith(pre + "encoder.layer.") for k in keys)  # transformers 4 / Hub checkpoint names
    layer = pre + ("encoder.layer.{i}." if legacy else "layers.{i}.")
    if legacy:
        qkv = tuple(layer + f"attention.attention.{n}" + ".{p}" for n in ("query", "key", "value"))
        proj, fc1, fc2 = "attention.output.dense", "intermediate.dense", "output.dense"
    else:
        qkv = tuple(layer + f"attention.{n}_proj" + ".{p}" for n in "qkv")
        proj, fc1, fc2 = "attention.o_proj", "mlp.fc1", "mlp.fc2"
    assert isinstance(stack.input, ImageInput)
    patch = patches if stack.input.projection == "linear" else same
    block = "encoder.blocks.{i}."
    return Layout(
        name,
        {
            "encoder.patch_embed.proj.{p}": one(pre + "embeddings.patch_embeddings.projection.{p}", patch),
            "encoder.prefix.cls_token": one(pre + "embeddings.cls_token"),
            "encoder.pos_embed.weight": one(pre + "embeddings.position_embeddings"),
            block + "norm1.{p}": one(layer + "layernorm_before.{p}"),
            block + "attn.qkv.{p}": (qkv, cat),
            block + "attn.proj.{p}": one(layer + proj + ".{p}"),
            block + "norm2.{p}": one(layer + "layernorm_after.{p}"),
            block + "mlp.fc1.{p}": one(layer + fc1 + ".{p}"),
            block + "mlp.fc2.{p}": one(layer + fc2 + ".{p}"),
            "encoder.norm.{p}": one(pre + "layernorm.{p}"),
            "head.fc.{p}": one("classifier.{p}"),
        },
    )


def _hf_bert(spec: Spec, keys: Sequence[str]) -> Layout:
    check_blocks(spec, "encoder", "HF BertModel", [("self_attention", "mlp")], "post")
    pre = prefix(keys, "bert.")
    layer, block = pre + "encoder.layer.{i}.", "encoder.blocks.{i}."
    qkv = tuple(layer + f"attention.self.{n}" + ".{p}" for n in ("query", "key", "value"))
    return Layout(
        "HF BertModel",
        {
            "encoder.tok_embed.{p}": one(pre + "embeddings.word_embeddings.{p}"),
            "encoder.type_embed.{p}": one(pre + "embeddings.token_type_embeddings.{p}"),
            "encoder.pos_embed.weight": one(pre + "embeddings.position_embeddings.weight", batched),
            "encoder.embed_norm.{p}": one(pre + "embeddings.LayerNorm.{p}"),
            block + "attn.qkv.{p}": (qkv, cat),
            block + "attn.proj.{p}": one(layer + "attention.output.dense.{p}"),
            block + "norm1.{p}": one(layer + "attention.output.LayerNorm.{p}"),
            block + "mlp.fc1.{p}": one(layer + "intermediate.dense.{p}"),
            block + "mlp.fc2.{p}": one(layer + "output.dense.{p}"),
            block + "norm2.{p}": one(layer + "output.LayerNorm.{p}"),
        },
        ignore=(re.escape(pre) + r"embeddings\.(?:position_ids|token_type_ids)",),
    )


family(
    Family(
        "ViTModel",
        ("vit",),
        r"(?:vit\.)?(?:embeddings\.patch_embeddings|encoder\.layer\.\d+\.layernorm_before|layers\.\d+\.layernorm_before)",
        _vit,
        _hf_vit,
    )
)
family(Family("BertModel", ("bert",), r"(?:bert\.)?embeddings\.token_type_embeddings\.", _bert, _hf_bert))
