"""Swin Transformer V2 (Liu et al. 2022): specvit.from_timm of timm's SwinTransformerV2, exact against timm,
the presets equal to what the importer reads, the V2 options drawn, and what specvit cannot state refused.

References are built by timm from kwargs with seeded random weights moved off their init (nothing is
downloaded); fp32 max abs diff <= 1e-5, float64 within 1e-10.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from reference import converted, timm_model, timm_parity

import specvit
from specvit.errors import SpecError
from specvit.graph import build_graph
from specvit.nn.window import cpb_coords

CASES: dict[str, dict[str, Any]] = {
    # four stages, the last one's 4x4 grid smaller than the 8x8 window (one window, never shifted)
    "tiny_four_stages": {
        "img_size": 128,
        "embed_dim": 16,
        "depths": (2, 2, 2, 1),
        "num_heads": (1, 2, 4, 8),
        "num_classes": 10,
    },
    # a rectangular image, window 4, no q/v biases, odd depth
    "rect_window4_no_bias": {
        "img_size": (64, 96),
        "window_size": 4,
        "embed_dim": 24,
        "depths": (2, 3),
        "num_heads": (2, 3),
        "qkv_bias": False,
        "num_classes": 5,
    },
    # pretrained window sizes (the bias MLP's coordinates normalised by 12, 6, 4), stochastic depth
    "pretrained_windows_drop_path": {
        "img_size": 64,
        "embed_dim": 16,
        "depths": (1, 2, 2),
        "num_heads": (1, 2, 4),
        "pretrained_window_sizes": (12, 6, 4),
        "drop_path_rate": 0.2,
        "mlp_ratio": 2.0,
        "num_classes": 3,
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_timm_swinv2_is_read_exactly(case: str) -> None:
    ref = timm_model("swinv2_tiny_window8_256", seed=1, **CASES[case])
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())


def test_timm_swinv2_is_exact_in_float64() -> None:
    ref = timm_model("swinv2_tiny_window8_256", seed=3, **CASES["pretrained_windows_drop_path"]).double()
    model, _ = timm_parity(ref.float())
    ref, model = ref.double(), model.double()
    images = torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (model(images) - ref(images)).abs().max().item()
    assert diff <= 1e-10, diff


def test_the_importer_reads_the_v2_fields() -> None:
    spec = specvit.from_timm(
        timm_model("swinv2_tiny_window8_256", seed=0, **CASES["pretrained_windows_drop_path"])
    )
    enc = spec.encoder
    assert enc is not None and enc.merge_norm == "post" and enc.drop_path == pytest.approx(0.2)
    window = enc.block.window
    assert window is not None
    assert (window.size, window.bias, window.cosine, window.cpb_hidden) == (8, "cpb", True, 512)
    assert window.pretrained == [12, 6, 4]
    assert enc.block.qkv_bias == [True, False, True] and enc.block.norm.placement == "res_post"
    assert enc.block.mlp.hidden == 32


def test_cpb_coordinates_equal_timms() -> None:
    from timm.models.swin_transformer_v2 import WindowAttention

    for window, pretrained in ((8, 0), (4, 12), (1, 0), (7, 7)):
        attn = WindowAttention(8, (window, window), 2, pretrained_window_size=(pretrained, pretrained))
        theirs = attn.relative_coords_table.reshape(-1, 2)
        assert torch.equal(cpb_coords(window, pretrained), theirs), (window, pretrained)


# ---------------------------------------------------------------------------------- presets

PRESETS = ("swinv2_tiny_window8_256", "swinv2_tiny_window16_256")


@pytest.mark.parametrize("name", PRESETS)
def test_preset_parameter_count_equals_timms(name: str) -> None:
    import timm

    with torch.device("meta"):
        ref = timm.create_model(name, pretrained=False)
    expected = sum(p.numel() for p in ref.parameters())
    assert expected == 28_347_154  # the number written in the preset
    assert specvit.build_graph(name).total_params == expected


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_what_the_importer_reads(name: str) -> None:
    """from_timm(the preset's timm model, made shallower) == the preset with the same overrides, and timm's
    weights give timm's outputs in it (float64: at full width fp32 rounding alone is near 1e-5)."""
    ref = timm_model(name, seed=5, depths=(2, 2, 2, 2), num_classes=10, drop_path_rate=0.0)
    imported = specvit.from_timm(ref)
    preset = specvit.load_spec(name, overrides={"encoder.depth": [2, 2, 2, 2], "head.classes": 10})
    skip = {"name", "description"}
    assert imported.model_dump(exclude=skip) == preset.model_dump(exclude=skip)
    model = converted(ref, preset, "timm").double()
    images = torch.randn(1, 3, 256, 256, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        assert (model(images) - ref.double()(images)).abs().max() <= 1e-10


def test_window16_preset_shrinks_the_last_stage_to_its_grid() -> None:
    """At 256 px the last stage's 8x8 grid is one 8x8 window, never shifted, coordinates / 7 (as timm)."""
    graph = build_graph(specvit.load_spec("swinv2_tiny_window16_256"))
    first, last = (
        graph["encoder.stages.0.blocks.1.attn"]["p"],
        graph["encoder.stages.3.blocks.1.attn"]["p"],
    )
    assert (first.window, first.shift, last.window, last.shift) == (16, 8, 8, 0)
    assert "coords / 7" in " ".join(graph.op("encoder.stages.3.blocks.1.attn").label(last))


# ---------------------------------------------------------------------------------- drawn


def test_the_v2_attention_and_res_post_norm_are_drawn() -> None:
    graph = build_graph(specvit.load_spec("swinv2_tiny_window8_256"))
    dot = specvit.to_dot(graph, view="expanded")
    assert "8x8 windows · shifted by 4" in dot and "8x8 windows · not shifted" in dot
    assert "cosine attention · logit scale ≤ 100" in dot
    assert "CPB MLP 2→512→3 · 16·sigmoid · coords / 7" in dot and "CPB MLP 2→512→24" in dot
    assert "bias qv" in dot
    edges = {(u, v) for u, v, _ in graph.nx.edges}
    b = "encoder.stages.1.blocks.0"
    # res-post-norm: the attention reads the block input, its norm follows it, the add reads the norm
    assert {
        ("encoder.stages.1.downsample.norm", f"{b}.attn"),
        (f"{b}.attn", f"{b}.norm1"),
        (f"{b}.norm1", f"{b}.add1"),
        (f"{b}.add1", f"{b}.mlp"),
        (f"{b}.mlp", f"{b}.norm2"),
    } <= edges
    # V2's patch merging: the linear 4C -> 2C, then the norm over 2C
    merge = "encoder.stages.1.downsample"
    assert {(f"{merge}.merge", f"{merge}.reduction"), (f"{merge}.reduction", f"{merge}.norm")} <= edges
    assert graph[f"{merge}.norm"]["shape"][-1] == 192


# ---------------------------------------------------------------------------------- refusals

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    # an 8x16 grid with window 8: timm shifts the long side only, specvit's square window never shifts
    "a grid smaller than the window on one side": (
        {"img_size": (32, 64), "embed_dim": 16, "depths": (2,), "num_heads": (1,)},
        "model.layers.0.blocks.1.window_size",
    ),
    "non-square pretrained windows": (
        {
            "img_size": 64,
            "embed_dim": 16,
            "depths": (1, 1),
            "num_heads": (1, 2),
            "pretrained_window_sizes": ((12, 8), 0),
        },
        "model.layers.0.blocks.0.attn.pretrained_window_size",
    ),
    "per-stage windows": (
        {"img_size": 64, "embed_dim": 16, "depths": (1, 1), "num_heads": (1, 2), "window_size": (8, 4)},
        "model.window_size",
    ),
    "max pooling": (
        {"img_size": 64, "embed_dim": 16, "depths": (1, 1), "num_heads": (1, 2), "global_pool": "max"},
        "model.head.global_pool.pool: SwinTransformerV2 has head.global_pool.pool: FastAdaptiveMaxPool",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_specvit_cannot_state_is_refused_by_name(case: str) -> None:
    kwargs, message = REFUSED[case]
    ref = timm_model("swinv2_tiny_window8_256", seed=0, **kwargs)
    with pytest.raises(SpecError) as err:
        specvit.from_timm(ref)
    assert message in str(err.value)


def test_swin_v1_with_a_grid_smaller_than_the_window_on_one_side_is_refused_too() -> None:
    """timm's V1 shifts the long side of an 8x16 grid by 4 with window 8; specvit's square window would not."""
    kwargs = {"img_size": (32, 64), "window_size": 8, "embed_dim": 16, "depths": (2,), "num_heads": (1,)}
    ref = timm_model("swin_tiny_patch4_window7_224", seed=0, **kwargs)
    with pytest.raises(SpecError) as err:
        specvit.from_timm(ref)
    assert "model.layers.0.blocks.1.window_size" in str(err.value) and "shifted by 0" in str(err.value)


def _v2(**window: Any) -> dict[str, Any]:
    return {"encoder.block.window": {"size": 8, "shift": True, **window}}


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (_v2(pretrained=12), "encoder.block.window.pretrained", "set bias: cpb"),
        (_v2(cpb_hidden=64), "encoder.block.window.cpb_hidden", "set bias: cpb"),
        (_v2(bias="cpb", pretrained=[12, 12]), "encoder.block.window.pretrained", "one per stage (4)"),
        (
            {**_v2(cosine=True), "encoder.block.attention_scale": 0.5},
            "encoder.block.attention_scale",
            "remove",
        ),
        (_v2(cosine=True, bias=False, shift=False), "encoder.block.window.cosine", "set cosine: false"),
    ],
)
def test_bad_v2_window_fields_are_named_with_their_fix(overrides: dict[str, Any], key: str, fix: str) -> None:
    with pytest.raises(SpecError) as err:
        specvit.load_spec("swinv2_tiny_window8_256", overrides=overrides)
    assert key in str(err.value) and fix in str(err.value)


def test_merge_norm_needs_stages() -> None:
    with pytest.raises(SpecError) as err:
        specvit.load_spec("vit_tiny_patch16_224", overrides={"encoder.merge_norm": "post"})
    assert "encoder.merge_norm" in str(err.value) and "depth per stage" in str(err.value)


def test_cosine_attention_uses_the_clamped_logit_scale() -> None:
    """A logit scale above log 100 acts as log 100: the attention equals one with the scale set to it."""
    from specvit.nn.window import WindowAttention

    torch.manual_seed(0)
    attn = WindowAttention(8, 2, (4, 4), 4, cosine=True, cpb_hidden=16, qkv_bias=(True, False, True)).double()
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    with torch.no_grad():
        attn.logit_scale.fill_(7.0)
        high = attn(x)
        attn.logit_scale.fill_(math.log(100.0))
        assert torch.allclose(high, attn(x), atol=1e-12, rtol=0)
        attn.logit_scale.fill_(1.0)
        assert not torch.allclose(high, attn(x), atol=1e-3)
