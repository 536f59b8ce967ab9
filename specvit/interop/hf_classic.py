"""ViT and GPT-2 (``ViTModel`` / ``ViTForImageClassification``, ``GPT2LMHeadModel``); BERT is a table
(``hf_bert.py``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import (
    Layout,
    batched,
    cat,
    check_blocks,
    conv1d,
    one,
    patches,
    prefix,
    same,
)
from specvit.interop.registry import Config, Family, activation, family
from specvit.spec.schema import ImageInput, LMHead, Spec

__all__: list[str] = []


def _gpt2(c: Config) -> dict[str, Any]:
    c.only("scale_attn_weights", True, [True], "unscaled attention would need attention_scale: 1")
    c.only("scale_attn_by_inverse_layer_idx", False, [False], "a per-layer scale has no spec")
    c.only("reorder_and_upcast_attn", False, [False], "changes the attention's arithmetic")
    width = c.get("n_embd", 768)
    return {
        "specvit": 1,
        "name": "gpt2_from_hf",
        "description": "GPT-2 (GPT2LMHeadModel; Radford et al. 2019), imported from its transformers config.",
        "model": "decoder",
        "decoder": {
            "input": {"kind": "tokens", "vocab": c.get("vocab_size", 50257)},
            "position": {"kind": "learned", "max_len": c.get("n_positions", 1024)},
            "width": width,
            "depth": c.get("n_layer", 12),
            "block": {
                "heads": c.get("n_head", 12),
                "layers": ["masked_self_attention", "mlp"],
                "norm": {"eps": c.get("layer_norm_epsilon", 1e-5)},
                "mlp": {
                    "hidden": c.get("n_inner", 4 * width),
                    "activation": activation(c, key="activation_function", default="gelu_new"),
                },
            },
        },
        "head": {"kind": "lm", "tied": bool(c.get("tie_word_embeddings", True))},
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


def _hf_gpt2(spec: Spec, keys: Sequence[str]) -> Layout:
    check_blocks(spec, "decoder", "HF GPT2LMHeadModel", [("masked_self_attention", "mlp")], "pre")
    pre = prefix(keys, "transformer.")
    layer, block = pre + "h.{i}.", "decoder.blocks.{i}."
    table = {
        "decoder.tok_embed.{p}": one(pre + "wte.{p}"),
        "decoder.pos_embed.weight": one(pre + "wpe.weight", batched),
        block + "norm1.{p}": one(layer + "ln_1.{p}"),
        block + "attn.qkv.{p}": one(layer + "attn.c_attn.{p}", conv1d),
        block + "attn.proj.{p}": one(layer + "attn.c_proj.{p}", conv1d),
        block + "norm2.{p}": one(layer + "ln_2.{p}"),
        block + "mlp.fc1.{p}": one(layer + "mlp.c_fc.{p}", conv1d),
        block + "mlp.fc2.{p}": one(layer + "mlp.c_proj.{p}", conv1d),
        "decoder.norm.{p}": one(pre + "ln_f.{p}"),
    }
    tied = {}
    if isinstance(spec.head, LMHead) and spec.head.tied:
        tied["lm_head.weight"] = pre + "wte.weight"
    else:
        table["head.fc.{p}"] = one("lm_head.{p}")
    return Layout(
        "HF GPT2LMHeadModel",
        table,
        ignore=(re.escape(pre) + r"h\.\d+\.attn\.(?:bias|masked_bias)",),  # causal-mask buffers
        tied=tied,
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
family(Family("GPT2LMHeadModel", ("gpt2",), r"(?:transformer\.)?h\.\d+\.attn\.c_attn\.", _gpt2, _hf_gpt2))
