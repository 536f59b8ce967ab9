"""specvit.from_timm: the spec of a timm model instance, its weights converted, its outputs equal timm's.

Every reference is built by timm from kwargs with seeded random weights moved off their init (nothing is
downloaded), at several sizes; fp32, eval, max abs diff <= 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from timm.layers import SwiGLU

import specvit
from specvit.errors import SpecError
from tests.reference import timm_model, timm_parity

VIT: dict[str, tuple[str, dict[str, Any]]] = {
    "vit_tiny": ("vit_tiny_patch16_224", {"depth": 2, "img_size": 64, "num_classes": 10}),
    "vit_registers_avg_qknorm_layerscale": (
        "vit_small_patch16_224",
        {
            "depth": 2,
            "img_size": 48,
            "reg_tokens": 4,
            "class_token": False,
            "no_embed_class": True,
            "global_pool": "avg",
            "qk_norm": True,
            "init_values": 1e-5,
            "fc_norm": True,
            "num_classes": 7,
        },
    ),
    "vit_rect_no_bias_swiglu": (
        "vit_tiny_patch16_224",
        {
            "depth": 3,
            "img_size": (32, 48),
            "patch_size": 8,
            "qkv_bias": False,
            "mlp_layer": SwiGLU,
            "act_layer": "silu",
            "pre_norm": True,
            "num_classes": 5,
        },
    ),
    "swin_tiny": (
        "swin_tiny_patch4_window7_224",
        {"embed_dim": 16, "depths": (2, 2, 2, 1), "num_heads": (1, 2, 4, 8), "num_classes": 10},
    ),
    "swin_window4_rect": (
        "swin_tiny_patch4_window7_224",
        {"img_size": (64, 96), "window_size": 4, "embed_dim": 24, "depths": (2, 3), "num_heads": (2, 3)},
    ),
}


@pytest.mark.parametrize("case", sorted(VIT))
def test_timm_models_are_read_exactly(case: str) -> None:
    name, kwargs = VIT[case]
    ref = timm_model(name, seed=1, **kwargs)
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())


REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "another model class": ("resnet18", {}, "model: specvit has no family for timm's ResNet"),
    "attention pooling": ("vit_tiny_patch16_224", {"depth": 1, "global_pool": "map"}, "model.attn_pool"),
    "max pooling": ("vit_tiny_patch16_224", {"depth": 1, "global_pool": "max"}, "model.global_pool"),
    "dynamic image size": (
        "vit_tiny_patch16_224",
        {"depth": 1, "dynamic_img_size": True},
        "dynamic_img_size",
    ),
    "post-norm block class": (
        "vit_tiny_patch16_224",
        {"depth": 1, "block_fn": "ResPostBlock"},
        "model.blocks.0: VisionTransformer has a ResPostBlock",
    ),
    "an activation specvit lacks": (
        "vit_tiny_patch16_224",
        {"depth": 1, "act_layer": "hard_swish"},
        "Hardswish",
    ),
    "pooled features, no classifier": (
        "vit_tiny_patch16_224",
        {"depth": 1, "num_classes": 0},
        "model.num_classes",
    ),
    "a norm in the patch embedding": (
        "vit_tiny_patch16_224",
        {"depth": 1, "embed_norm_layer": "layernorm"},
        "model.patch_embed.norm",
    ),
    "Swin with per-stage windows": (
        "swin_tiny_patch4_window7_224",
        {"embed_dim": 16, "depths": (1, 1), "num_heads": (1, 2), "window_size": ((7, 7), (4, 4))},
        "model.window_size",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_specvit_cannot_state_is_refused_by_name(case: str) -> None:
    name, kwargs, message = REFUSED[case]
    if kwargs.get("block_fn") == "ResPostBlock":
        from timm.models.vision_transformer import ResPostBlock

        kwargs = {**kwargs, "block_fn": ResPostBlock}
    ref = timm_model(name, seed=0, **kwargs)
    with pytest.raises(SpecError) as err:
        specvit.from_timm(ref)
    assert message in str(err.value)


def test_a_state_dict_converts_by_its_keys() -> None:
    """convert_state_dict(..., "timm", spec) picks the family from the keys; a wrong spec is named."""
    ref = timm_model("swin_tiny_patch4_window7_224", seed=2, embed_dim=16, depths=(1, 1), num_heads=(1, 2))
    spec = specvit.from_timm(ref)
    state = specvit.convert_state_dict(ref.state_dict(), "timm", spec)
    assert "encoder.stages.1.downsample.reduction.weight" in state
    vit = specvit.from_timm(timm_model("vit_tiny_patch16_224", seed=2, depth=1))
    with pytest.raises(ValueError, match="cannot convert a timm SwinTransformer state dict"):
        specvit.convert_state_dict(ref.state_dict(), "timm", vit)
    torch.testing.assert_close(state["head.fc.weight"], ref.state_dict()["head.fc.weight"])
