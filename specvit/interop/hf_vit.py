"""The ViT-like vision towers, as tables: ViT (transformers 5's names, and the names of transformers 4 and
Hub checkpoints), DeiT and DINOv2. A pre-norm encoder of a patch embedding, a class token and a learned
position table; DeiT adds a distillation token, DINOv2 layer scales."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from specvit.interop.hf_bert import head_ops
from specvit.interop.registry import ACTIVATIONS
from specvit.interop.table import BARE, LABELS, D, F, Head, Only, Table, count, pooled, register

__all__ = ["VIT"]

_LAYER = "layers.{i}."
_BLOCK = "encoder.blocks.{i}."


def classifier(fc: str = "classifier", **spec: Any) -> Head:
    """An image classifier on the class token after the final norm (``*ForImageClassification``).

    Args:
        fc: the HF linear's name.
        spec: more head entries, by the key under ``head.``.
    """
    entries = {"head.kind": "classifier", "head.pool": "cls", "head.classes": LABELS}
    return Head(entries | {f"head.{k}": v for k, v in spec.items()}, {"head.fc": fc})


POOLER = pooled(
    {"head.ops.0": "pooler.dense"},
    pool="cls",
    ops=head_ops(
        {"kind": "linear", "width": F("pooler_output_size", None, kind=int)},
        {"kind": "act", "fn": F("pooler_act", "tanh", map=ACTIVATIONS | {"tanh": "tanh"})},
    ),
)
"""ViTModel's and DeiTModel's pooler: a dense layer (to ``pooler_output_size``, null: the width) and
``pooler_act`` on the class token."""

_NO_DROPOUT = Only(
    "hidden_dropout_prob", 0.0, (0.0,), "ViT's dropout after the projections has no spec key of its own"
)

VIT = register(
    Table(
        name="ViT",
        model_types=("vit",),
        role="encoder",
        keys=r"(?:vit\.)?layers\.\d+\.layernorm_before\.",
        spec={
            "encoder.input.kind": "image",
            "encoder.input.size": F("image_size", 224),
            "encoder.input.patch": F("patch_size", 16),
            "encoder.input.channels": F("num_channels", 3),
            "encoder.prefix.cls": True,
            "encoder.position": "learned",
            "encoder.width": F("hidden_size", 768),
            "encoder.depth": F("num_hidden_layers", 12),
            "encoder.block.heads": count("num_attention_heads", 12),
            "encoder.block.norm.eps": F("layer_norm_eps", 1e-12),
            "encoder.block.mlp.hidden": F("intermediate_size", 3072),
            "encoder.block.mlp.activation": F("hidden_act", "gelu", map=ACTIVATIONS),
            "encoder.block.qkv_bias": F("qkv_bias", True),
            "encoder.dropout.attention": F("attention_probs_dropout_prob", 0.0),
        },
        only=(_NO_DROPOUT,),
        inert=("encoder_stride",),  # ViTForMaskedImageModeling's decoder
        names={
            "encoder.patch_embed.proj": "embeddings.patch_embeddings.projection",
            "encoder.prefix.cls_token": "embeddings.cls_token",
            "encoder.pos_embed.weight": "embeddings.position_embeddings",
            _BLOCK + "norm1": _LAYER + "layernorm_before",
            _BLOCK + "attn.qkv": tuple(_LAYER + f"attention.{n}_proj" for n in "qkv"),
            _BLOCK + "attn.proj": _LAYER + "attention.o_proj",
            _BLOCK + "norm2": _LAYER + "layernorm_after",
            _BLOCK + "mlp.fc1": _LAYER + "mlp.fc1",
            _BLOCK + "mlp.fc2": _LAYER + "mlp.fc2",
            "encoder.norm": "layernorm",
        },
        classes={"Model": BARE, "ForImageClassification": classifier()},
        default="Model",
        backbone="vit.",
        pooled=POOLER,
    )
)

_LEGACY = "encoder.layer.{i}."

register(  # the same model under transformers 4's names, as Hub checkpoints hold them
    VIT.but(
        "ViT",
        (),
        names={
            _BLOCK + "norm1": _LEGACY + "layernorm_before",
            _BLOCK + "attn.qkv": tuple(
                _LEGACY + f"attention.attention.{n}" for n in ("query", "key", "value")
            ),
            _BLOCK + "attn.proj": _LEGACY + "attention.output.dense",
            _BLOCK + "norm2": _LEGACY + "layernorm_after",
            _BLOCK + "mlp.fc1": _LEGACY + "intermediate.dense",
            _BLOCK + "mlp.fc2": _LEGACY + "output.dense",
        },
        keys=r"(?:vit\.)?encoder\.layer\.\d+\.layernorm_before\.",
    )
)


VIT_MSN = register(
    VIT.but(
        "ViTMSN",
        ("vit_msn",),
        {"encoder.block.norm.eps": F("layer_norm_eps", 1e-6)},
        drop=("encoder_stride",),  # no masked-image decoder
        pooled=None,  # nor a pooler
    )
)
"""ViT-MSN (Assran et al. 2022): ViT's tower and classifier, without ViT's pooler or its decoder's fields."""


DEIT = register(
    VIT.but(
        "DeiT",
        ("deit",),
        {"encoder.prefix.distillation": True},
        names={"encoder.prefix.dist_token": "embeddings.distillation_token"},
        classes={
            "Model": BARE,
            "ForImageClassification": classifier(),
            "ForImageClassificationWithTeacher": Head(
                {"head.kind": "distilled", "head.classes": LABELS},
                {"head.fc": "cls_classifier", "head.fc_dist": "distillation_classifier"},
            ),
        },
        keys=r"(?:deit\.)?embeddings\.distillation_token",
        backbone="deit.",
    )
)

_DINO = "encoder.layer.{i}."


def _write_mlp_ratio(ratio: float | None, get: Callable[[str], Any]) -> dict[str, Any]:
    """DINOv2's ``mlp_ratio``, an integer in its config: the MLP's width over the blocks' (none where the
    spec's widths have no integer ratio, which then reads back as another)."""
    ratio = ratio or get("encoder.block.mlp.hidden") / get("encoder.width")
    return {"mlp_ratio": int(ratio)} if float(ratio).is_integer() else {}


DINOV2 = register(
    replace(
        VIT.but(
            "Dinov2",
            ("dinov2",),
            {
                "encoder.input.size": F("image_size", 224),
                "encoder.input.patch": F("patch_size", 14),
                "encoder.block.norm.eps": F("layer_norm_eps", 1e-6),
                "encoder.block.mlp.ratio": D(
                    lambda c, spec: c.get("mlp_ratio", 4, float), ("mlp_ratio",), _write_mlp_ratio
                ),
                "encoder.block.layer_scale": F("layerscale_value", 1.0),
            },
            drop=("hidden_dropout_prob", "encoder.block.mlp.hidden"),
            only=(
                Only(
                    "use_swiglu_ffn",
                    False,
                    (False,),
                    "DINOv2's SwiGLU MLP names its weights apart (weights_in/out)",
                ),
                Only("apply_layernorm", True, (True,), "the final norm is applied to the features"),
                _NO_DROPOUT,
            ),
            # drop_path_rate: stochastic depth, off in eval; use_mask_token: a token for masked patches, used only
            # with bool_masked_pos; the backbone fields choose which stages a Dinov2Backbone returns
            inert=(
                "drop_path_rate",
                "use_mask_token",
                "reshape_hidden_states",
                "stage_names",
                "out_features",
                "out_indices",
            ),
            names={
                _BLOCK + "norm1": _DINO + "norm1",
                _BLOCK + "attn.qkv": tuple(_DINO + f"attention.{n}_proj" for n in "qkv"),
                _BLOCK + "attn.proj": _DINO + "attention.o_proj",
                _BLOCK + "ls1.gamma": _DINO + "layer_scale1.lambda1",
                _BLOCK + "norm2": _DINO + "norm2",
                _BLOCK + "mlp.fc1": _DINO + "mlp.fc1",
                _BLOCK + "mlp.fc2": _DINO + "mlp.fc2",
                _BLOCK + "ls2.gamma": _DINO + "layer_scale2.lambda1",
            },
            keys=r"(?:dinov2\.)?encoder\.layer\.\d+\.layer_scale1\.",
            backbone="dinov2.",
            ignore=(r"(?:dinov2\.)?embeddings\.mask_token",),
        ),
        # Dinov2ForImageClassification classifies the class token concatenated with the patches' mean
        classes={"Model": BARE, "ForImageClassification": classifier(pool="cls_mean")},
        pooled=pooled(pool="cls"),  # Dinov2Model's pooler_output: the normed class token
    )
)
