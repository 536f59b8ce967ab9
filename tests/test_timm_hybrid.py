"""timm's hybrid ViTs (``HybridEmbed``): a CNN backbone read as the image input's ``stem:``, TensorFlow's
"same" padding as ``pad`` layers before the windows. References are built by timm with seeded random weights
moved off their init (nothing is downloaded); fp32, max abs diff <= 1e-5, strict loads, equal parameters.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from reference import converted, perturbed, timm_model, timm_parity

import specvit
from specvit.errors import SpecError

SMALL = {"depth": 2, "num_classes": 5}


def _convstem_vit() -> torch.nn.Module:
    """A ViT over timm's ``ConvStem`` (convs, batch norms in eval, ReLU), built as timm's own hybrids are."""
    import timm.layers.hybrid_embed
    from timm.models.vision_transformer import VisionTransformer
    from timm.models.vision_transformer_hybrid import ConvStem

    torch.manual_seed(0)
    stem = ConvStem(in_chans=3, depth=3, channels=(8, 16, 24), kernel_size=3, stride=(2, 2, 1))
    embed = partial(timm.layers.hybrid_embed.HybridEmbed, backbone=stem)
    ref = VisionTransformer(
        img_size=32, patch_size=2, embed_dim=48, depth=2, num_heads=4, num_classes=5, embed_layer=embed
    )
    return perturbed(ref, 0).eval()


CASES: dict[str, Any] = {
    "ResNetV2 stem, TF-same padding": lambda: timm_model("vit_tiny_r_s16_p8_224", seed=1, **SMALL),
    "rectangle": lambda: timm_model("vit_tiny_r_s16_p8_224", seed=2, img_size=(64, 96), **SMALL),
    "ConvStem with batch norms": _convstem_vit,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_timm_hybrid_vit_is_read_exactly(case: str) -> None:
    ref = CASES[case]().eval()
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    assert model.spec.encoder.input.stem


def test_same_padding_pads_the_far_side_more() -> None:
    """The stem of ``vit_tiny_r_s16_p8_224``: a 7x7 stride-2 conv pads 2 before and 3 after a 224 side, the
    max pool 0 and 1; the control pads the near side more and misses timm's outputs."""
    ref = CASES["ResNetV2 stem, TF-same padding"]().eval()
    spec = specvit.from_timm(ref).model_dump(mode="json", exclude_none=True)
    stem = spec["encoder"]["input"]["stem"]
    assert stem[0] == {"kind": "pad", "sides": [2, 3, 2, 3], "fill": "zero"}
    assert stem[4] == {"kind": "pad", "sides": [0, 1, 0, 1], "fill": "lowest"}
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    model = converted(ref, specvit.parse_spec(spec), "timm")
    with torch.no_grad():
        assert (model(images) - ref(images)).abs().max().item() <= 1e-5
        stem[0]["sides"] = [3, 2, 3, 2]  # the control
        model = converted(ref, specvit.parse_spec(spec), "timm")
        assert (model(images) - ref(images)).abs().max().item() > 1e-4


def test_residual_backbones_are_refused_by_their_class() -> None:
    ref = timm_model("vit_small_r26_s32_224", seed=0, depth=1, num_classes=5)
    with pytest.raises(SpecError) as err:
        specvit.from_timm(ref)
    assert "model.patch_embed.backbone: VisionTransformer has patch_embed.backbone: ResNetV2" in str(
        err.value
    )


def _padded(stem: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "specvit": 1,
        "name": "padded",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "image", "size": 15, "patch": 2, "stem": stem},
            "position": "none",
            "width": 16,
            "depth": 1,
            "block": {"heads": 2},
        },
        "head": {"kind": "classifier", "classes": 3, "pool": "mean"},
    }


def test_a_pad_layer_adds_its_sides_to_the_map() -> None:
    stem = [
        {"kind": "pad", "sides": [0, 1, 2, 3], "fill": "lowest"},
        {"kind": "pool", "type": "max", "kernel": 2},
    ]
    graph = specvit.build_graph(_padded(stem))
    assert graph.op("encoder.stem.0").label(graph["encoder.stem.0"]["p"]) == ("pad [0, 1, 2, 3] · -inf",)
    model = specvit.build_model(_padded(stem)).eval()
    x = torch.randn(1, 3, 15, 15)
    padded = model.encoder.stem[0](x)  # type: ignore[index]
    assert padded.shape == (1, 3, 20, 16)  # top 2 and bottom 3 rows, 1 column on the right
    assert torch.equal(padded[:, :, 2:17, :15], x) and torch.isneginf(padded[:, :, :2]).all()


def test_a_pad_layer_names_its_sides() -> None:
    with pytest.raises(SpecError) as err:
        specvit.parse_spec(_padded([{"kind": "pad", "sides": [1, 1]}]))
    assert "encoder.input.stem.0.sides: a 2D map pads 4 sides" in str(err.value)
    assert "write [left, right, top, bottom]" in str(err.value)
