"""The BEiT layout of transformers as tables: Data2Vec-vision (Baevski et al. 2022) and BEiT (Bao et al. 2021).

(This module imports no other family's: registered before ``hf_vit.py``, whose key pattern BEiT's weights
also match, its layouts are tried first, and a ViT spec's q/k/v biases make them a ``Misfit``.)

A pre-norm ViT with a class token whose attention has a query and a value bias but no key bias
(``qkv_bias: [true, false, true]``), layer scale on both branches (``lambda_1``, ``lambda_2``), and BEiT's
learned 2D relative position bias (``position: relative2d``): a table per layer, or one shared by all
layers; learned absolute positions or none. The classifier pools the mean of the patches and norms it
(``use_mean_pooling``), or reads the class token after a final norm.

HF resizes the relative table to the input's grid by a bilinear interpolation, the identity at the grid of
the config's square image; a spec states one image size (a list ``image_size`` is refused, as the table's
resize transposes a rectangle's grid).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.table import BARE, LABELS, D, F, Head, Only, Table, count, pooled, register

__all__ = ["BEIT", "DATA2VEC_VISION"]


def _positions(c: Config, spec: Mapping[str, Any]) -> Any:
    """``position:``: learned absolute positions (over the class token too) and/or the relative bias."""
    own = c.get("use_relative_position_bias", False)
    shared = c.get("use_shared_relative_position_bias", False)
    if own and shared:
        raise c.refuse(
            "use_relative_position_bias",
            own,
            "a table per layer added to the shared one (use_shared_relative_position_bias), and specvit's "
            "relative2d is one or the other",
            "set one of use_relative_position_bias and use_shared_relative_position_bias",
        )
    positions: list[Any] = ["learned"] if c.get("use_absolute_position_embeddings", False) else []
    positions += [{"kind": "relative2d", "shared": bool(shared)}] if own or shared else []
    return positions[0] if len(positions) == 1 else positions or "none"


def _write_positions(position: Any, get: Callable[[str], Any]) -> dict[str, Any]:
    """The three switches of :func:`_positions`' kinds."""
    kinds = {p["kind"]: p for p in (position if isinstance(position, list) else [position])}
    shared = bool(kinds.get("relative2d", {}).get("shared"))
    return {
        "use_absolute_position_embeddings": "learned" in kinds,
        "use_relative_position_bias": "relative2d" in kinds and not shared,
        "use_shared_relative_position_bias": shared,
    }


def _mean_pooling(mean: bool) -> dict[str, Any]:
    return {"use_mean_pooling": mean}


def _layer_scale(c: Config, spec: Mapping[str, Any]) -> float | None:
    """The layer scales' initial value; 0 (or less) builds none."""
    value = c.get("layer_scale_init_value", 0.1)
    return value if value > 0 else None


def _write_layer_scale(value: float | None, get: Callable[[str], Any]) -> dict[str, Any]:
    return {"layer_scale_init_value": 0.0 if value is None else value}


def _mean(c: Config) -> bool:
    return bool(c.get("use_mean_pooling", True))


_LAYER = "encoder.layer.{i}."
_BLOCK = "encoder.blocks.{i}."
_SEGMENTATION = (
    "out_indices",
    "out_features",
    "pool_scales",
    "use_auxiliary_head",
    "auxiliary_loss_weight",
    "auxiliary_channels",
    "auxiliary_num_convs",
    "auxiliary_concat_input",
    "semantic_loss_ignore_index",
    "add_fpn",
    "reshape_hidden_states",
    "stage_names",
)
"""Fields of the segmentation heads and backbones (``*ForSemanticSegmentation``, ``BeitBackbone``): refused
classes."""

_POOL = {
    "head.pool": D(
        lambda c, spec: "mean" if _mean(c) else "cls",
        ("use_mean_pooling",),
        lambda pool, get: _mean_pooling(pool == "mean"),
    ),
    "head.norm": D(lambda c, spec: _mean(c), ("use_mean_pooling",), lambda norm, get: _mean_pooling(norm)),
}
"""BEiT's pooler: the mean of the patch tokens, normed (``pooler.layernorm``), or with ``use_mean_pooling``
false the class token after the final norm."""

DATA2VEC_VISION = register(
    Table(
        name="Data2VecVision",
        model_types=("data2vec-vision",),
        role="encoder",
        keys=r"(?:data2vec_vision\.)?encoder\.layer\.\d+\.attention\.attention\.query\.",
        spec={
            "encoder.input.kind": "image",
            "encoder.input.size": F("image_size", 224),
            "encoder.input.patch": F("patch_size", 16),
            "encoder.input.channels": F("num_channels", 3),
            "encoder.prefix.cls": True,
            "encoder.position": D(
                _positions,
                (
                    "use_absolute_position_embeddings",
                    "use_relative_position_bias",
                    "use_shared_relative_position_bias",
                ),
                _write_positions,
            ),
            "encoder.width": F("hidden_size", 768),
            "encoder.depth": F("num_hidden_layers", 12),
            "encoder.final_norm": D(
                lambda c, spec: not _mean(c),
                ("use_mean_pooling",),
                lambda final, get: _mean_pooling(not final),
            ),
            "encoder.block.heads": count("num_attention_heads", 12),
            "encoder.block.norm.eps": F("layer_norm_eps", 1e-12),
            "encoder.block.mlp.hidden": F("intermediate_size", 3072),
            "encoder.block.mlp.activation": F("hidden_act", "gelu", map=ACTIVATIONS),
            "encoder.block.qkv_bias": [True, False, True],  # no key bias
            "encoder.block.layer_scale": D(_layer_scale, ("layer_scale_init_value",), _write_layer_scale),
            "encoder.dropout.attention": F("attention_probs_dropout_prob", 0.0),
            "encoder.drop_path": F("drop_path_rate", 0.1),  # linear from 0 over the layers, as specvit's
        },
        only=(
            Only(
                "hidden_dropout_prob",
                0.0,
                (0.0,),
                "BEiT's dropout after the projections has no spec key of its own",
            ),
        ),
        # the mask token replaces masked patches only when bool_masked_pos is passed (masked image modelling);
        # vocab_size is the masked-image-modelling head's (BeitForMaskedImageModeling, refused)
        inert=("use_mask_token", "vocab_size", *_SEGMENTATION),
        names={
            "encoder.patch_embed.proj": "embeddings.patch_embeddings.projection",
            "encoder.prefix.cls_token": "embeddings.cls_token",
            "encoder.pos_embed.weight": "embeddings.position_embeddings",
            "encoder.rel_bias": "encoder.relative_position_bias",
            _BLOCK + "norm1": _LAYER + "layernorm_before",
            _BLOCK + "attn.qkv": tuple(
                _LAYER + f"attention.attention.{n}" for n in ("query", "key", "value")
            ),
            _BLOCK + "attn.q_bias": _LAYER + "attention.attention.query.bias",
            _BLOCK + "attn.v_bias": _LAYER + "attention.attention.value.bias",
            _BLOCK + "rel_bias": _LAYER + "attention.attention.relative_position_bias",
            _BLOCK + "attn.proj": _LAYER + "attention.output.dense",
            _BLOCK + "ls1.gamma": _LAYER + "lambda_1",
            _BLOCK + "norm2": _LAYER + "layernorm_after",
            _BLOCK + "mlp.fc1": _LAYER + "intermediate.dense",
            _BLOCK + "mlp.fc2": _LAYER + "output.dense",
            _BLOCK + "ls2.gamma": _LAYER + "lambda_2",
            "encoder.norm": "layernorm",
            "head.norm": "pooler.layernorm",  # the mean's norm, in the backbone's pooler
        },
        classes={
            "Model": BARE,  # without the pooler (add_pooling_layer=False, Data2VecVisionModel's default)
            "ForImageClassification": Head(
                {"head.kind": "classifier", **_POOL, "head.classes": LABELS}, {"head.fc": "classifier"}
            ),
        },
        pooled=pooled(None, pool=_POOL["head.pool"], norm=_POOL["head.norm"]),  # BeitModel's default
        default="Model",
        ignore=(r"(?:\w+\.)?embeddings\.mask_token",),  # used only with bool_masked_pos
        backbone="data2vec_vision.",
    )
)

_BEIT = "layers.{i}."

BEIT = register(
    DATA2VEC_VISION.but(
        "Beit",
        ("beit",),
        names={
            "encoder.rel_bias": "shared_position_bias",
            _BLOCK + "norm1": _BEIT + "layernorm_before",
            _BLOCK + "attn.qkv": tuple(_BEIT + f"attention.{n}_proj" for n in "qkv"),
            _BLOCK + "attn.q_bias": _BEIT + "attention.q_proj.bias",
            _BLOCK + "attn.v_bias": _BEIT + "attention.v_proj.bias",
            _BLOCK + "rel_bias": _BEIT + "relative_position_bias",
            _BLOCK + "attn.proj": _BEIT + "attention.o_proj",
            _BLOCK + "ls1.gamma": _BEIT + "lambda_1",
            _BLOCK + "norm2": _BEIT + "layernorm_after",
            _BLOCK + "mlp.fc1": _BEIT + "mlp.fc1",
            _BLOCK + "mlp.fc2": _BEIT + "mlp.fc2",
            _BLOCK + "ls2.gamma": _BEIT + "lambda_2",
        },
        keys=r"(?:beit\.)?layers\.\d+\.attention\.q_proj\.",
        backbone="beit.",
    )
)
"""BEiT under transformers 5's names (BeitModel builds its pooler unless told not to: a model holding it, or a
state dict holding ``pooler.layernorm``, is read with both outputs)."""

register(  # the same model under transformers 4's names, as Hub checkpoints hold them: Data2Vec-vision's
    DATA2VEC_VISION.but(
        "Beit", (), keys=r"(?:beit\.)?encoder\.layer\.\d+\.attention\.attention\.query\.", backbone="beit."
    )
)
