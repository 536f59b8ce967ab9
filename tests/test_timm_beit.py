"""BEiT (Bao et al. 2021) against timm's ``Beit``: from_timm reads it exactly, the presets are timm's models.

References are built by timm from kwargs with seeded random weights moved off their init (nothing is
downloaded); fp32, eval, max abs diff <= 1e-5, strict state-dict loads, equal parameter counts.
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
BASE = "beit_base_patch16_224"

CASES: dict[str, dict[str, Any]] = {
    # the base model's design: per-layer relative bias, q/v bias, layer scale 0.1, mean pool + fc_norm
    "per-layer bias, mean pool": {
        "depth": 2,
        "img_size": 64,
        "embed_dim": 48,
        "num_heads": 3,
        "num_classes": 10,
    },
    # a shared table, absolute positions as well, class-token pooling with the final norm, a rectangle
    "shared bias, abs positions, token pool, rectangle": {
        "depth": 2,
        "img_size": (32, 48),
        "patch_size": 8,
        "embed_dim": 32,
        "num_heads": 2,
        "use_rel_pos_bias": False,
        "use_shared_rel_pos_bias": True,
        "use_abs_pos_emb": True,
        "global_pool": "token",
        "num_classes": 5,
    },
    # no q/v bias, no layer scale, SwiGLU, a head dim of its own, stochastic depth
    "no qkv bias, no layer scale, SwiGLU": {
        "depth": 3,
        "img_size": 32,
        "patch_size": 8,
        "embed_dim": 32,
        "num_heads": 4,
        "qkv_bias": False,
        "init_values": 0.0,  # timm drops a None kwarg, leaving the preset's 0.1
        "swiglu_mlp": True,
        "drop_path_rate": 0.2,
        "num_classes": 3,
    },
    # a ViT's state-dict keys: converted by the VisionTransformer layout
    "abs positions only, no q/v bias, no layer scale": {
        "depth": 2,
        "img_size": 32,
        "patch_size": 8,
        "embed_dim": 32,
        "num_heads": 2,
        "qkv_bias": False,
        "init_values": 0.0,
        "use_rel_pos_bias": False,
        "use_abs_pos_emb": True,
        "num_classes": 4,
    },
    # no position at all, features out
    "no positions, no head": {
        "depth": 1,
        "img_size": 32,
        "patch_size": 8,
        "embed_dim": 32,
        "num_heads": 2,
        "use_rel_pos_bias": False,
        "use_abs_pos_emb": False,
        "global_pool": "",
        "num_classes": 0,
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_timm_beit_is_read_exactly(case: str) -> None:
    ref = timm_model(BASE, seed=3, **CASES[case])
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    block = model.spec.encoder.block
    assert (block.layer_scale is not None) == bool(CASES[case].get("init_values", 0.1))
    assert block.qkv_bias == ([True, False, True] if CASES[case].get("qkv_bias", True) else False)


def test_the_per_layer_and_shared_tables_are_where_timm_has_them() -> None:
    per_layer = specvit.from_timm(timm_model(BASE, seed=0, **CASES["per-layer bias, mean pool"]))
    shared = specvit.from_timm(
        timm_model(BASE, seed=0, **CASES["shared bias, abs positions, token pool, rectangle"])
    )
    assert [p.kind for p in per_layer.encoder.positions] == ["relative2d"]
    assert [(p.kind, getattr(p, "shared", None)) for p in shared.encoder.positions] == [
        ("learned", None),
        ("relative2d", True),
    ]
    assert per_layer.encoder.block.qkv_bias == [True, False, True]
    assert per_layer.encoder.block.layer_scale == 0.1
    assert per_layer.head.pool == "mean" and per_layer.head.norm and not per_layer.encoder.final_norm
    assert shared.head.pool == "cls" and not shared.head.norm and shared.encoder.final_norm


@pytest.mark.parametrize(
    ("name", "count"), [("beit_base_patch16_224", 86_530_984), ("beit_large_patch16_224", 304_430_568)]
)
def test_presets_have_timms_parameter_count(name: str, count: int) -> None:
    import timm

    with torch.device("meta"):
        ref = timm.create_model(name, pretrained=False)
    graph = specvit.build_graph(specvit.load_spec(ROOT / "specs" / f"{name}.yaml"))
    assert graph.total_params == sum(p.numel() for p in ref.parameters()) == count


@pytest.mark.parametrize(("name", "heads"), [("beit_base_patch16_224", 3), ("beit_large_patch16_224", 4)])
def test_preset_is_what_from_timm_reads(name: str, heads: int) -> None:
    """The preset at a small size and timm's model at that size: the same graph, the same outputs."""
    kwargs = {"depth": 2, "img_size": 48, "embed_dim": 16 * heads, "num_heads": heads, "num_classes": 7}
    ref = timm_model(name, seed=4, **kwargs)
    over = {
        "encoder.depth": 2,
        "encoder.input.size": 48,
        "encoder.width": 16 * heads,
        "encoder.block.heads": heads,
        "head.classes": 7,
    }
    preset = specvit.load_spec(ROOT / "specs" / f"{name}.yaml", overrides=over)
    ours, theirs = specvit.build_graph(preset), specvit.build_graph(specvit.from_timm(ref))
    assert [(n, d["op"], d["p"]) for n, d in ours.nx.nodes(data=True)] == [
        (n, d["op"], d["p"]) for n, d in theirs.nx.nodes(data=True)
    ]
    model = converted(ref, preset, "timm")
    images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(images) - ref(images)).abs().max().item() <= 1e-5


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "a shared table on top of per-layer tables": (
        {"use_rel_pos_bias": True, "use_shared_rel_pos_bias": True},
        "model.rel_pos_bias: Beit has rel_pos_bias='RelativePositionBias'",
    ),
    "a norm inside the MLP": ({"scale_mlp": True}, "model.blocks.0.mlp.norm"),
    "a classifier without pooling": ({"global_pool": ""}, "model.global_pool"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_specvit_cannot_state_is_refused_by_name(case: str) -> None:
    kwargs, message = REFUSED[case]
    ref = timm_model(BASE, seed=0, depth=1, img_size=32, embed_dim=32, num_heads=2, **kwargs)
    with pytest.raises(SpecError) as err:
        specvit.from_timm(ref)
    assert message in str(err.value)


def test_diagram_shows_beits_relative_bias_layer_scale_and_pooling() -> None:
    dot = to_dot(specvit.build_graph(specvit.load_spec(ROOT / "specs" / "beit_base_patch16_224.yaml")))
    assert "learned bias · 732 offsets of a 14x14 grid + class token" in dot
    assert '"encoder.blocks.0.rel_bias" -> "encoder.blocks.0.attn"' in dot  # each layer reads its own table
    assert "not causal · bias qv" in dot  # q and v biases, no k bias
    assert dot.count("per channel · init 0.1") == 2  # gamma_1, gamma_2
    assert "mean of the tokens · prefix (1) excluded" in dot
    assert '"head.pool" -> "head.norm"' in dot and '"encoder.blocks.0.add2" -> "head.pool"' in dot  # fc_norm


@pytest.mark.parametrize(
    "shared", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["per-layer", "shared"]
)  # one in the default run
def test_beit_exports_to_onnx_with_a_dynamic_batch(shared: bool, tmp_path: Path) -> None:
    """An SDPA with the relative bias as its float mask exports (see specvit.nn.attention._attend)."""
    ort = pytest.importorskip("onnxruntime")
    from specvit.export import example_inputs, export_onnx

    over = {
        "encoder.depth": 2,
        "encoder.width": 64,
        "encoder.block.heads": 2,
        "encoder.input.size": 64,
        "encoder.position.shared": shared,
    }
    torch.manual_seed(0)
    model = specvit.build_model(ROOT / "specs" / f"{BASE}.yaml", overrides=over).eval()
    for p in model.parameters():  # random everywhere: a zero table or head cannot hide a wrong export
        torch.nn.init.normal_(p, std=0.05)
    path = export_onnx(model, tmp_path / "beit.onnx", progress=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (x,) = example_inputs(model, 3)
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = model(x).numpy()
    assert got.shape == want.shape == (3, 1000)
    assert abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("name", ["beit_base_patch16_224", "beit_large_patch16_224"])
def test_preset_at_full_width_is_timms_model_in_float64(name: str) -> None:
    """Full width, one block: timm's weights load strictly into the preset and give timm's outputs (fp64)."""
    ref = timm_model(name, seed=5, depth=1)
    preset = specvit.load_spec(ROOT / "specs" / f"{name}.yaml", overrides={"encoder.depth": 1})
    model = converted(ref, preset, "timm").double()
    images = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        assert (model(images) - ref.double()(images)).abs().max() <= 1e-10
