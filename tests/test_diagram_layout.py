"""Diagrams fit for a paper: the run-time plumbing left out unless asked for, schedules drawn in execution
order, the stages of a hierarchical model as boxes (Swin-T under 2,000 px), the legend under the title in
both directions, and the notebook's PNG. Labels fitting their boxes: tests/test_diagram_text.py."""

from __future__ import annotations

import re
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import specvit
from specvit.cli import main as main_cli
from specvit.diagram import render, to_dot, to_mermaid
from specvit.diagram.graphviz import draw_dot, scene_to_dot
from specvit.diagram.scene import Cluster, Scene, plan, plumbing_nodes
from specvit.graph import build_graph
from specvit.spec.loader import parse_spec
from specvit.units import format_params

ROOT = Path(__file__).resolve().parents[1]
LOCAL_GLOBAL = ROOT / "docs" / "examples" / "local_global_lm.yaml"
SWIN_T = "swin_tiny_patch4_window7_224"
NODE = re.compile(r'^\s*"?([^"\s]+(?: \(caption\))?)"? \[', re.M)


def _tree(members: list[str | Cluster]) -> list[tuple[str, str, list[Any]]]:
    """The clusters of a scene as (kind, title, clusters inside), boxes left out."""
    return [(m.kind, m.title, _tree(m.members)) for m in members if isinstance(m, Cluster)]


def _stack(scene: Scene, name: str) -> list[tuple[str, str, list[Any]]]:
    (stack,) = [m for m in scene.members if isinstance(m, Cluster) and m.id == name]
    return _tree(stack.members)


def _height_px(path: Path) -> int:
    """The height of a PNG file (its IHDR), or of an SVG drawn at 96 dpi (Graphviz writes points)."""
    if path.suffix == ".png":
        return int(struct.unpack(">II", path.read_bytes()[16:24])[1])
    points = re.search(r'<svg width="[\d.]+pt" height="([\d.]+)pt"', path.read_text())
    assert points is not None
    return round(float(points[1]) * 96 / 72)


# ---------------------------------------------------------------------------------- run-time plumbing


def test_plumbing_is_left_out_unless_asked_for(tmp_path: Path) -> None:
    graph = build_graph(specvit.load_spec("llama_smollm_135m"))
    plumbing = {"decoder.mask", "decoder.cache", "decoder.offset"}
    assert plumbing <= set(graph) and plumbing_nodes(graph) == plumbing  # the graph keeps them
    hidden, shown = plan(graph), plan(graph, plumbing=True)
    assert not plumbing & set(hidden.boxes) and not plumbing & set(hidden.drawn)
    assert not [link for link in hidden.links if link.src in plumbing or link.dst in plumbing]
    assert plumbing <= set(shown.boxes)
    into = {(link.src, link.dst) for link in shown.links if link.src in plumbing}
    attn = "decoder.blocks.0.attn"  # the run of 30 blocks is drawn once: one edge each, not 30
    assert into == {("decoder.mask", attn), ("decoder.cache", attn), ("decoder.offset", "decoder.rope")}
    assert "decoder.rope" in hidden.boxes  # the rotary tables are data: drawn, without the offset
    assert set(NODE.findall(to_dot(graph, plumbing=True))) - set(NODE.findall(to_dot(graph))) == plumbing
    assert "n_decoder_cache" not in to_mermaid(graph)
    assert "n_decoder_cache" in to_mermaid(graph, plumbing=True)
    assert main_cli(["render", "llama_smollm_135m", "-o", str(tmp_path / "a.dot")]) == 0
    assert main_cli(["render", "llama_smollm_135m", "--plumbing", "-o", str(tmp_path / "b.dot")]) == 0
    assert (tmp_path / "a.dot").read_text() == to_dot(graph)
    assert (tmp_path / "b.dot").read_text() == to_dot(graph, plumbing=True)
    assert specvit.render(graph, plumbing=True).mermaid == to_mermaid(graph, plumbing=True)


def test_values_computed_from_plumbing_alone_are_plumbing() -> None:
    """A padding mask extended for the class token, and each shared block run's share of the KV cache, are
    plumbing; the token types (ids) are data and stay drawn."""
    encoder = {"input": {"kind": "tokens", "vocab": 50}, "position": {"kind": "learned", "max_len": 16}}
    encoder |= {"width": 32, "depth": 2, "prefix": {"cls": True}, "block": {"heads": 2}}
    head = {"kind": "classifier", "classes": 3, "pool": "cls"}
    cls = build_graph(
        parse_spec({"specvit": 1, "name": "c", "model": "encoder", "encoder": encoder, "head": head})
    )
    assert cls["encoder.prefix_mask"]["op"] == "extend_mask"
    assert plumbing_nodes(cls) == {"encoder.mask", "encoder.prefix_mask"}
    decoder = {"input": {"kind": "tokens", "vocab": 50}, "position": "rope", "width": 48, "depth": 6}
    decoder |= {"share": {"blocks": 3}, "block": {"heads": 4, "layers": ["masked_self_attention", "mlp"]}}
    spec = {
        "specvit": 1,
        "name": "s",
        "model": "decoder",
        "decoder": decoder,
        "head": {"kind": "lm", "tied": True},
    }
    shared = build_graph(parse_spec(spec))
    runs = {n for n in shared if shared[n]["op"] == "sub_cache"}
    assert len(runs) == 3 and plumbing_nodes(shared) == {
        "decoder.mask",
        "decoder.cache",
        "decoder.offset",
        *runs,
    }
    assert runs <= set(plan(shared, "expanded", plumbing=True).boxes)
    assert not runs & set(plan(shared, "expanded").boxes)
    bert = build_graph(specvit.load_spec("bert_base"))
    assert plumbing_nodes(bert) == {"encoder.mask"} and "encoder.token_types" in plan(bert).boxes


# ---------------------------------------------------------------------------------- schedules


def _local_global(**changes: Any) -> specvit.ArchGraph:
    """docs/examples/local_global_lm.yaml with decoder keys changed (``overrides=None`` drops the key)."""
    data = yaml.safe_load(LOCAL_GLOBAL.read_text())
    for key, value in changes.items():
        if value is None:
            data["decoder"].pop(key)
        else:
            data["decoder"][key] = value
    return build_graph(parse_spec(data))


FOLDED, BLOCK, REPEAT = "folded", "block", "repeat"


@pytest.mark.parametrize(
    ("changes", "drawn"),
    [
        (  # 2 local, 1 global, x3; then 2 local; then the last block (sandwich norms) on its own
            {},
            [
                (REPEAT, "decoder.blocks.0-8  x3", [(FOLDED, "decoder.blocks.0-1  x2", []), (BLOCK, "decoder.blocks.2", [])]),
                (FOLDED, "decoder.blocks.9-10  x2", []),
                (BLOCK, "decoder.blocks.11", []),
            ],
        ),
        (  # Gemma 2: local and global alternate
            {"schedule": ["local", "block"], "depth": 6, "overrides": None},
            [(REPEAT, "decoder.blocks.0-5  x3", [(BLOCK, "decoder.blocks.0", []), (BLOCK, "decoder.blocks.1", [])])],
        ),
        (  # three different blocks a period, and a remainder of two after the third period
            {"blocks": {"a": {"sliding_window": 256}, "b": {"sliding_window": 512}}, "schedule": ["a", "b", "block"],
             "depth": 11, "overrides": None},
            [
                (REPEAT, "decoder.blocks.0-8  x3", [(BLOCK, f"decoder.blocks.{i}", []) for i in range(3)]),
                (BLOCK, "decoder.blocks.9", []),
                (BLOCK, "decoder.blocks.10", []),
            ],
        ),
        (  # blocks all equal fold as one run, as without a schedule
            {"schedule": None, "blocks": None, "overrides": None},
            [(FOLDED, "decoder.blocks.0-11  x12", [])],
        ),
    ],
    ids=["local-local-global", "alternating", "three-periodic-remainder", "all-equal"],
)  # fmt: skip
def test_a_schedule_is_drawn_in_execution_order(changes: dict[str, Any], drawn: list[Any]) -> None:
    graph = _local_global(**changes)
    scene = plan(graph)
    assert _stack(scene, "decoder") == drawn
    # each drawn block leads into the next drawn block, and never back into one drawn before
    starts = [n for n in scene.boxes if n.endswith(".norm1")]
    ends = [n.replace(".norm1", ".add2") for n in starts]
    chained = [(u, v) for u, v in ((link.src, link.dst) for link in scene.links) if u in ends and v in starts]
    assert chained == list(zip(ends, starts[1:], strict=False))


def test_the_frame_is_drawn_and_the_summary_still_names_each_blocks_layers() -> None:
    graph = _local_global()
    dot = to_dot(graph)
    clusters = re.findall(r'subgraph "?cluster_([^"\s]+)"? \{', dot)
    assert clusters == [
        "decoder", "decoder.blocks.0-8", "decoder.blocks.0", "decoder.blocks.2", "decoder.blocks.9",
        "decoder.blocks.11", "head",
    ]  # fmt: skip
    assert "<b>decoder.blocks.0-8  x3</b>" in dot and "a pattern of 3 blocks, in order" in dot
    assert re.search(
        r'rank=same\s+"decoder\.blocks\.0-8 \(caption\)" \[[^\]]*\]\s+"decoder\.blocks\.0\.norm1"', dot
    )
    assert 'style="rounded,dashed"' in dot
    mermaid = to_mermaid(graph)
    assert mermaid.index('subgraph sg_decoder_blocks_0_8["<b>decoder.blocks.0-8  x3</b>') < mermaid.index(
        'subgraph sg_decoder_blocks_0["<b>decoder.blocks.0-1  x2</b>'
    )
    rows = [(r.path, r.count) for r in graph.summary() if r.path.endswith(".attn")]
    assert rows == [
        ("decoder.blocks.0,3,6.attn", 3), ("decoder.blocks.1,4,7.attn", 3), ("decoder.blocks.2,5,8.attn", 3),
        ("decoder.blocks.9-10.attn", 2), ("decoder.blocks.11.attn", 1),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------- hierarchical models


def test_swin_t_is_drawn_within_2000_px(tmp_path: Path) -> None:
    """Stage 0 is drawn block by block; its shifted block and the later stages are boxes naming the blocks
    they repeat and what differs. The control draws every stage's blocks and is too tall."""
    graph = build_graph(specvit.load_spec(SWIN_T))
    assert _height_px(render(graph, tmp_path / "swin.png")) <= 2000
    assert _height_px(render(graph, tmp_path / "swin.svg")) <= 2000
    every_stage = draw_dot(scene_to_dot(plan(graph, stages=False)), tmp_path / "every_stage.png")
    assert _height_px(every_stage) > 2000
    scene = plan(graph)
    assert set(scene.drawn) == set(graph)  # every node is drawn by some box
    boxes = {b.id: b for b in scene.boxes.values() if b.kind == "blocks"}
    assert list(boxes) == [
        "encoder.stages.0.blocks.1", "encoder.stages.1.blocks.0-1", "encoder.stages.2", "encoder.stages.3"
    ]  # fmt: skip
    assert boxes["encoder.stages.0.blocks.1"].details == (
        "as encoder.stages.0.blocks.0",
        "attn: 7x7 windows · shifted by 3",
    )
    stage2 = boxes["encoder.stages.2"]
    assert stage2.details[:2] == (
        "downsample as in encoder.stages.1",
        "6 blocks: encoder.stages.0.blocks.0-1 x3",
    )
    assert {"attn: heads 12 · kv_heads 12 · head_dim 32", "mlp: hidden 1536 · gelu"} <= set(stage2.details)
    assert "downsample.reduction: 768 → 384" in stage2.details
    assert "attn: 7x7 windows · not shifted" in boxes["encoder.stages.3"].details  # 7x7 grid: no shift
    assert (stage2.shape, stage2.params) == ("B x 196 x 384", format_params(sum(
        int(graph[n]["params"]) for n in graph if n.startswith("encoder.stages.2.")
    )) + " params")  # fmt: skip
    after = {
        link.src: link.dst for link in scene.links if link.src in boxes or link.src.endswith("reduction")
    }
    assert (
        after
        == {  # stage 1's downsample is drawn (stage 0 has none), stage 2's and 3's are in their boxes
            "encoder.stages.0.blocks.1": "encoder.stages.1.downsample.merge",
            "encoder.stages.1.downsample.reduction": "encoder.stages.1.blocks.0-1",
            "encoder.stages.1.blocks.0-1": "encoder.stages.2",
            "encoder.stages.2": "encoder.stages.3",
            "encoder.stages.3": "encoder.norm",
        }
    )
    assert _stack(scene, "encoder") == [("block", "encoder.stages.0.blocks.0", [])]  # the one cluster left


# ---------------------------------------------------------------------------------- legend


def _extent(svg: str, pattern: str) -> tuple[float, float, float, float]:
    """The bounding box (x0, y0, x1, y1) of every coordinate in the SVG elements matching ``pattern``."""
    xs, ys = [], []
    for m in re.finditer(pattern, svg):
        pts = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", m[1])]
        xs += pts[0::2]
        ys += pts[1::2]
    return min(xs), min(ys), max(xs), max(ys)


@pytest.mark.parametrize("direction", ["TB", "LR"])
def test_the_legend_sits_under_the_title_beside_the_graph(direction: str, tmp_path: Path) -> None:
    """The legend is in the graph's label, right above the clusters and within their width, in both
    directions (a legend node took the first rank: left-to-right it stood above the first column alone)."""
    svg = render(
        build_graph(specvit.load_spec("gpt2_small")), tmp_path / "m.svg", direction=direction
    ).read_text()
    cells = r'<path fill="#(?:fbd9bd|d3ecd1|fff1a8|d6e2f5|ececec|e8d5f0)" stroke="none" d="([^"]+)"'
    legend = _extent(svg, cells)
    clusters = _extent(
        svg, r'<g id="clust\d+" class="cluster">\s*<title>[^<]*</title>\s*<path[^>]* d="([^"]+)"'
    )
    assert legend[3] < clusters[1] <= legend[3] + 30  # its bottom just above the clusters' top
    assert clusters[0] <= (legend[0] + legend[2]) / 2 <= clusters[2]
    assert len(re.findall(cells, svg)) == 6  # one swatch per colour category, all in the one legend
    title = re.search(r'<text[^>]*font-weight="bold" font-size="14.00">gpt2_small</text>', svg)
    assert title is not None and svg.index(title[0]) < svg.index('class="cluster"')


# ---------------------------------------------------------------------------------- notebooks


def test_a_diagram_shows_as_png_in_a_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    diagram = specvit.render("mnist_vit")
    png = diagram._repr_png_()
    assert png is not None and png.startswith(b"\x89PNG\r\n\x1a\n")
    assert png == render("mnist_vit", tmp_path / "m.png").read_bytes()  # the same drawing as a saved PNG
    assert diagram._repr_svg_() == render("mnist_vit", tmp_path / "m.svg").read_text()
    bare = specvit.render("mnist_vit", direction="LR")
    monkeypatch.setitem(sys.modules, "pygraphviz", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert bare._repr_png_() is None and bare._repr_svg_() is None  # the text repr is shown instead
