"""EVA-02 (timm's ``Eva``): read exactly by specvit.from_timm, its RoPE and inner-norm MLP equal timm's,
its presets' parameter counts equal timm's, what specvit cannot state refused by name, drawn as built.

References are built by timm from kwargs with seeded random weights moved off their init (nothing is
downloaded); fp32, eval, max abs diff <= 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from reference import converted, timm_model, timm_parity
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, apply_rot_embed_cat

import specvit
from specvit.diagram import to_dot
from specvit.errors import SpecError
from specvit.nn.position import apply_rope
from specvit.nn.rope2d import Rope2d

ROOT = Path(__file__).resolve().parents[1]

EVA: dict[str, tuple[str, dict[str, Any]]] = {
    # fused qkv with q_bias / v_bias, packed GluMlp, learned + rope on a square grid, mean pool + fc_norm
    "tiny": ("eva02_tiny_patch14_224", {"depth": 2, "img_size": 56, "num_classes": 10}),
    # separate q/k/v projections, SwiGLU with its inner LayerNorm (scale_mlp), rectangular grid scaled
    # to the 16x16 reference grid (ref_feat_shape), odd sizes
    "base_rect": (
        "eva02_base_patch14_224",
        {"depth": 2, "img_size": (42, 70), "embed_dim": 64, "num_heads": 4, "num_classes": 5},
    ),
    # rotate-half layout, registers, no class-token positions, layer scale, QK-norm, class-token pool
    "small_half_registers": (
        "eva02_small_patch14_224",
        {
            "depth": 2,
            "img_size": (98, 56),
            "embed_dim": 96,
            "num_heads": 3,
            "rope_rotate_half": True,
            "num_reg_tokens": 2,
            "no_embed_class": True,
            "init_values": 0.1,
            "qk_norm": True,
            "global_pool": "token",
            "num_classes": 3,
        },
    ),
    # EVA-01 style: GELU Mlp with an inner norm, no rope, no qkv bias, no reference grid, theta 100
    "gelu_mlp_norm_no_rope": (
        "eva02_tiny_patch14_224",
        {
            "depth": 3,
            "img_size": 42,
            "swiglu_mlp": False,
            "scale_mlp": True,
            "use_rot_pos_emb": False,
            "qkv_bias": False,
            "num_classes": 4,
        },
    ),
    "rope_only_plain_grid": (
        "eva02_tiny_patch14_224",
        {
            "depth": 1,
            "img_size": 70,
            "use_abs_pos_emb": False,
            "ref_feat_shape": None,
            "rope_temperature": 100.0,
            "num_classes": 2,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(EVA))
def test_eva_models_are_read_exactly(case: str) -> None:
    name, kwargs = EVA[case]
    ref = timm_model(name, seed=1, **kwargs)
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    model.load_state_dict(specvit.convert_state_dict(ref.state_dict(), "timm", model.spec), strict=True)


def test_the_rope_layout_matters() -> None:
    """The parity above can fail: CroCo's sectioned layout in place of EVA's interleaved pairs differs."""
    ref = timm_model("eva02_tiny_patch14_224", seed=3, depth=1, img_size=42, num_classes=4)
    spec = specvit.from_timm(ref)
    assert spec.stacks["encoder"].positions[1].layout == "interleaved"
    data = spec.model_dump(mode="json", exclude_none=True)
    data["encoder"]["position"][1]["layout"] = "sections"
    wrong = converted(ref, specvit.parse_spec(data), "timm")
    images = torch.randn(2, 3, 42, 42, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (wrong(images) - ref(images)).abs().max().item() > 1e-3


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("grid", "ref_grid"), [((16, 16), (16, 16)), ((7, 5), (16, 16)), ((3, 4), None)])
def test_rope2d_tables_equal_timm_rotary_embedding_cat(
    half: bool, grid: tuple[int, int], ref_grid: tuple[int, int] | None
) -> None:
    """Bitwise: EVA's rotation of the patch tokens, the class token left as it is."""
    hd, prefix = 16, 1
    rope = RotaryEmbeddingCat(
        dim=hd,
        temperature=10000.0,
        in_pixels=False,
        feat_shape=list(grid),
        ref_feat_shape=ref_grid,
        rotate_half=half,
    )
    x = torch.randn(2, 3, prefix + grid[0] * grid[1], hd, generator=torch.Generator().manual_seed(0))
    expected = torch.cat(
        (x[:, :, :prefix], apply_rot_embed_cat(x[:, :, prefix:], rope.get_embed(), half=half)), 2
    )
    layout = "half" if half else "interleaved"
    cos, sin = Rope2d(hd, grid, 10000.0, prefix, layout, ref_grid)(x[0].transpose(0, 1))
    assert cos.shape == (
        (prefix + grid[0] * grid[1], hd) if half else (prefix + grid[0] * grid[1], hd // 2, 2)
    )
    assert torch.equal(apply_rope(x, cos, sin), expected)


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "a norm before the output projection": ({"scale_attn_inner": True}, "model.blocks.0.attn.norm"),
    "attention-only layer scale": (
        {"init_values": 0.1, "attn_only_layer_scale": True},
        "model.blocks.0.gamma_2",
    ),
    "post-norm block class": ({"use_post_norm": True}, "model.blocks.0: Eva has blocks.0: EvaBlockPostNorm"),
    "rope coordinates in pixels": (
        {"rope_type": "dinov3"},
        "model.rope: Eva has rope: RotaryEmbeddingDinoV3",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_specvit_cannot_state_is_refused_by_name(case: str) -> None:
    kwargs, message = REFUSED[case]
    base = {"depth": 1, "img_size": 28, "num_classes": 3}
    ref = timm_model("eva02_tiny_patch14_224", seed=0, **{**base, **kwargs})
    with pytest.raises(SpecError) as err:
        specvit.from_timm(ref)
    assert message in str(err.value)


PRESETS = {
    "eva02_tiny_patch14_224": 5_502_144,
    "eva02_small_patch14_224": 21_621_120,
    "eva02_base_patch14_224": 85_758_720,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count_equals_timm(name: str) -> None:
    """timm's model at full size on the meta device: without a head (its MIM config), and with 1000 classes."""
    import timm

    with torch.device("meta"):
        headless = timm.create_model(name, pretrained=False, num_classes=0)
        ref = timm.create_model(name, pretrained=False, num_classes=1000)
    assert sum(p.numel() for p in headless.parameters()) == PRESETS[name]
    graph = specvit.build_graph(specvit.load_spec(ROOT / "specs" / f"{name}.yaml"))
    assert graph.total_params == sum(p.numel() for p in ref.parameters())
    assert f"{graph.total_params:,}" in (ROOT / "specs" / f"{name}.yaml").read_text()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_equals_the_import_of_its_timm_model(name: str) -> None:
    ref = timm_model(name, seed=0, depth=2, num_classes=1000)
    imported = specvit.from_timm(ref).model_dump(exclude={"name", "description"})
    preset = specvit.load_spec(ROOT / "specs" / f"{name}.yaml", overrides={"encoder.depth": 2})
    assert preset.model_dump(exclude={"name", "description"}) == imported


def test_eva_is_drawn_with_its_rope_and_inner_norm() -> None:
    spec = specvit.load_spec(ROOT / "specs" / "eva02_base_patch14_224.yaml", overrides={"encoder.depth": 2})
    dot = to_dot(specvit.build_graph(spec), view="expanded")
    assert (
        "rotary 2D · grid 16x16 · base 10000<br/>interleaved pairs · scaled to 16x16 · 1 prefix unrotated"
        in dot
    )
    assert "inner layernorm (eps 1e-06) before fc2" in dot
    for i in range(2):
        assert f'"encoder.rope" -> "encoder.blocks.{i}.attn"' in dot
    assert '"encoder.pos_embed" -> "encoder.rope"' in dot  # the learned table first, then RoPE in attention


def test_state_dicts_are_routed_to_eva_by_their_keys() -> None:
    for name, kwargs in (EVA["tiny"], EVA["base_rect"]):
        ref = timm_model(name, seed=2, **kwargs)
        spec = specvit.from_timm(ref)
        state = specvit.convert_state_dict(ref.state_dict(), "timm", spec)
        attn = ref.blocks[1].attn
        weight = (
            attn.qkv.weight
            if attn.qkv is not None
            else torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
        )
        torch.testing.assert_close(state["encoder.blocks.1.attn.qkv.weight"], weight, rtol=0, atol=0)
        assert "encoder.blocks.1.attn.k_bias" not in state


def test_keys_like_a_vit_go_through_the_vit_layout_to_the_same_weights() -> None:
    """An Eva without q/v biases, layer scale or inner norms has a ViT's keys: either layout reads it."""
    from specvit.interop.timm import timm_layouts

    ref = timm_model("eva02_tiny_patch14_224", seed=1, depth=2, img_size=28, qkv_bias=False, num_classes=3)
    layouts = timm_layouts(list(ref.state_dict()))
    assert [make(specvit.from_timm(ref), list(ref.state_dict())).name for make in layouts] == [
        "timm VisionTransformer"
    ]
    assert timm_parity(ref)[1] <= 1e-5


def _with_rope(**fields: Any) -> dict[str, Any]:
    data = specvit.load_spec(ROOT / "specs" / "eva02_tiny_patch14_224.yaml").model_dump(mode="json")
    data["encoder"]["position"][1].update(fields)
    return data


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"ref_grid": [0, 16]},
            "encoder.position.1.ref_grid: ref_grid [0, 16] must be two sizes between 1 and 4096",
        ),
        ({"ref_grid": [16]}, "encoder.position.1.ref_grid"),
        ({"layout": "pairs"}, "encoder.position.1.layout"),
    ],
)
def test_bad_rope2d_fields_are_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as err:
        specvit.parse_spec(_with_rope(**fields))
    assert message in str(err.value)


def test_fine_tuned_at_336_is_the_preset_at_336_with_positions_scaled_to_its_pretraining_grid() -> None:
    """timm's eva02_tiny_patch14_336 (a 24x24 grid, ref_feat_shape 16x16) is the 224 preset at size 336."""
    ref = timm_model("eva02_tiny_patch14_336", seed=1, depth=1, num_classes=1000)
    assert timm_parity(ref, batch=1)[1] <= 1e-5
    preset = specvit.load_spec(
        ROOT / "specs" / "eva02_tiny_patch14_224.yaml",
        overrides={"encoder.input.size": 336, "encoder.depth": 1},
    )
    exclude = {"name", "description"}
    assert preset.model_dump(exclude=exclude) == specvit.from_timm(ref).model_dump(exclude=exclude)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_timm_models_at_full_width(name: str) -> None:
    """timm's weights at full width (one block) load into the preset strictly and give timm's outputs,
    in float64 (fp32 rounding alone would blur a 1e-10 comparison at these widths)."""
    ref = timm_model(name, seed=5, depth=1, num_classes=1000)
    preset = specvit.load_spec(ROOT / "specs" / f"{name}.yaml", overrides={"encoder.depth": 1})
    model = converted(ref, preset, "timm").double()
    images = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        assert (model(images) - ref.double()(images)).abs().max() <= 1e-10


def test_a_converted_eva_exports_to_onnx(tmp_path: Path) -> None:
    """The rotary table, the q/v-only biases and the inner-norm SwiGLU export: ONNX computes timm's outputs."""
    import numpy as np
    import onnxruntime as ort

    from specvit.export import example_inputs, export_onnx

    kwargs = {"img_size": 28, "in_chans": 1, "num_classes": 4, "embed_dim": 32, "depth": 2, "num_heads": 2}
    ref = timm_model("eva02_base_patch14_224", seed=4, **kwargs, num_reg_tokens=1, init_values=1e-3)
    model = converted(ref, specvit.from_timm(ref), "timm")
    path = export_onnx(model, tmp_path / "eva.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (x,) = example_inputs(model, 3)
    got = session.run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        want = ref(x).numpy()
    assert np.abs(got - want).max() <= 1e-4  # onnxruntime's fp32 kernels against timm's eager ones
