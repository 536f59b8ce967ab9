"""specvit.from_timm: the spec of a timm model instance, its weights converted, its outputs equal timm's.

Every reference is built by timm from kwargs with seeded random weights moved off their init (nothing is
downloaded), at several sizes; fp32, eval, max abs diff <= 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from reference import converted, timm_model, timm_parity
from timm.layers import SwiGLU

import specvit
from specvit.errors import SpecError

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
    "vit_siglip_map_pool": (
        "vit_tiny_patch16_224",
        {
            "depth": 2,
            "img_size": 48,
            "class_token": False,
            "global_pool": "map",
            "act_layer": "gelu_tanh",
            "num_classes": 6,
        },
    ),
    "vit_pooled_features_no_classifier": (
        "vit_small_patch16_224",
        {"depth": 2, "img_size": 48, "global_pool": "avg", "fc_norm": True, "num_classes": 0},
    ),
    "vit_siglip_map_pool_features": (
        "vit_tiny_patch16_224",
        {"depth": 1, "img_size": 32, "class_token": False, "global_pool": "map", "num_classes": 0},
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


POOLED_FEATURES: dict[str, tuple[str, dict[str, Any]]] = {
    "eva": ("eva02_tiny_patch14_224", {"depth": 1, "img_size": 28}),
    "cait": ("cait_xxs24_224", {"depth": 1, "depth_token_only": 1, "img_size": 32}),
    "beit": ("beit_base_patch16_224", {"depth": 1, "img_size": 32, "embed_dim": 32, "num_heads": 2}),
    "swin": ("swin_tiny_patch4_window7_224", {"embed_dim": 16, "depths": (1, 1), "num_heads": (1, 2)}),
    "swinv2": (
        "swinv2_tiny_window8_256",
        {"img_size": 64, "embed_dim": 16, "depths": (1, 1), "num_heads": (1, 2)},
    ),
}


@pytest.mark.parametrize("family", sorted(POOLED_FEATURES))
def test_every_family_reads_its_pooled_features(family: str) -> None:
    """``num_classes=0``: timm returns the pooled (and normed) features; the spec's classifier has
    ``classes: null``, and the outputs are equal."""
    name, kwargs = POOLED_FEATURES[family]
    ref = timm_model(name, seed=2, num_classes=0, **kwargs)
    model, diff = timm_parity(ref)
    assert model.spec.head.classes is None  # type: ignore[union-attr]
    assert diff <= 1e-5, diff


REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "another model class": ("resnet18", {}, "model: specvit has no family for timm's ResNet"),
    "max pooling": ("vit_tiny_patch16_224", {"depth": 1, "global_pool": "max"}, "model.global_pool"),
    "dynamic image size": (
        "vit_tiny_patch16_224",
        {"depth": 1, "dynamic_img_size": True},
        "dynamic_img_size",
    ),
    "post-norm block class": (
        "vit_tiny_patch16_224",
        {"depth": 1, "block_fn": "ResPostBlock"},
        "model.blocks.0: VisionTransformer has blocks.0: ResPostBlock, a module specvit does not read",
    ),
    "an activation specvit lacks": (
        "vit_tiny_patch16_224",
        {"depth": 1, "act_layer": "hard_swish"},
        "Hardswish",
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


@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("latent_len", 2, "model.attn_pool.latent_len: VisionTransformer has attn_pool.latent_len=2"),
        ("pool", "avg", "model.attn_pool.pool: VisionTransformer has attn_pool.pool='avg'"),
    ],
)
def test_an_attention_pool_beyond_one_probe_is_refused(attribute: str, value: Any, message: str) -> None:
    ref = timm_model("vit_tiny_patch16_224", seed=0, depth=1, class_token=False, global_pool="map")
    assert specvit.from_timm(ref).head.pool == "attention"
    setattr(ref.attn_pool, attribute, value)
    with pytest.raises(SpecError, match=message):
        specvit.from_timm(ref)


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


PRESETS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # preset: (timm model, its kwargs at test size, the same change as overrides of the preset)
    **{
        f"vit_{size}_patch{p}_224": (
            f"vit_{size}_patch{p}_224",
            {"depth": 1, "num_classes": 1000},
            {"encoder.depth": 1},
        )
        for size, p in (("tiny", 16), ("small", 16), ("base", 16), ("large", 16), ("huge", 14))
    },
    "deit_small_patch16_224": ("deit_small_patch16_224", {"depth": 1}, {"encoder.depth": 1}),
    **{
        f"swin_{size}_patch4_window7_224": (
            f"swin_{size}_patch4_window7_224",
            {"depths": (2, 2, 2, 2)},
            {"encoder.depth": [2, 2, 2, 2]},
        )
        for size in ("tiny", "small", "base")
    },
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_are_timm_models(preset: str) -> None:
    """Each timm preset has timm's parameter count at full size, and timm's weights at test size (full width,
    fewer blocks) load into it strictly and give timm's outputs. In float64: at these widths fp32 rounding
    alone reaches 3e-5 on logits near 5 (Swin-B), which would hide nothing and prove little."""
    name, kwargs, overrides = PRESETS[preset]
    with torch.device("meta"):
        full = timm.create_model(name, pretrained=False, num_classes=1000)  # vit_huge defaults to none
    assert specvit.build_graph(preset).total_params == sum(p.numel() for p in full.parameters())
    ref = timm_model(name, seed=5, **kwargs)
    model = converted(ref, specvit.load_spec(preset, overrides=overrides), "timm").double()
    images = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        assert (model(images) - ref.double()(images)).abs().max() <= 1e-10


def test_keys_two_families_share_convert_through_the_one_that_places_them_all() -> None:
    """BEiT and EVA-02 state dicts both have q_bias and gamma_1: each converts by the layout that maps
    every key, whichever family the keys match first."""
    for name, kwargs in (
        ("beit_base_patch16_224", {"use_abs_pos_emb": True, "use_rel_pos_bias": False}),
        ("eva02_tiny_patch14_224", {"init_values": 1e-3, "use_rot_pos_emb": False, "scale_mlp": False}),
    ):
        ref = timm_model(
            name,
            seed=6,
            depth=1,
            img_size=32,
            patch_size=8,
            embed_dim=32,
            num_heads=2,
            num_classes=5,
            **kwargs,
        )
        _, diff = timm_parity(ref)
        assert diff <= 1e-5, (name, diff)
