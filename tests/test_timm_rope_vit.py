"""RoPE-ViT (Heo et al. 2024) against timm's ``Eva`` with ``attn_type='rope'``: 2D rotary positions with the
column first (``rope2d.axes: xy``), and RoPE-Mixed, whose frequencies each attention layer learns per head
(``rope2d.frequencies: learned``, timm's ``RotaryEmbeddingMixed``).

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
from specvit.nn.rope2d import RopeMixed

SMALL = {"embed_dim": 64, "depth": 2, "num_heads": 4, "num_classes": 5, "img_size": 64}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "RoPE-Axial, column first": ("vit_small_patch16_rope_224", {}),
    "RoPE-Axial with learned positions": ("vit_small_patch16_rope_ape_224", {}),
    "RoPE-Mixed": ("vit_small_patch16_rope_mixed_224", {}),
    "RoPE-Mixed with learned positions": ("vit_small_patch16_rope_mixed_ape_224", {}),
    "RoPE-Mixed, row first": ("vit_small_patch16_rope_mixed_224", {"rope_grid_indexing": "ij"}),
    "RoPE-Mixed, rectangle": ("vit_small_patch16_rope_mixed_224", {"img_size": (48, 80)}),
    "grouped keys and values": ("vit_small_patch16_rope_224", {"num_kv_heads": 2, "qkv_fused": False}),
    "register, mean pool (timm's rope_reg1_gap)": ("vit_medium_patch16_rope_reg1_gap_256", {}),
}


def _ref(case: str, seed: int = 1) -> torch.nn.Module:
    name, kwargs = CASES[case]
    return timm_model(name, seed=seed, **(SMALL | kwargs)).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_timm_rope_vit_is_read_exactly(case: str) -> None:
    ref = _ref(case)
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    position = model.spec.encoder.position
    rope = position[-1] if isinstance(position, list) else position  # after a learned table (ape)
    assert rope.frequencies == ("learned" if "Mixed" in case else "fixed")


def _diff(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    image = model.spec.encoder.input
    size = (image.size, image.size) if isinstance(image.size, int) else tuple(image.size)
    images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return (model(images) - ref(images)).abs().max().item()


@pytest.mark.parametrize("case", ["RoPE-Axial, column first", "RoPE-Mixed"])
def test_the_column_first_is_what_makes_them_exact(case: str) -> None:
    """The control: the same weights with the row first miss timm's outputs."""
    ref = _ref(case)
    spec = specvit.from_timm(ref).model_dump(mode="json", exclude_none=True)
    assert spec["encoder"]["position"]["axes"] == "xy"
    spec["encoder"]["position"]["axes"] = "ij"
    assert _diff(converted(ref, specvit.parse_spec(spec), "timm"), ref) > 1e-4  # ten times the tolerance


def test_each_block_reads_its_own_slice_of_timms_frequencies() -> None:
    """timm keeps every block's frequencies in one (2, depth, H, hd/2) parameter; block i gets [:, i]."""
    ref = _ref("RoPE-Mixed")
    model, _ = timm_parity(ref)
    for i in range(2):
        assert torch.equal(model.encoder.blocks[i].rope.freqs, ref.rope.freqs[:, i])  # type: ignore[index]
    assert _diff(model, ref) <= 1e-5
    with torch.no_grad():  # the control: block 0's frequencies in block 1
        model.encoder.blocks[1].rope.freqs.copy_(ref.rope.freqs[:, 0])  # type: ignore[index]
    assert _diff(model, ref) > 1e-4


def test_rope_mixed_starts_as_rope_vit() -> None:
    """Each head's frequency pairs start at the fixed magnitudes base^(-4i/hd), turned by one angle per head."""
    rope = RopeMixed(heads=3, head_dim=16, grid=(2, 2), base=10.0)
    fx, fy = rope.freqs  # (H, hd/2) each
    magnitude = (fx**2 + fy**2).sqrt()  # (H, hd/2)
    expected = 10.0 ** -(torch.arange(0, 16, 4) / 16)  # (hd/4,)
    assert torch.allclose(magnitude, expected.repeat(2).expand(3, -1), atol=1e-6)
    turn = torch.atan2(fy[:, 0], fx[:, 0])  # (H,) the first pair's angle
    assert torch.allclose(torch.atan2(fy[:, 1], fx[:, 1]), turn, atol=1e-5)
    quarter = torch.atan2(fy[:, 4], fx[:, 4]) - turn  # the second half: a quarter turn further
    assert torch.allclose(torch.remainder(quarter, 2 * torch.pi), torch.full((3,), torch.pi / 2), atol=1e-5)


def _spec(position: dict[str, Any]) -> dict[str, Any]:
    return {
        "specvit": 1,
        "name": "mixed",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "image", "size": 32, "patch": 8},
            "prefix": {"cls": True},
            "position": position,
            "width": 32,
            "depth": 2,
            "block": {"heads": 2},
        },
        "head": {"kind": "classifier", "classes": 3},
    }


@pytest.mark.parametrize(
    "extra",
    [{"layout": "sections"}, {"layout": "interleaved", "ref_grid": [8, 8]}],
)
def test_learned_frequencies_refuse_what_they_cannot_pair(extra: dict[str, Any]) -> None:
    with pytest.raises(SpecError) as err:
        specvit.parse_spec(_spec({"kind": "rope2d", "frequencies": "learned"} | extra))
    assert "encoder.position.frequencies: learned frequencies pair the channels interleaved or half" in str(
        err.value
    )


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_ejected_file_rotates_as_the_model(layout: str) -> None:
    spec = _spec({"kind": "rope2d", "frequencies": "learned", "layout": layout, "axes": "xy"})
    model, ejected = ejected_twin(spec, 0.3)
    images = torch.randn(2, 3, 32, 32)
    assert torch.equal(ejected(images), model(images))
    with torch.no_grad():
        model.encoder.blocks[0].rope.freqs.mul_(2.0)  # type: ignore[index]  # the control
    assert not torch.allclose(ejected(images), model(images), atol=1e-4)


def test_the_summary_shows_each_layers_tables() -> None:
    graph = specvit.build_graph(_spec({"kind": "rope2d", "frequencies": "learned", "layout": "half"}))
    node = graph["encoder.blocks.1.rope"]
    assert graph.op("encoder.blocks.1.rope").label(node["p"]) == (
        "rotary 2D · learned per head · grid 4x4",
        "half pairs · 1 prefix unrotated",
    )


def test_learned_frequencies_refuse_grouped_keys() -> None:
    """Each query head's rotation is its own: keys shared by several query heads have none to take."""
    spec = _spec({"kind": "rope2d", "frequencies": "learned", "layout": "interleaved"})
    spec["encoder"]["block"]["kv_heads"] = 1
    with pytest.raises(SpecError) as err:
        specvit.parse_spec(spec)
    assert "learned frequencies turn each head's keys as its queries; 1 key/value heads serve 2" in str(
        err.value
    )
    del spec["encoder"]["block"]["kv_heads"]  # the control
    specvit.parse_spec(spec)
