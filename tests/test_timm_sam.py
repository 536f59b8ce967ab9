"""ViTDet / SAM's image encoder: specvit.from_timm of timm's VisionTransformerSAM exact at several sizes, the
presets' parameter counts equal timm's, what cannot be stated refused by name, the windows, global blocks,
decomposed relative positions and neck drawn, and the spec rules of padded windows.

References are built by timm from kwargs with seeded random weights moved off their init (nothing is
downloaded); fp32, eval, max abs diff <= 1e-5.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import timm_model, timm_parity

import specvit
from specvit.diagram import to_dot
from specvit.errors import SpecError
from specvit.graph import build_graph
from specvit.nn.vitdet import GridAttention

ROOT = Path(__file__).resolve().parents[1]

SAM: dict[str, tuple[str, dict[str, Any]]] = {
    # an 8x8 grid in 3x3 windows: padded to 9x9; block 2 global; the map out
    "padded_windows_map": (
        "samvit_base_patch16",
        {"img_size": 64, "patch_size": 8, "embed_dim": 32, "depth": 3, "num_heads": 2, "window_size": 3}
        | {"global_attn_indexes": [2], "neck_chans": 16, "global_pool": ""},
    ),
    # a rectangular 6x10 grid in 4x4 windows (padded to 8x12), global blocks 1 and 3, the map averaged
    "rectangular_pooled": (
        "samvit_base_patch16",
        {"img_size": (48, 80), "patch_size": 8, "embed_dim": 24, "depth": 4, "num_heads": 3}
        | {"window_size": 4, "global_attn_indexes": [1, 3], "neck_chans": 8},
    ),
    # a 4x4 grid padded to one 14x14 window, no absolute positions, neck_chans=None (a LayerNorm2d),
    # a classifier, layer scale and a norm before the blocks (patch projection without bias)
    "classifier_layerscale_prenorm": (
        "samvit_base_patch16_224",
        {"img_size": 64, "embed_dim": 32, "depth": 2, "num_heads": 4, "num_classes": 5}
        | {"init_values": 0.1, "pre_norm": True},
    ),
    # windows without relative positions; global blocks at indexes no schedule states (overrides)
    "no_rel_pos_overrides": (
        "samvit_base_patch16",
        {"img_size": 40, "patch_size": 8, "embed_dim": 16, "depth": 3, "num_heads": 2, "window_size": 2}
        | {"use_rel_pos": False, "global_attn_indexes": [0, 2], "neck_chans": 8, "global_pool": ""},
    ),
}


@pytest.mark.parametrize("case", sorted(SAM))
def test_timm_sam_models_are_read_exactly(case: str) -> None:
    name, kwargs = SAM[case]
    ref = timm_model(name, seed=3, **kwargs)
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())


def test_how_the_global_blocks_are_written() -> None:
    """Periodic global blocks become a schedule (as the presets), others overrides."""
    spec = specvit.from_timm(
        timm_model(*SAM["rectangular_pooled"][:1], seed=0, **SAM["rectangular_pooled"][1])
    )
    enc = spec.encoder
    assert enc is not None and enc.schedule == [{"block": 1}, "global"]
    assert [b.window is None for b in enc.layer_blocks] == [False, True, False, True]
    name, kwargs = SAM["no_rel_pos_overrides"]
    enc = specvit.from_timm(timm_model(name, seed=0, **kwargs)).encoder
    assert enc is not None and enc.overrides[0].layers == [0, 2] and enc.schedule is None
    assert [b.window is None for b in enc.layer_blocks] == [True, False, True]
    assert [p.kind for p in enc.positions] == ["learned"]


PRESETS = {"samvit_base_patch16": 89_670_912, "samvit_large_patch16": 308_278_272}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_counts_equal_timms(name: str) -> None:
    import timm

    with torch.device("meta"):
        ref = timm.create_model(name, pretrained=False)
    count = sum(p.numel() for p in ref.parameters())
    assert count == PRESETS[name]
    graph = build_graph(specvit.load_spec(ROOT / "specs" / f"{name}.yaml"))
    assert sum(a["params"] for _, a in graph.nx.nodes(data=True)) == count


def test_the_preset_is_what_from_timm_reads() -> None:
    """The preset at a small size and timm's samvit_base_patch16 with the same kwargs are one spec."""
    small = {"input.size": 96, "width": 48, "depth": 6, "block.heads": 4, "block.window.size": 4}
    preset = specvit.load_spec(
        ROOT / "specs" / "samvit_base_patch16.yaml",
        overrides={f"encoder.{k}": v for k, v in small.items()} | {"head.channels": 32},
    )
    ref = timm_model(
        "samvit_base_patch16",
        seed=0,
        img_size=96,
        embed_dim=48,
        depth=6,
        num_heads=4,
        window_size=4,
        global_attn_indexes=[2, 5],
        neck_chans=32,
        global_pool="",
    )
    imported = specvit.from_timm(ref)
    assert preset.encoder is not None and imported.encoder is not None
    skip = {"name", "description"}
    assert imported.model_dump(exclude=skip) == preset.model_dump(exclude=skip)
    graph = build_graph(preset)
    assert sum(a["params"] for _, a in graph.nx.nodes(data=True)) == sum(p.numel() for p in ref.parameters())


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "rotary positions": ({"use_rope": True, "use_rel_pos": False}, "model.rope_global"),
    "QK-norm": ({"qk_norm": True}, "model.blocks.0.attn.q_norm"),
    "an MLP head": (
        {"head_hidden_size": 16, "num_classes": 3},
        "model.head: VisionTransformerSAM has head: NormMlpClassifierHead",
    ),
    "max pooling": (
        {"global_pool": "max"},
        "model.head.global_pool.pool: VisionTransformerSAM has head.global_pool.pool: AdaptiveMaxPool2d",
    ),
    "patch dropout": ({"patch_drop_rate": 0.1}, "model.patch_drop"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_specvit_cannot_state_is_refused_by_name(case: str) -> None:
    kwargs, message = REFUSED[case]
    base = {"img_size": 32, "patch_size": 8, "embed_dim": 16, "depth": 2, "num_heads": 2, "window_size": 2}
    ref = timm_model("samvit_base_patch16", seed=0, **(base | {"neck_chans": 8} | kwargs))
    with pytest.raises(SpecError) as err:
        specvit.from_timm(ref)
    assert message in str(err.value)


# ------------------------------------------------------------------------------------------ the layers


def test_grid_attention_is_the_formula_in_float64() -> None:
    """Padded windows with decomposed relative positions, against the definition written out with loops."""
    torch.manual_seed(0)
    grid, m, c, heads = (5, 3), 2, 8, 2
    attn = GridAttention(c, heads, grid, m, rel_pos=True, dtype=torch.float64).eval()
    with torch.no_grad():
        attn.rel_pos_h.normal_()
        attn.rel_pos_w.normal_()
    x = torch.randn(2, grid[0] * grid[1], c, dtype=torch.float64)
    hd = c // heads
    padded = torch.zeros(2, 6, 4, c, dtype=torch.float64)  # 5x3 padded to 6x4 with zeros
    padded[:, :5, :3] = x.view(2, 5, 3, c)
    qkv = attn.qkv(padded).view(2, 6, 4, 3, heads, hd)
    expected = torch.zeros(2, 6, 4, heads, hd, dtype=torch.float64)
    for i in range(6):
        for j in range(4):
            wi, wj = i // m * m, j // m * m  # the window's corner
            keys = [(k, kw) for k in range(wi, wi + m) for kw in range(wj, wj + m)]
            for h in range(heads):
                q = qkv[:, i, j, 0, h]
                logits = torch.stack(
                    [
                        (q * qkv[:, k, kw, 1, h]).sum(-1) / hd**0.5
                        + (q * attn.rel_pos_h[i - k + m - 1]).sum(-1)
                        + (q * attn.rel_pos_w[j - kw + m - 1]).sum(-1)
                        for k, kw in keys
                    ],
                    -1,
                )
                values = torch.stack([qkv[:, k, kw, 2, h] for k, kw in keys], 1)
                expected[:, i, j, h] = (logits.softmax(-1)[..., None] * values).sum(1)
    expected = attn.proj(expected.reshape(2, 6, 4, c))[:, :5, :3].reshape(2, 15, c)
    torch.testing.assert_close(attn(x), expected, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------------------- the diagram


def _nodes(dot: str) -> dict[str, str]:
    return dict(re.findall(r'^\s*"?([^"\s]+)"? \[(.*)\]$', dot, re.M))


def test_windows_global_blocks_positions_and_neck_are_drawn() -> None:
    graph = build_graph(specvit.load_spec(ROOT / "specs" / "samvit_base_patch16.yaml"))
    dot = to_dot(graph)
    nodes = _nodes(dot)
    windowed, global_ = nodes["encoder.blocks.0.attn"], nodes["encoder.blocks.2.attn"]
    assert "<b>grid_attention</b>" in windowed
    assert "14x14 windows · not shifted · grid 64x64 padded to 70x70" in windowed
    assert "decomposed rel. pos · h 27x64 · w 27x64" in windowed
    assert "global · whole 64x64 grid" in global_ and "windows" not in global_
    assert "decomposed rel. pos · h 127x64 · w 127x64" in global_
    # the neck is generic layers over the map: tokens to a map, conv, norm, conv, norm
    assert "tokens → 64x64 map" in nodes["head.map"] and "B x 768 x 64 x 64" in nodes["head.map"]
    assert "1x1 conv 768 → 256 · no bias" in nodes["head.neck.0"]
    assert "3x3 conv 256 → 256 · no bias" in nodes["head.neck.2"]
    for norm in ("head.neck.1", "head.neck.3"):
        assert "LayerNorm over 256 channels · eps 1e-06" in nodes[norm] and "B x 256 x 64 x 64" in nodes[norm]
    # the collapsed view draws the window, window, global pattern once, in order, in a frame x4; its two
    # windowed blocks fold into one
    for label in ("encoder.blocks.0-11  x4", "encoder.blocks.0-1  x2", "encoder.blocks.2"):
        assert f"<b>{label}</b>" in dot
    drawn = {n.split(".")[2] for n in nodes if n.startswith("encoder.blocks.") and "caption" not in n}
    assert drawn == {"0", "2"}


# ------------------------------------------------------------------------------------------- the rules


def _sam(**overrides: Any) -> specvit.Spec:
    return specvit.load_spec(ROOT / "specs" / "samvit_base_patch16.yaml", overrides=overrides)


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        ({"encoder.block.window.shift": True}, "encoder.block.window.shift", "set shift: false"),
        ({"encoder.block.window.bias": True}, "encoder.block.window.bias", "set bias: false"),
        ({"encoder.prefix.cls": True}, "encoder.position", "no class or register tokens"),
        ({"encoder.block.qkv_bias": [True, False, True]}, "encoder.block.qkv_bias", "use true or false"),
        ({"head.classes": 10}, "head.classes", "set pool: mean"),
        (
            {"encoder.block.window.pad": False, "encoder.block.window.bias": True},
            "encoder.position",
            "window: set bias: false",
        ),
    ],
)
def test_padded_window_rules_name_the_key_and_the_fix(overrides: dict[str, Any], key: str, fix: str) -> None:
    with pytest.raises(SpecError) as err:
        _sam(**overrides)
    assert key in str(err.value) and fix in str(err.value)


def test_without_pad_the_grid_must_divide_into_windows() -> None:
    with pytest.raises(SpecError, match="grid is not divisible by window 14"):
        _sam(**{"encoder.block.window.pad": False})
    spec = _sam(**{"encoder.block.window.pad": False, "encoder.block.window.size": 16})
    attn = build_graph(spec)["encoder.blocks.0.attn"]
    assert attn["p"].window == 16 and "padded" not in " ".join(
        specvit.ops.OPS["grid_attention"].label(attn["p"])
    )
