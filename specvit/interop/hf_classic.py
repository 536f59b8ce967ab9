"""GPT-2 (``GPT2LMHeadModel``); BERT and ViT are tables (``hf_bert.py``, ``hf_vit.py``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import (
    Layout,
    batched,
    check_blocks,
    conv1d,
    one,
    prefix,
)
from specvit.interop.registry import Config, Family, activation, family
from specvit.spec.schema import LMHead, Spec

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


family(Family("GPT2LMHeadModel", ("gpt2",), r"(?:transformer\.)?h\.\d+\.attn\.c_attn\.", _gpt2, _hf_gpt2))
