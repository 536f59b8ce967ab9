"""What is drawn is what is built, read off the running model: per preset, the data flow torch.fx traces
equals the ArchGraph node for node and edge for edge, shapes propagated on the meta device equal every
node's declared shape, and FlopCounterMode's FLOPs equal every module node's. Each check is also shown
to fail on a model that is not its graph."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from presets import PRESETS, ROOT, small_graph
from torch.nn.attention import SDPBackend, sdpa_kernel

from specvit.codegen.check import differences, executed_graph, meta_shapes, module_flops
from specvit.compile import build_model
from specvit.export import example_inputs
from specvit.graph import ArchGraph


def _all_inputs(graph: ArchGraph, device: str = "cpu") -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """Required arguments and every optional tensor argument (masks with some padding, token types,
    MAE's masking noise)."""
    args = example_inputs(graph, 2, device=device)
    kwargs: dict[str, Any] = {}
    for n in graph.placeholders():
        p = graph[n]["p"]
        if p.required or p.dtype not in ("bool", "long", "float"):
            continue
        shape = graph.concrete(p.shape)
        if p.dtype == "float":
            kwargs[p.arg] = torch.rand(shape, device=device)
        elif p.dtype == "bool":
            kwargs[p.arg] = torch.zeros(shape, dtype=torch.bool, device=device)
            if device != "meta":
                kwargs[p.arg][0, -2:] = True  # the first sample's last two tokens are padding
        else:
            kwargs[p.arg] = torch.zeros(shape, dtype=torch.long, device=device)
    return args, kwargs


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_executed_graph_is_the_drawn_graph(preset: Path) -> None:
    graph = small_graph(preset)
    model = build_model(graph, device="meta")
    assert differences(graph, executed_graph(model)) == []


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_meta_shapes_are_the_declared_shapes(preset: Path) -> None:
    graph = small_graph(preset)
    model = build_model(graph, device="meta")
    args, kwargs = _all_inputs(graph, "meta")
    shapes = meta_shapes(model, (*args, *kwargs.values()))  # the optional tensors follow the required ones
    declared = {
        n: graph.concrete(a["shape"]) for n, a in graph.nx.nodes(data=True) if a["shape"] and n != "output"
    }
    assert {n: shapes.get(n) for n in declared} == declared


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_flops_per_module_are_the_graphs(preset: Path) -> None:
    torch.manual_seed(0)
    graph = small_graph(preset)
    model = build_model(graph).eval()
    again = {  # a stack run a second time (CroCo's siamese pass) counts its modules' FLOPs twice
        m
        for n in graph
        if graph[n]["op"] == "call"
        for m in graph.module_nodes()
        if m.startswith(graph[n]["p"].scope + ".")
    }
    with sdpa_kernel(SDPBackend.MATH):
        counted = module_flops(model, example_inputs(graph, 2))
    assert counted == {n: graph[n]["flops"] * (2 if n in again else 1) for n in graph.module_nodes()}


def test_the_checks_fail_on_a_model_that_is_not_its_graph() -> None:
    graph = small_graph(ROOT / "specs" / "vit_tiny_patch16_224.yaml")
    model = build_model(graph, device="meta")
    block = model.encoder.blocks[1]

    def skip_attention(x: torch.Tensor) -> torch.Tensor:  # a block whose attention never runs
        return x + block.mlp(block.norm2(x))

    block.forward = skip_attention
    found = differences(graph, executed_graph(model))
    assert "drawn, not executed: encoder.blocks.1.attn" in found
    assert "executed edge not drawn: encoder.blocks.0.add2 -> encoder.blocks.1.norm2 (x)" in found

    drawn = small_graph(ROOT / "specs" / "vit_tiny_patch16_224.yaml")  # a diagram that skips norm1
    drawn.nx.remove_edge("encoder.blocks.0.norm1", "encoder.blocks.0.attn")
    drawn.nx.add_edge("encoder.pos_embed", "encoder.blocks.0.attn", port="x")
    found = differences(drawn, executed_graph(build_model(graph, device="meta")))
    assert "drawn edge not executed: encoder.pos_embed -> encoder.blocks.0.attn (x)" in found
    assert "executed edge not drawn: encoder.blocks.0.norm1 -> encoder.blocks.0.attn (x)" in found


def test_a_wrong_declared_shape_or_flop_count_is_caught() -> None:
    graph = small_graph(ROOT / "specs" / "mnist_vit.yaml")
    model = build_model(graph, device="meta")
    shapes = meta_shapes(model, example_inputs(graph, 2, device="meta"))
    assert shapes["encoder.prefix"] == graph.concrete(graph["encoder.prefix"]["shape"]) == (2, 17, 512)
    assert shapes["encoder.patch_embed"] != graph.concrete(
        graph["encoder.prefix"]["shape"]
    )  # 16 tokens, not 17
    with sdpa_kernel(SDPBackend.MATH):
        counted = module_flops(build_model(graph).eval(), example_inputs(graph, 2))
    assert counted["encoder.blocks.0.attn"] == graph["encoder.blocks.0.attn"]["flops"] > 0
    assert counted["encoder.blocks.0.norm1"] == 0  # element-wise work counts nothing
