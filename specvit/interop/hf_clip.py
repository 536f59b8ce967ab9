"""The CLIP layout of transformers as tables: CLIP's text and vision towers (Radford et al. 2021), and
SigLIP's (Zhai et al. 2023), with and without their projections.

One pre-norm block for every tower: ``encoder.layers.{i}.layer_norm1``, ``self_attn.{q,k,v,out}_proj``,
``layer_norm2``, ``mlp.fc1`` / ``fc2``.

- CLIP's text tower (``CLIPTextModel``): a causal encoder with learned positions, quick_gelu MLPs and a final
  norm. ``CLIPTextModelWithProjection`` pools the end-of-text token and projects it without bias: HF pools
  the highest token id when ``eos_token_id`` is 2 (configs from before transformers PR #24773, as the OpenAI
  checkpoints'), else the first occurrence of ``eos_token_id``; the head's ``eos_id`` says which. A full
  ``clip`` config is read as its text tower with the projection (``text_config``, ``projection_dim``).
- CLIP's vision tower: a class token, learned positions, a norm after the embeddings (``pre_layrnorm``)
  and none after the blocks: HF norms only the pooled class token (``post_layernorm``). ``CLIPVisionModel``
  is that pooled, normed token (its ``pooler_output``), ``CLIPVisionModelWithProjection`` its projection.
- SigLIP's vision tower: no class token, a final norm, and (``vision_use_head``) the attention-pooling head
  (a probe, ``nn.MultiheadAttention``, a pre-norm MLP): ``pool: attention``, its ``pooler_output``.

Those are the base classes read from a config alone. Each computes both its ``last_hidden_state`` and its
``pooler_output``, and read from the model itself (or with ``pooler=True``) it is :attr:`Table.pooled`: the
same pooling with ``tokens: true``, returning both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from specvit.interop.layout import RowShare, Undoable, batched, unbatched
from specvit.interop.registry import ACTIVATIONS, Config, Family, family
from specvit.interop.table import COMMON, D, F, Head, Name, Renamed, Table, count, pooled, register

__all__ = ["CLIP_TEXT", "CLIP_VISION", "SIGLIP_VISION"]


_token = Undoable(lambda t: t.reshape(1, 1, -1), lambda t: t.reshape(-1))
"""CLIP's class embedding (D,) as specvit's class token (1, 1, D)."""
_queries, _keys_values = RowShare(0, (1, 2)), RowShare(1, (1, 2))
"""The q rows of nn.MultiheadAttention's in_proj, [q; k; v], and its k and v rows."""


_LAYER = "encoder.layers.{i}."
_BLOCK = "encoder.blocks.{i}."
BLOCKS: dict[str, Name] = {
    _BLOCK + "norm1": _LAYER + "layer_norm1",
    _BLOCK + "attn.qkv": tuple(_LAYER + f"self_attn.{n}_proj" for n in "qkv"),
    _BLOCK + "attn.proj": _LAYER + "self_attn.out_proj",
    _BLOCK + "norm2": _LAYER + "layer_norm2",
    _BLOCK + "mlp.fc1": _LAYER + "mlp.fc1",
    _BLOCK + "mlp.fc2": _LAYER + "mlp.fc2",
}
"""The blocks of every tower of the layout, relative to the tower."""


def _eos(c: Config, spec: Mapping[str, Any]) -> int | None:
    """The pooled token's id: None (the highest id in each sequence) for HF's legacy ``eos_token_id`` 2."""
    eos = c.get("eos_token_id", 49407)
    if eos < 0:
        raise c.refuse(
            "eos_token_id", eos, "the pooled token must be a token id", "give the end-of-text token's id"
        )
    return None if eos == 2 else eos


def _write_eos(eos: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
    return {"eos_token_id": 2 if eos is None else eos}


def _write_pooled_id(head: Any, get: Callable[[str], Any]) -> dict[str, Any]:
    """CLIPTextModel's ``pooler_output``, which a spec without a head does not compute, is read at
    ``eos_token_id`` all the same (transformers raises on null): the class's default."""
    return {"eos_token_id": 49407}


CLIP_TEXT = register(
    Table(
        name="CLIPText",
        model_types=("clip_text_model",),
        role="encoder",
        keys=r"(?:text_model\.)?embeddings\.token_embedding\.",
        spec={
            "encoder.input.kind": "tokens",
            "encoder.input.vocab": F("vocab_size", 49408),
            "encoder.position.kind": "learned",
            "encoder.position.max_len": F("max_position_embeddings", 77),
            "encoder.width": F("hidden_size", 512),
            "encoder.depth": F("num_hidden_layers", 12),
            "encoder.block.heads": count("num_attention_heads", 8),
            "encoder.block.layers": ["masked_self_attention", "mlp"],  # causal
            "encoder.block.norm.eps": F("layer_norm_eps", 1e-5),
            "encoder.block.mlp.hidden": F("intermediate_size", 2048),
            "encoder.block.mlp.activation": F("hidden_act", "quick_gelu", map=ACTIVATIONS),
            "encoder.dropout.attention": F("attention_dropout", 0.0),
        },
        inert=("initializer_factor",),
        names={
            "encoder.tok_embed": "embeddings.token_embedding",
            "encoder.pos_embed.weight": Renamed("embeddings.position_embedding.weight", batched),
            **BLOCKS,
            "encoder.norm": "final_layer_norm",
        },
        classes={
            "Model": Head({"head": D(lambda c, spec: "none", (), _write_pooled_id)}),  # last_hidden_state
            "ModelWithProjection": Head(
                {
                    "head.kind": "classifier",
                    "head.pool": "eos",
                    "head.eos_id": D(_eos, ("eos_token_id",), _write_eos),
                    "head.classes": count("projection_dim", 512),
                    "head.bias": False,
                },
                {"head.fc": "text_projection"},
            ),
        },
        default="ModelWithProjection",
        pooled=pooled(pool="eos", eos_id=D(_eos, ("eos_token_id",), _write_eos)),  # CLIPTextModel's outputs
        # position_ids is a buffer; a full CLIPModel's image tower and logit scale are not the text tower's
        ignore=(
            r"(?:text_model\.)?embeddings\.position_ids",
            r"vision_model\..*",
            r"visual_projection\..*",
            r"logit_scale",
        ),
        backbone="text_model.",
    )
)

_POOLED = {"head": {"kind": "classifier", "pool": "cls", "norm": True, "classes": None}}
"""CLIPVisionModel's ``pooler_output``: the class token, normed (``post_layernorm``)."""

CLIP_VISION = register(
    Table(
        name="CLIPVision",
        model_types=("clip_vision_model",),
        role="encoder",
        keys=r"(?:vision_model\.)?embeddings\.class_embedding",
        spec={
            "encoder.input.kind": "image",
            "encoder.input.size": F("image_size", 224),
            "encoder.input.patch": F("patch_size", 32),
            "encoder.input.channels": F("num_channels", 3),
            "encoder.input.bias": False,
            "encoder.prefix.cls": True,
            "encoder.position": "learned",
            "encoder.embed_norm": True,  # pre_layrnorm
            "encoder.final_norm": False,
            "encoder.width": F("hidden_size", 768),
            "encoder.depth": F("num_hidden_layers", 12),
            "encoder.block.heads": count("num_attention_heads", 12),
            "encoder.block.norm.eps": F("layer_norm_eps", 1e-5),
            "encoder.block.mlp.hidden": F("intermediate_size", 3072),
            "encoder.block.mlp.activation": F("hidden_act", "quick_gelu", map=ACTIVATIONS),
            "encoder.dropout.attention": F("attention_dropout", 0.0),
        },
        inert=("initializer_factor",),
        names={
            "encoder.patch_embed.proj": "embeddings.patch_embedding",
            "encoder.prefix.cls_token": Renamed("embeddings.class_embedding", _token),
            "encoder.pos_embed.weight": Renamed("embeddings.position_embedding.weight", batched),
            "encoder.embed_norm": "pre_layrnorm",
            **BLOCKS,
            "head.norm": "post_layernorm",
        },
        classes={
            "Model": Head(_POOLED),
            "ModelWithProjection": Head(
                {
                    **{f"head.{k}": v for k, v in _POOLED["head"].items()},
                    "head.classes": count("projection_dim", 512),
                    "head.bias": False,
                },
                {"head.fc": "visual_projection"},
            ),
        },
        default="Model",
        pooled=pooled(pool="cls", norm=True),  # CLIPVisionModel's two outputs
        ignore=(
            r"(?:vision_model\.)?embeddings\.position_ids",
            r"text_model\..*",
            r"text_projection\..*",
            r"logit_scale",
        ),
        backbone="vision_model.",
    )
)


CHINESE_CLIP_VISION = register(
    CLIP_VISION.but(
        "ChineseCLIPVision",
        ("chinese_clip_vision_model",),
        drop=("ModelWithProjection",),  # no such class: the full ChineseCLIPModel projects its tower
        inert=("projection_dim",),  # read by the full model's visual_projection only
    )
)
"""Chinese-CLIP's image tower: CLIP's, under its own class name."""


def _siglip_head(c: Config, spec: Mapping[str, Any]) -> Any:
    """SiglipVisionModel's ``pooler_output``: the attention-pooling head's (none without the head)."""
    if not c.get("vision_use_head", True):
        return "none"
    return {"kind": "classifier", "pool": "attention", "classes": None}


def _siglip_pooled(c: Config, spec: Mapping[str, Any]) -> Any:
    """SiglipVisionModel's outputs: its tokens beside the attention-pooling head's ``pooler_output``."""
    head = _siglip_head(c, spec)
    return head if head == "none" else head | {"tokens": True}


def _write_siglip_head(head: Mapping[str, Any], get: Callable[[str], Any]) -> dict[str, Any]:
    return {"vision_use_head": head["kind"] != "none"}


SIGLIP_VISION = register(
    replace(
        CLIP_VISION.but(
            "SiglipVision",
            ("siglip_vision_model",),
            {
                "encoder.input.patch": F("patch_size", 16),
                "encoder.embed_norm": False,
                "encoder.final_norm": True,  # post_layernorm, on every token
                "encoder.block.norm.eps": F("layer_norm_eps", 1e-6),
                "encoder.block.mlp.activation": F("hidden_act", "gelu_pytorch_tanh", map=ACTIVATIONS),
            },
            drop=("encoder.input.bias", "encoder.prefix.cls"),  # a patch bias, no class token
            names={
                "encoder.norm": "post_layernorm",
                "head.pool.latent.weight": Renamed("head.probe", unbatched),
                "head.pool.attn.q.weight": Renamed("head.attention.in_proj_weight", _queries),
                "head.pool.attn.q.bias": Renamed("head.attention.in_proj_bias", _queries),
                "head.pool.attn.kv.weight": Renamed("head.attention.in_proj_weight", _keys_values),
                "head.pool.attn.kv.bias": Renamed("head.attention.in_proj_bias", _keys_values),
                "head.pool.attn.proj": "head.attention.out_proj",
                "head.pool.norm": "head.layernorm",
                "head.pool.mlp.fc1": "head.mlp.fc1",
                "head.pool.mlp.fc2": "head.mlp.fc2",
            },
            keys=r"(?:vision_model\.)?embeddings\.patch_embedding\.bias",
        ),
        classes={
            "Model": Head({"head": D(_siglip_head, ("vision_use_head",), _write_siglip_head)})
        },  # CLIP's classes replaced
        pooled=Head({"head": D(_siglip_pooled, ("vision_use_head",), _write_siglip_head)}),
    )
)


_CLIP = frozenset({"text_config", "vision_config", "projection_dim", "logit_scale_init_value"})
"""The fields of a full CLIP config beside its towers' (``initializer_factor`` is inert)."""


def _clip(c: Config) -> dict[str, Any]:
    """A full ``clip`` config (``CLIPModel``): its text tower with the projection to ``projection_dim``."""
    for key in c.values:
        if key not in _CLIP | COMMON | {"initializer_factor"}:
            raise c.refuse(
                key,
                c.values[key],
                "specvit's CLIP table does not read this field, so cannot say the model it builds computes "
                "what this config describes",
                "leave the field out if it is unset, or ask for the field to be mapped",
            )
    named = c.get("architectures", kind=list)
    if named not in (None, ["CLIPModel"]):
        raise c.refuse("architectures", named, "specvit reads a CLIPModel's text tower", "use CLIPModel")
    text = c.sub("text_config")
    projection = c.size("projection_dim", 512)  # the model's, over the tower config's own
    text.values = text.values | {
        "projection_dim": projection,
        "architectures": ["CLIPTextModelWithProjection"],
    }
    return CLIP_TEXT.read(text)


family(Family("CLIPModel", ("clip",), r"(?!)", _clip, CLIP_TEXT.layout))
"""A full CLIP config; its state dict is converted by the towers' tables (keys matching none here)."""
