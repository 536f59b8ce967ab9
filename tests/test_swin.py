"""Swin (Liu et al., 2021): parameter counts, parity with timm and with a reference from the paper,
stages in the graph and the diagram, and the rules of hierarchical specs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from swin_reference import swin_forward, swin_num_params

import specvit
from specvit import SpecError

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = (
    ROOT
    / "tests"
    / "fixtures"
    / "swin_tiny_patch4_window7_224__embed_dim-16_depths-2-2-2-1_num_heads-1-2-4-8.safetensors"
)
TINY = ROOT / "specs" / "swin_tiny_patch4_window7_224.yaml"

TIMM_COUNTS = {  # timm's reported parameter counts, 1000 classes
    "swin_tiny_patch4_window7_224": (96, (2, 2, 6, 2), (3, 6, 12, 24), 28_288_354),
    "swin_small_patch4_window7_224": (96, (2, 2, 18, 2), (3, 6, 12, 24), 49_606_258),
    "swin_base_patch4_window7_224": (128, (2, 2, 18, 2), (4, 8, 16, 32), 87_768_224),
}


def _spec(width: int, depths: Any, heads: Any, **over: Any) -> specvit.Spec:
    return specvit.load_spec(
        TINY,
        overrides={
            "encoder.width": width,
            "encoder.depth": list(depths),
            "encoder.block.heads": list(heads),
            **over,
        },
    )


def _fixture() -> tuple[dict[str, torch.Tensor], dict[str, Any], torch.Tensor, torch.Tensor]:
    tensors = load_file(FIXTURE)
    with safe_open(FIXTURE, "pt") as f:
        kwargs = json.loads(f.metadata()["timm_kwargs"])
    state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    return state, kwargs, tensors["input"], tensors["output"]


@pytest.mark.parametrize("name", sorted(TIMM_COUNTS))
def test_parameter_counts_equal_timm(name: str) -> None:
    width, depths, heads, count = TIMM_COUNTS[name]
    graph = specvit.build_graph(specvit.load_spec(ROOT / "specs" / f"{name}.yaml"))
    assert graph.total_params == count == swin_num_params(embed_dim=width, depths=depths, num_heads=heads)


def test_timm_fixture_parity() -> None:
    state, kwargs, x, want = _fixture()
    assert kwargs == {"embed_dim": 16, "depths": [2, 2, 2, 1], "num_heads": [1, 2, 4, 8]}
    spec = _spec(16, kwargs["depths"], kwargs["num_heads"])
    model = specvit.build_model(spec).eval()
    model.load_state_dict(specvit.convert_state_dict(state, "timm", spec), strict=True)
    assert sum(p.numel() for p in model.parameters()) == 507_902
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("image", "window", "width", "depths", "heads"),
    [(224, 7, 16, [2, 2, 2, 1], [1, 2, 4, 8]), (64, 4, 8, [2, 2, 2], [1, 2, 4])],
    ids=["fixture-config", "window-shrinks-to-grid"],
)
def test_matches_the_paper_reference_in_float64(
    image: int, window: int, width: int, depths: list[int], heads: list[int]
) -> None:
    """At 1e-7 in float64, a missing mask, shift or bias would show (at 1e-5 in fp32 they can hide)."""
    spec = _spec(width, depths, heads, **{"encoder.input.size": image, "encoder.block.window.size": window})
    torch.manual_seed(0)
    model = specvit.build_model(spec, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    timm_state = {}
    for (
        k,
        v,
    ) in model.state_dict().items():  # specvit -> timm names, the inverse of convert_state_dict's table
        k = k.removeprefix("encoder.").replace("stages.", "layers.").replace("embed_norm", "patch_embed.norm")
        timm_state[k] = v
    x = torch.randn(2, 3, image, image, dtype=torch.float64)
    with torch.no_grad():
        ours = model(x)
    ref = swin_forward(timm_state, x, embed_dim=width, depths=depths, num_heads=heads, window_size=window)
    torch.testing.assert_close(ours, ref, atol=1e-7, rtol=0)
    converted = specvit.convert_state_dict(timm_state, "timm", spec)
    assert all(torch.equal(converted[k], v) for k, v in model.state_dict().items())


def test_graph_has_stages_with_token_counts_and_widths() -> None:
    g = specvit.build_graph(specvit.load_spec(TINY))
    shapes = [g[f"encoder.stages.{s}.blocks.0.attn"]["shape"] for s in range(4)]
    assert shapes == [("B", 3136, 96), ("B", 784, 192), ("B", 196, 384), ("B", 49, 768)]
    assert [g[f"encoder.stages.{s}.downsample.reduction"]["shape"] for s in (1, 2, 3)] == shapes[1:]
    shifts = [g[f"encoder.stages.2.blocks.{i}.attn"]["p"].shift for i in range(6)]
    assert shifts == [0, 3, 0, 3, 0, 3]
    last = [g[f"encoder.stages.3.blocks.{i}.attn"]["p"] for i in range(2)]
    assert [(p.window, p.shift) for p in last] == [(7, 0), (7, 0)]  # 7x7 grid: one window, no shift
    rows = {r.path: r.count for r in g.summary()}
    assert rows["encoder.stages.2.blocks.0,2,4.attn"] == rows["encoder.stages.2.blocks.1,3,5.attn"] == 3
    assert rows["encoder.stages.3.blocks.0-1.attn"] == 2
    assert g.total_flops == pytest.approx(8.98e9, rel=1e-3)  # the paper's 4.5 GMACs


def test_diagram_draws_plain_and_shifted_windows() -> None:
    from specvit.diagram import to_dot

    graph = specvit.build_graph(specvit.load_spec(TINY))
    dot = to_dot(graph)
    # stage 0 drawn block by block: its plain block in full, its shifted block as a box saying what differs;
    # stages 1-3 as boxes repeating it (stage 3's 7x7 grid is one window: its second block is not shifted)
    assert dot.count("7x7 windows · not shifted") == 2  # stage 0's block 0, stage 3's box
    assert dot.count("attn: 7x7 windows · shifted by 3") == 1  # stage 0's block 1
    assert "6 blocks: encoder.stages.0.blocks.0-1 x3" in dot  # stage 2: the plain, shifted pattern x3
    assert dot.count("2x2 tokens") == 3  # stage 1's merge drawn, stage 2's and 3's in their boxes
    expanded = to_dot(graph, "expanded")  # every block in full
    assert (
        expanded.count("7x7 windows · not shifted") == 7 and expanded.count("7x7 windows · shifted by 3") == 5
    )


@pytest.mark.parametrize(
    ("over", "expected"),
    [
        ({"encoder.block.heads": [3, 6, 12]}, "encoder.block.heads: 3 stages of heads, but depth has 4"),
        (
            {"encoder.input.size": 88},
            "encoder.depth: 4 stages halve the 22x22 patch grid 3 times, which needs it divisible by 8",
        ),
        (
            {"encoder.block.window.size": 5},
            "encoder.block.window.size: stage 0's 56x56 grid is not divisible by window 5",
        ),
        (
            {"encoder.prefix.cls": True},
            "encoder.prefix: a hierarchical stack (depth per stage) does not support this",
        ),
        (
            {"encoder.position": "rope2d"},
            "encoder.position: a hierarchical stack (depth per stage) cannot take rope2d",
        ),
        ({"encoder.depth": 12}, "encoder.block.heads: heads is a list but depth is one number"),
    ],
    ids=["heads-count", "grid", "window", "prefix", "rope2d", "heads-list"],
)
def test_hierarchical_rules(over: dict[str, Any], expected: str) -> None:
    with pytest.raises(SpecError) as info:
        specvit.load_spec(TINY, overrides=over)
    assert expected in str(info.value)
