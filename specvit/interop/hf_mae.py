"""MAE pre-training (``ViTMAEForPreTraining``; He et al. 2021): a masked ViT encoder and its pixel decoder."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specvit.interop.layout import Layout, cat, check_blocks, one
from specvit.interop.registry import FAMILIES, Config, Family, activation
from specvit.nn.position import sincos_2d
from specvit.ops.masking import keep_count
from specvit.spec.schema import Spec

__all__: list[str] = []


def _stack(c: Config, width: int, depth: int, heads: int, hidden: int) -> dict[str, Any]:
    """The blocks of either stack: ViTMAELayer (pre-norm, qkv bias as the config, MLP fc1/act/fc2)."""
    return {
        "position": "sincos2d",
        "width": width,
        "depth": depth,
        "dropout": {"attention": float(c.get("attention_probs_dropout_prob", 0.0))},
        "block": {
            "heads": heads,
            "layers": ["self_attention", "mlp"],
            "norm": {"placement": "pre", "eps": c.get("layer_norm_eps", 1e-12)},
            "mlp": {"hidden": hidden, "activation": activation(c, default="gelu")},
            "qkv_bias": bool(c.get("qkv_bias", True)),
        },
    }


def _mae(c: Config) -> dict[str, Any]:
    named = c.get("architectures", kind=list)
    if named not in (None, ["ViTMAEForPreTraining"]):
        raise c.refuse(
            "architectures",
            named,
            "specvit reads ViTMAEForPreTraining (ViTMAEModel masks a random share of the patches in every call)",
            "use ViTMAEForPreTraining",
        )
    for key in ("image_size", "patch_size"):
        value = c.values.get(key)
        if isinstance(value, list):
            raise c.refuse(
                key, value, "ViTMAE's patchify and sin-cos tables assume square images", f"give one int {key}"
            )
    patches = (c.size("image_size", 224) // c.size("patch_size", 16)) ** 2
    ratio = c.get("mask_ratio", 0.75)
    if not 0 < ratio < 1 or not 1 <= keep_count(patches, ratio) < patches:
        raise c.refuse(
            "mask_ratio",
            ratio,
            f"it keeps {keep_count(patches, ratio)} of {patches} patches",
            "keep some, mask some",
        )
    if c.get("hidden_dropout_prob", 0.0):
        raise c.refuse(
            "hidden_dropout_prob",
            c.get("hidden_dropout_prob"),
            "ViTMAELayer drops after the attention and after the MLP, specvit's mlp dropout also inside it",
            "use 0.0",
        )
    encoder = {
        "input": {
            "kind": "image",
            "size": c.get("image_size", 224),
            "patch": c.get("patch_size", 16),
            "channels": c.get("num_channels", 3),
        },
        "masking": {"ratio": float(c.get("mask_ratio", 0.75))},
        "prefix": {"cls": True},
        **_stack(
            c,
            c.get("hidden_size", 768),
            c.get("num_hidden_layers", 12),
            c.get("num_attention_heads", 12),
            c.get("intermediate_size", 3072),
        ),
    }
    decoder = {
        "input": {"kind": "unmask"},
        **_stack(
            c,
            c.get("decoder_hidden_size", 512),
            c.get("decoder_num_hidden_layers", 8),
            c.get("decoder_num_attention_heads", 16),
            c.get("decoder_intermediate_size", 2048),
        ),
    }
    return {
        "specvit": 1,
        "name": "vit_mae_from_hf",
        "description": "MAE pre-training (ViTMAEForPreTraining; He et al. 2021), imported from its transformers config.",
        "model": "encoder_decoder",
        "encoder": encoder,
        "decoder": decoder,
        "head": {"kind": "patches", "loss": "masked_mse", "norm_pix": bool(c.get("norm_pix_loss", False))},
        "init": "xavier",
    }


def _hf_mae(spec: Spec, keys: Sequence[str]) -> Layout:
    name = "HF ViTMAEForPreTraining"
    for role in ("encoder", "decoder"):
        check_blocks(spec, role, name, [("self_attention", "mlp")], "pre")
    legacy = any(k.startswith("vit.encoder.layer.") for k in keys)  # transformers 4 / Hub checkpoint names
    table = {
        "encoder.patch_embed.proj.{p}": one("vit.embeddings.patch_embeddings.projection.{p}"),
        "encoder.prefix.cls_token": one("vit.embeddings.cls_token"),
        "encoder.norm.{p}": one("vit.layernorm.{p}"),
        "decoder.embed.{p}": one("decoder.decoder_embed.{p}"),
        "decoder.unshuffle.mask_token": one("decoder.mask_token"),
        "decoder.norm.{p}": one("decoder.decoder_norm.{p}"),
        "head.fc.{p}": one("decoder.decoder_pred.{p}"),
    }
    for role, layers in (
        ("encoder", "vit.encoder.layer." if legacy else "vit.layers."),
        ("decoder", "decoder.decoder_layers."),
    ):
        layer, block = layers + "{i}.", f"{role}.blocks.{{i}}."
        if legacy:
            qkv = tuple(layer + f"attention.attention.{n}" + ".{p}" for n in ("query", "key", "value"))
            proj, fc1, fc2 = "attention.output.dense", "intermediate.dense", "output.dense"
        else:
            qkv = tuple(layer + f"attention.{n}_proj" + ".{p}" for n in "qkv")
            proj, fc1, fc2 = "attention.o_proj", "mlp.fc1", "mlp.fc2"
        table |= {
            block + "norm1.{p}": one(layer + "layernorm_before.{p}"),
            block + "attn.qkv.{p}": (qkv, cat),
            block + "attn.proj.{p}": one(layer + proj + ".{p}"),
            block + "norm2.{p}": one(layer + "layernorm_after.{p}"),
            block + "mlp.fc1.{p}": one(layer + fc1 + ".{p}"),
            block + "mlp.fc2.{p}": one(layer + fc2 + ".{p}"),
        }
    # The frozen sin-cos tables (parameters with requires_grad=False in HF) are computed by specvit's
    # sincos2d positions: accepted when they hold those values (pretrained checkpoints do; a model built
    # from a config holds zeros, and would compute something else).
    fixed = {
        "vit.embeddings.position_embeddings": _table(spec.encoder),
        "decoder.decoder_pos_embed": _table(spec.decoder, spec.encoder),
    }
    return Layout(name, table, fixed=fixed)


def _table(stack: Any, image: Any = None) -> Tensor:
    """The (1, 1 + N, D) table HF stores for a stack's sincos2d positions: zero for the class token."""
    gh, gw = (image or stack).input.grid
    base = stack.positions[0].base
    grid = sincos_2d(gh, gw, stack.width, base)  # (N, D)
    return torch.cat((torch.zeros(1, stack.width), grid)).unsqueeze(0)


# Ahead of ViTModel: a ViTMAE state dict holds a ViT's encoder keys too; its decoder_pred is its own.
FAMILIES.insert(0, Family("ViTMAEForPreTraining", ("vit_mae",), r"decoder\.decoder_pred\.", _mae, _hf_mae))
