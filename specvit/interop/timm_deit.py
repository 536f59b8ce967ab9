"""timm's ``VisionTransformerDistilled`` (DeiT with its distillation token, Touvron et al. 2021).

A ``VisionTransformer`` with a learned distillation token after the class token (``prefix:
{distillation: true}``), learned positions over both and the patches, and two classifiers, ``head`` on the
class token and ``head_dist`` on the distillation token (``head: {kind: distilled}``): the output is their
average, or, in training with ``distilled_training`` set, both logits. timm's flag is a run-time mode, not
part of the architecture: set it on the specvit model as ``model.head.merge.distilled_training = True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Layout, one
from specvit.interop.timm import Reader, TimmFamily, timm_family
from specvit.interop.timm_vit import vit_layout, vit_spec
from specvit.spec.schema import Spec

__all__ = ["deit_layout"]


def _deit(r: Reader) -> dict[str, Any]:
    m = r.model
    # timm's distilled model puts the class and distillation tokens in front by itself, with positions over
    # both: register tokens, positions over the patches only and a missing class token it does not handle.
    r.only("num_reg_tokens", [0], "VisionTransformerDistilled's forward leaves register tokens out")
    r.only("no_embed_class", [False], "VisionTransformerDistilled's positions cover its two tokens")
    r.only("global_pool", ["token"], "the distilled head reads the class and distillation tokens")
    r.absent("fc_norm", "VisionTransformerDistilled's head does not apply fc_norm")
    if m.cls_token is None:
        raise r.refuse("cls_token", None, "the distilled head reads the class token", "class_token=True")
    if m.num_classes == 0:
        raise r.refuse("num_classes", 0, "the distilled head's features have no spec", "give it classes")
    spec = vit_spec(r)
    spec["name"] = "timm_deit_distilled"
    spec["description"] = "timm VisionTransformerDistilled, imported by specvit.from_timm."
    spec["encoder"]["prefix"] = {"cls": True, "distillation": True}
    head = spec["head"]
    if (r.at("head_dist").bias is not None) != head["bias"]:
        raise r.refuse(
            "head_dist.bias", "one of two", "specvit's two classifiers both have a bias or not", ""
        )
    spec["head"] = {
        "kind": "distilled",
        "classes": m.num_classes,
        "bias": head["bias"],
        "dropout": head["dropout"],
    }
    return spec


def deit_layout(spec: Spec, keys: Sequence[str]) -> Layout:
    """timm ``VisionTransformerDistilled`` keys: ``VisionTransformer``'s, ``dist_token`` and ``head_dist``."""
    layout = vit_layout(spec, keys)
    layout.name = "timm VisionTransformerDistilled"
    layout.table["encoder.prefix.dist_token"] = one("dist_token")
    layout.table["head.fc_dist.{p}"] = one("head_dist.{p}")
    return layout


timm_family(
    TimmFamily(
        classes=("VisionTransformerDistilled",),
        modules=frozenset(
            {"PatchEmbed", "Block", "Attention", "Mlp", "SwiGLU", "GluMlp", "LayerScale", "RmsNorm"}
            | {"GELU", "GELUTanh", "QuickGELU", "SiLU", "ReLU"}
        ),
        keys=r"dist_token\Z",
        spec=_deit,
        layout=deit_layout,
    )
)
