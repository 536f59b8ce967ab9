"""CLIP's text tower (``CLIPTextModelWithProjection``; Radford et al. 2021): a causal pre-norm encoder with
learned positions, quick_gelu MLPs and a final norm, pooled at the end-of-text token and projected without
bias. A full ``clip`` config is read through its ``text_config`` and ``projection_dim``.

HF pools the highest token id when ``eos_token_id`` is 2 (configs from before transformers PR #24773, as
the OpenAI checkpoints'), else the first occurrence of ``eos_token_id``; the head's ``eos_id`` says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Layout, batched, cat, check_blocks, one
from specvit.interop.registry import Config, Family, activation, family

__all__: list[str] = []


class _TextConfig(Config):
    """The ``text_config`` of a full CLIP config: refusals name ``config.text_config.<field>``."""

    prefix = "text_config."


def _spec(c: Config) -> dict[str, Any]:
    text: Config = c
    projection = c.get("projection_dim", 512)
    if c.model_type == "clip":
        sub = c.get("text_config", {})
        if not isinstance(sub, dict):
            raise c.refuse("text_config", sub, "it is not a mapping of the text tower's fields", "give one")
        text = _TextConfig(c.model_type, sub, c.source)
    vocab = text.get("vocab_size", 49408)
    eos = text.get("eos_token_id", 49407)
    if not isinstance(eos, int) or isinstance(eos, bool) or eos < 0:
        raise text.refuse(
            "eos_token_id", eos, "the pooled token must be one token id", "give the end-of-text token's id"
        )
    head: dict[str, Any] = {"kind": "classifier", "classes": projection, "pool": "eos", "bias": False}
    if eos != 2:  # HF's legacy rule for eos_token_id 2 is the head's default: the highest id
        head["eos_id"] = eos
    return {
        "specvit": 1,
        "name": "clip_text_from_hf",
        "description": "CLIP text tower (CLIPTextModelWithProjection; Radford et al. 2021), imported from its "
        "transformers config.",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "tokens", "vocab": vocab},
            "position": {"kind": "learned", "max_len": text.get("max_position_embeddings", 77)},
            "width": text.get("hidden_size", 512),
            "depth": text.get("num_hidden_layers", 12),
            "block": {
                "heads": text.get("num_attention_heads", 8),
                "layers": ["masked_self_attention", "mlp"],
                "norm": {"eps": text.get("layer_norm_eps", 1e-5)},
                "mlp": {
                    "hidden": text.get("intermediate_size", 2048),
                    "activation": activation(text, default="quick_gelu"),
                },
            },
        },
        "head": head,
    }


def _layout(spec: Any, keys: Sequence[str]) -> Layout:
    name = "HF CLIPTextModelWithProjection"
    check_blocks(spec, "encoder", name, [("masked_self_attention", "mlp")], "pre")
    pre, block = "text_model.", "encoder.blocks.{i}."
    layer = pre + "encoder.layers.{i}."
    qkv = tuple(layer + f"self_attn.{n}_proj" + ".{p}" for n in "qkv")
    table = {
        "encoder.tok_embed.weight": one(pre + "embeddings.token_embedding.weight"),
        "encoder.pos_embed.weight": one(pre + "embeddings.position_embedding.weight", batched),
        block + "norm1.{p}": one(layer + "layer_norm1.{p}"),
        block + "attn.qkv.{p}": (qkv, cat),
        block + "attn.proj.{p}": one(layer + "self_attn.out_proj.{p}"),
        block + "norm2.{p}": one(layer + "layer_norm2.{p}"),
        block + "mlp.fc1.{p}": one(layer + "mlp.fc1.{p}"),
        block + "mlp.fc2.{p}": one(layer + "mlp.fc2.{p}"),
        "encoder.norm.{p}": one(pre + "final_layer_norm.{p}"),
        "head.fc.weight": one("text_projection.weight"),
    }
    # position_ids is a buffer; a full CLIPModel's image tower and logit scale are not the text tower's
    ignore = (
        r"text_model\.embeddings\.position_ids",
        r"vision_model\..*",
        r"visual_projection\..*",
        r"logit_scale",
    )
    return Layout(name, table, ignore=ignore)


family(
    Family(
        "CLIPTextModelWithProjection",
        ("clip_text_model", "clip"),
        r"text_model\.encoder\.layers\.\d+\.",
        _spec,
        _layout,
    )
)
