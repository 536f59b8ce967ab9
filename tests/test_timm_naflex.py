"""timm's NaFlexVit read at a fixed image size: its one learned table, kept at its own 16 x 16 grid, resampled
to each image's patch grid (``position: {kind: learned, grid: ...}``).

References are built by timm with seeded random weights moved off their init (nothing is downloaded); fp32,
max abs diff <= 1e-5, strict state-dict loads, equal parameter counts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import converted, ejected_twin, timm_model, timm_parity

import specvit
from specvit.errors import SpecError

SMALL = {"embed_dim": 48, "depth": 2, "num_heads": 3, "num_classes": 5}

CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    # name: (timm model, image size, kwargs); the table is 16 x 16 patches of 16 pixels
    "registers, mean pool, table upsampled": ("naflexvit_base_patch16_gap", 384, {}),
    "at the table's own grid": ("naflexvit_base_patch16_gap", 256, {}),
    "table shrunk, antialiased": ("naflexvit_base_patch16_gap", 160, {}),
    "table shrunk, not antialiased": ("naflexvit_base_patch16_gap", 160, {"pos_embed_antialias": False}),
    "bilinear, rectangle": ("naflexvit_base_patch16_gap", 0, {"pos_embed_interp_mode": "bilinear"}),
    "class token": ("naflexvit_base_patch16_gap", 192, {"class_token": True, "global_pool": "token"}),
    "class token, prefix flag set": (  # token pooling reads token 0 whatever pool_include_prefix says
        "naflexvit_base_patch16_gap",
        192,
        {"class_token": True, "global_pool": "token", "pool_include_prefix": True},
    ),
    "patches flattened channel first": ("naflexvit_base_patch16_gap", 192, {"patchify_channels_last": False}),
    "convolution projection": ("naflexvit_base_patch16_gap", 192, {"embed_proj_type": "conv"}),
    "probe, no prefix": ("naflexvit_base_patch16_map", 192, {"reg_tokens": 0}),
    "SO150M shape, no qkv bias": ("naflexvit_so150m2_patch16_reg1_gap", 192, {"mlp_ratio": 2.5}),
    "pooled features": ("naflexvit_base_patch16_gap", 192, {"num_classes": 0}),
}


def _naflex(name: str, size: int, seed: int = 3, **kwargs: Any) -> torch.nn.Module:
    ref = timm_model(name, seed=seed, **(SMALL | kwargs)).eval()
    shape = (3, 160, 224) if size == 0 else (3, size, size)
    ref.pretrained_cfg = {**ref.pretrained_cfg, "input_size": shape}  # the size from_timm reads
    return ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_timm_naflexvit_is_read_exactly(case: str) -> None:
    name, size, kwargs = CASES[case]
    ref = _naflex(name, size, **kwargs)
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    position = model.spec.encoder.position
    assert position.kind == "learned" and position.grid is not None and position.grid.size == (16, 16)


def _diff(model: torch.nn.Module, ref: torch.nn.Module, size: tuple[int, int]) -> float:
    images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (model(images) - ref(images)).abs().max().item()


@pytest.mark.parametrize(
    ("case", "broken"),
    [
        ("table shrunk, antialiased", {"antialias": False}),
        ("table shrunk, not antialiased", {"antialias": True}),
        ("registers, mean pool, table upsampled", {"mode": "bilinear"}),
    ],
)
def test_resampling_settings_are_what_makes_the_table_exact(case: str, broken: dict[str, Any]) -> None:
    """The control: the same weights resampled with the other setting miss timm's outputs."""
    name, size, kwargs = CASES[case]
    ref = _naflex(name, size, **kwargs)
    spec = specvit.from_timm(ref).model_dump(mode="json", exclude_none=True)
    assert _diff(converted(ref, specvit.parse_spec(spec), "timm"), ref, (size, size)) <= 1e-5
    spec["encoder"]["position"]["grid"] |= broken
    broken_model = converted(ref, specvit.parse_spec(spec), "timm")
    assert _diff(broken_model, ref, (size, size)) > 1e-4  # ten times the tolerance


def test_patch_flattening_order_is_what_makes_the_projection_exact() -> None:
    """timm flattens each patch (row, col, channel); read as specvit's (channel, row, col) it misses."""
    ref = _naflex("naflexvit_base_patch16_gap", 192)
    spec = specvit.from_timm(ref).model_dump(mode="json", exclude_none=True)
    assert _diff(converted(ref, specvit.parse_spec(spec), "timm"), ref, (192, 192)) <= 1e-5
    spec["encoder"]["input"]["projection"] = "linear"  # the weight taken as it is stored
    assert _diff(converted(ref, specvit.parse_spec(spec), "timm"), ref, (192, 192)) > 1e-3


def test_one_table_serves_every_image_size_as_timm() -> None:
    """The spec's image size can change without touching the weights: the table keeps its own grid."""
    ref = _naflex("naflexvit_base_patch16_gap", 384)
    spec = specvit.from_timm(ref).model_dump(mode="json", exclude_none=True)
    for size in (128, 256, 320):
        spec["encoder"]["input"]["size"] = size
        model = converted(ref, specvit.parse_spec(spec), "timm")
        assert _diff(model, ref, (size, size)) <= 1e-5, size


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        (
            "naflexvit_base_patch16_parfac_gap",
            {},
            "NaFlexVit has embeds.pos_embed_type='factorized': specvit resamples one 2D table, not two 1D ones",
        ),
        ("naflexvit_base_patch16_map", {}, "NaFlexVit has pool_include_prefix=False: specvit's probe reads"),
        ("naflexvit_base_patch16_gap", {"rope_type": "axial"}, "NaFlexVit has rope: RotaryEmbeddingCat"),
        (
            "naflexvit_base_patch16_gap",
            {"patch_drop_rate": 0.1},
            "NaFlexVit has patch_drop: PatchDropoutWithIndices",
        ),
        ("naflexvit_base_patch16_gap", {"dynamic_img_pad": True}, "embeds.dynamic_img_pad=True"),
    ],
)
def test_what_no_spec_states_is_refused_by_name(name: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match="model\\.") as err:
        specvit.from_timm(_naflex(name, 192, **kwargs))
    assert message in str(err.value)


def _spec(position: dict[str, Any], size: int = 64) -> dict[str, Any]:
    return {
        "specvit": 1,
        "name": "resampled",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "image", "size": size, "patch": 16},
            "prefix": {"registers": 1},
            "position": position,
            "width": 32,
            "depth": 1,
            "block": {"heads": 2},
        },
        "head": {"kind": "classifier", "classes": 3, "pool": "mean"},
    }


def test_a_resampled_table_is_a_plain_table_at_its_own_grid() -> None:
    """At its grid the table is added as stored; elsewhere the summary shows it resampled."""
    grid = {"kind": "learned", "include_prefix": False, "grid": {"size": [4, 4]}}
    model = specvit.build_model(_spec(grid)).eval()
    table = model.encoder.pos_embed  # type: ignore[union-attr]
    assert tuple(table.weight.shape) == (1, 4, 4, 32)
    patches = torch.randn(2, 16, 32)
    assert torch.equal(table(patches), patches + table.weight.reshape(1, 16, 32))
    graph = specvit.build_graph(_spec(grid, size=96))
    node = graph["encoder.pos_embed"]
    assert graph.op("encoder.pos_embed").label(node["p"]) == (
        "learned 4x4 · bicubic antialiased to 6x6 · added",
    )


@pytest.mark.parametrize(
    ("position", "where", "message"),
    [
        (
            {"kind": "learned", "grid": {"size": 4}},
            "encoder.position.include_prefix",
            "a resampled table covers the patches only, without max_len",
        ),
        (
            {"kind": "learned", "include_prefix": False, "grid": {"size": [4, 0]}},
            "encoder.position.grid.size",
            "",
        ),
    ],
)
def test_bad_resampled_tables_are_refused_at_their_key(
    position: dict[str, Any], where: str, message: str
) -> None:
    with pytest.raises(SpecError) as err:
        specvit.parse_spec(_spec(position))
    assert where in str(err.value) and message in str(err.value)


def test_a_resampled_table_needs_an_image() -> None:
    spec = _spec({"kind": "learned", "include_prefix": False, "grid": {"size": 4}})
    spec["encoder"]["input"] = {"kind": "tokens", "vocab": 50}
    spec["head"]["pool"] = "first"
    with pytest.raises(SpecError) as err:
        specvit.parse_spec(spec)
    assert "encoder.position.grid: a resampled table needs an image input" in str(err.value)


def test_from_pretrained_reads_a_naflexvit_name_with_its_weights_file(tmp_path: Any) -> None:
    """timm's name, its arguments (the input size through ``pretrained_cfg_overlay``) and a safetensors file."""
    from safetensors.torch import save_file

    kwargs = SMALL | {"pretrained_cfg_overlay": {"input_size": (3, 192, 192)}}
    ref = timm_model("naflexvit_base_patch16_gap", seed=4, **kwargs).eval()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "w.safetensors")
    model = specvit.from_pretrained(
        "naflexvit_base_patch16_gap", weights=tmp_path / "w.safetensors", **kwargs
    )
    assert _diff(model.eval(), ref, (192, 192)) <= 1e-5
    ref.embeds.pos_embed.data.mul_(1.01)  # the control: another table
    assert _diff(model, ref, (192, 192)) > 1e-4


def test_ejected_file_resamples_as_the_model() -> None:
    spec = _spec(
        {"kind": "learned", "include_prefix": False, "grid": {"size": [4, 4], "antialias": False}}, 96
    )
    model, ejected = ejected_twin(spec, 0.08)
    images = torch.randn(2, 3, 96, 96)
    assert torch.equal(ejected(images), model(images))
    with torch.no_grad():
        model.encoder.pos_embed.weight.mul_(2.0)  # type: ignore[union-attr]  # the control
    assert not torch.equal(ejected(images), model(images))
