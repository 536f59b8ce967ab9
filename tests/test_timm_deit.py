"""DeiT with its distillation token (Touvron et al. 2021) against timm's ``VisionTransformerDistilled``.

References are built by timm from kwargs with seeded random weights moved off their init (nothing is
downloaded); fp32, max abs diff <= 1e-5, strict state-dict loads, equal parameter counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from reference import converted, timm_model, timm_parity

import specvit
from specvit.diagram import to_dot
from specvit.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "base design, small": (
        "deit_base_distilled_patch16_224",
        {"depth": 2, "img_size": 64, "embed_dim": 48, "num_heads": 3, "num_classes": 10},
    ),
    "rectangle, no qkv bias, layer scale, head dropout": (
        "deit_tiny_distilled_patch16_224",
        {
            "depth": 2,
            "img_size": (32, 48),
            "patch_size": 8,
            "num_classes": 5,
            "qkv_bias": False,
            "init_values": 1e-3,
            "drop_rate": 0.1,
        },
    ),
    "QK-norm, no classifier bias": (
        "deit_small_distilled_patch16_224",
        {
            "depth": 3,
            "img_size": 32,
            "patch_size": 8,
            "embed_dim": 48,
            "num_heads": 2,
            "qk_norm": True,
            "num_classes": 3,
        },
    ),
}


def _images(model: specvit.SpecModel, seed: int = 0) -> torch.Tensor:
    size = model.spec.stacks["encoder"].input.size
    hw = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    return torch.randn(2, 3, *hw, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_timm_distilled_deit_is_read_exactly(case: str) -> None:
    name, kwargs = CASES[case]
    ref = timm_model(name, seed=5, **kwargs)
    if case == "QK-norm, no classifier bias":
        ref.head.bias = ref.head_dist.bias = None
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    assert model.spec.head.kind == "distilled" and model.spec.encoder.prefix.distillation


def test_distilled_training_returns_both_logits_as_timm() -> None:
    """Training with distilled_training set: (class logits, distillation logits); eval: their average."""
    name, kwargs = CASES["base design, small"]
    ref = timm_model(name, seed=6, **kwargs)
    model, _ = timm_parity(ref)
    images = _images(model, 1)
    ref.train().set_distilled_training(True)
    model.train()
    with torch.no_grad():
        assert isinstance(model(images), torch.Tensor)  # the flag is off by default, as timm's
        model.head.merge.distilled_training = True
        ours, theirs = model(images), ref(images)
    assert isinstance(ours, tuple) and len(ours) == 2
    for a, b in zip(ours, theirs, strict=True):
        assert (a - b).abs().max().item() <= 1e-5
    assert not torch.allclose(ours[0], ours[1])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(images), (ours[0] + ours[1]) / 2, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("name", "count"),
    [("deit_base_distilled_patch16_224", 87_338_192), ("deit_tiny_distilled_patch16_224", 5_910_800)],
)
def test_presets_have_timms_parameter_count(name: str, count: int) -> None:
    import timm

    with torch.device("meta"):
        ref = timm.create_model(name, pretrained=False)
    graph = specvit.build_graph(specvit.load_spec(ROOT / "specs" / f"{name}.yaml"))
    assert graph.total_params == sum(p.numel() for p in ref.parameters()) == count


@pytest.mark.parametrize("name", ["deit_base_distilled_patch16_224", "deit_tiny_distilled_patch16_224"])
def test_preset_is_what_from_timm_reads(name: str) -> None:
    """The preset at a small size and timm's model at that size: the same graph, the same outputs."""
    ref = timm_model(name, seed=7, depth=2, img_size=48, num_classes=7)
    over = {"encoder.depth": 2, "encoder.input.size": 48, "head.classes": 7}
    preset = specvit.load_spec(ROOT / "specs" / f"{name}.yaml", overrides=over)
    ours, theirs = specvit.build_graph(preset), specvit.build_graph(specvit.from_timm(ref))
    assert [(n, d["op"], d["p"]) for n, d in ours.nx.nodes(data=True)] == [
        (n, d["op"], d["p"]) for n, d in theirs.nx.nodes(data=True)
    ]
    model = converted(ref, preset, "timm")
    images = _images(model)
    with torch.no_grad():
        assert (model(images) - ref(images)).abs().max().item() <= 1e-5


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "register tokens": ({"reg_tokens": 2}, "model.num_reg_tokens"),
    "positions over the patches only": ({"no_embed_class": True}, "model.no_embed_class"),
    "a norm after pooling": ({"fc_norm": True}, "model.fc_norm"),
    "features without classifiers": ({"num_classes": 0}, "model.num_classes"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_specvit_cannot_state_is_refused_by_name(case: str) -> None:
    kwargs, message = REFUSED[case]
    ref = timm_model("deit_tiny_distilled_patch16_224", seed=0, depth=1, img_size=32, **kwargs)
    with pytest.raises(SpecError) as err:
        specvit.from_timm(ref)
    assert message in str(err.value)


def test_a_distilled_head_needs_the_distillation_token() -> None:
    text = (ROOT / "specs" / "deit_base_distilled_patch16_224.yaml").read_text()
    with pytest.raises(SpecError) as err:
        specvit.parse_spec(text.replace("distillation: true", "distillation: false"), source="d.yaml")
    assert "head.kind: a distilled head reads the class token and the distillation token" in str(err.value)
    assert "set encoder.prefix: {cls: true, distillation: true}" in str(err.value)


def test_a_distillation_token_converts_by_its_key() -> None:
    ref = timm_model("deit_tiny_distilled_patch16_224", seed=8, depth=1, img_size=32, num_classes=4)
    state = specvit.convert_state_dict(ref.state_dict(), "timm", specvit.from_timm(ref))
    torch.testing.assert_close(state["encoder.prefix.dist_token"], ref.dist_token.detach())
    torch.testing.assert_close(state["head.fc_dist.weight"], ref.head_dist.weight.detach())


def test_diagram_shows_both_tokens_and_both_classifiers() -> None:
    graph = specvit.build_graph(specvit.load_spec(ROOT / "specs" / "deit_base_distilled_patch16_224.yaml"))
    dot = to_dot(graph)
    assert "cls + distillation<br/>" in dot and "B x 198 x 768" in dot  # 196 patches + 2 tokens
    assert "the class token (index 0)" in dot and "the distillation token (index 1)" in dot
    assert '"head.pool" -> "head.fc"' in dot and '"head.pool_dist" -> "head.fc_dist"' in dot
    assert '"head.fc" -> "head.merge"' in dot and '"head.fc_dist" -> "head.merge"' in dot
    assert "(cls + distillation) / 2" in dot and '"head.merge" -> output' in dot
    assert graph["head.fc_dist"]["params"] == 768 * 1000 + 1000


def test_prefix_order_is_class_distillation_registers() -> None:
    """timm's order: cat([cls, dist, x]); registers (a spec may have both) come after the two."""
    from specvit.nn.embed import PrefixTokens

    prefix = PrefixTokens(4, cls=True, registers=2, distillation=True)
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        out = prefix(x)
    assert prefix.num_prefix == 4 and out.shape == (2, 7, 4)
    assert prefix.cls_token is not None and prefix.dist_token is not None and prefix.reg_token is not None
    assert torch.equal(out[:, 0], prefix.cls_token[0].expand(2, -1))
    assert torch.equal(out[:, 1], prefix.dist_token[0].expand(2, -1))
    assert torch.equal(out[:, 2:4], prefix.reg_token.expand(2, -1, -1))
    assert torch.equal(out[:, 4:], x)


def test_beits_relative_bias_refuses_a_distillation_token() -> None:
    """BEiT's table has entries for one class token; a second prefix token has none."""
    text = (ROOT / "specs" / "beit_base_patch16_224.yaml").read_text()
    with pytest.raises(SpecError) as err:
        specvit.parse_spec(text.replace("{cls: true}", "{cls: true, distillation: true}"), source="b.yaml")
    assert (
        "relative2d biases the patch grid of a plain image stack with a class token, no other prefix"
        in str(err.value)
    )


@pytest.mark.parametrize("name", ["deit_base_distilled_patch16_224", "deit_tiny_distilled_patch16_224"])
def test_preset_at_full_width_is_timms_model_in_float64(name: str) -> None:
    """Full width, one block: timm's weights load strictly into the preset and give timm's outputs (fp64)."""
    ref = timm_model(name, seed=5, depth=1)
    preset = specvit.load_spec(ROOT / "specs" / f"{name}.yaml", overrides={"encoder.depth": 1})
    model = converted(ref, preset, "timm").double()
    images = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        assert (model(images) - ref.double()(images)).abs().max() <= 1e-10
