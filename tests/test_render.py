"""Diagrams: DOT and Mermaid text, folding, memory and residual edges, formats, engines, atomic writes."""

from __future__ import annotations

import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import specvit
from specvit.cli import main as main_cli
from specvit.diagram import RenderError, gallery, render, to_dot, to_mermaid
from specvit.diagram.graphviz import View
from specvit.graph import build_graph
from specvit.units import format_count

ROOT = Path(__file__).resolve().parents[1]

NODE = re.compile(r'^\s*"?([^"\s]+(?: \(caption\))?)"? \[(.*)\]$', re.M)
EDGE = re.compile(r'^\s*"?([^"\s]+)"? -> "?([^"\s]+)"?(?: \[(.*)\])?$', re.M)


def _graph(name: str, **overrides: int) -> specvit.ArchGraph:
    return build_graph(specvit.load_spec(ROOT / "specs" / f"{name}.yaml", overrides=overrides))


def _nodes(dot: str) -> dict[str, str]:
    """Node id -> its attribute text, for every node statement of the DOT text."""
    return {n: attrs for n, attrs in NODE.findall(dot) if n not in ("graph", "node", "edge")}


def _clusters(dot: str) -> list[str]:
    """The names of the clusters of the DOT text, in order."""
    return re.findall(r'subgraph "?cluster_([^"\s]+)"? \{', dot)


def _edges(dot: str) -> list[tuple[str, str, str]]:
    """(tail, head, attributes) of every edge statement of the DOT text."""
    return [(u, v, attrs or "") for u, v, attrs in EDGE.findall(dot)]


# ---------------------------------------------------------------------------------- DOT text


def test_dot_of_mnist_vit_labels_every_node() -> None:
    dot = to_dot(_graph("mnist_vit"))
    nodes = _nodes(dot)
    assert dot.startswith("digraph mnist_vit {")
    attn = nodes["encoder.blocks.0.attn"]
    assert "<b>self_attention</b>" in attn
    assert "heads 2 · kv_heads 2 · head_dim 256" in attn
    assert "not causal" in attn
    assert "B x 17 x 512 · 1.1M params" in attn
    assert "hidden 1024 · gelu" in nodes["encoder.blocks.0.mlp"]
    assert "eps 1e-06" in nodes["encoder.blocks.0.norm1"]
    assert "patch 7x7 · grid 4x4 · conv" in nodes["encoder.patch_embed"]
    assert "B x 16 x 512 · 25.6K params" in nodes["encoder.patch_embed"]
    assert "B x 1 x 28 x 28" in nodes["encoder.input"]
    assert "512 → 10" in nodes["head.fc"] and "B x 10 · 5.1K params" in nodes["head.fc"]
    assert "shape=circle" in nodes["encoder.blocks.0.add1"]
    # title: name, total params and FLOPs, and under them the legend
    title = re.findall(r"^\tgraph \[.*label=(<<TABLE.*</TABLE>>)", dot, re.M)[0]
    assert "<B>mnist_vit</B>" in title and "2.1M params · 72.7M FLOPs (2 x MACs) at B=1" in title
    # one colour per op kind, and a legend naming them: a swatch per colour in use, then the edge styles
    kinds = ("blocks.0.attn", "blocks.0.mlp", "blocks.0.norm1", "patch_embed", "input")
    fills = {re.findall(r'fillcolor="(#\w+)"', nodes[f"encoder.{n}"])[0] for n in kinds}
    fills.add(re.findall(r'fillcolor="(#\w+)"', nodes["head.fc"])[0])
    assert len(fills) == 6
    swatches = re.findall(r'<TD BGCOLOR="(#\w+)"[^>]*>([^<]+)</TD>', title)
    assert {fill for fill, _ in swatches} == fills and ("#fbd9bd", "attention") in swatches
    assert "residual (skip) into +" in title and "memory" not in title  # no encoder output here
    assert "legend" not in nodes and _clusters(dot) == ["encoder", "encoder.blocks.0", "head"]


def test_collapsed_view_draws_a_run_of_blocks_once() -> None:
    graph = _graph("vit_base_patch16_224")
    block_node = re.compile(r"encoder\.blocks\.(\d+)\.")

    def blocks_drawn(dot: str) -> list[str]:
        return [m.group(1) for n in _nodes(dot) if (m := block_node.match(n))]

    collapsed, expanded = to_dot(graph), to_dot(graph, view="expanded")
    assert len(blocks_drawn(collapsed)) == 6 and set(blocks_drawn(collapsed)) == {"0"}
    assert len(blocks_drawn(expanded)) == 72 and set(blocks_drawn(expanded)) == {str(i) for i in range(12)}
    assert "<b>encoder.blocks.0-11  x12</b>" in collapsed and "7.1M params per block" in collapsed
    assert "x12" not in expanded and "<b>encoder.blocks.11</b>" in expanded
    # edges enter the drawn block and leave it; none loops from the block back into itself
    edges = {(u, v) for u, v, _ in _edges(collapsed)}
    assert ("encoder.pos_embed", "encoder.blocks.0.norm1") in edges
    assert ("encoder.blocks.0.add2", "encoder.norm") in edges
    assert ("encoder.blocks.0.add2", "encoder.blocks.0.norm1") not in edges


def test_collapsed_view_of_96_blocks_is_small() -> None:
    """96 blocks draw as many boxes as 12: the work is the drawing's size, not the depth (its time is a
    benchmark row, not an assert here)."""
    dot = to_dot(_graph("vit_base_patch16_224", **{"encoder.depth": 96}))
    assert "<b>encoder.blocks.0-95  x96</b>" in dot
    assert len(_nodes(dot)) == len(_nodes(to_dot(_graph("vit_base_patch16_224"))))


@pytest.mark.parametrize(("view", "count"), [("collapsed", 1), ("expanded", 6)])
def test_memory_edges_reach_every_drawn_cross_attention(view: View, count: int) -> None:
    dot = to_dot(_graph("transformer_base"), view=view)
    cross = [n for n, attrs in _nodes(dot).items() if "<b>cross_attention</b>" in attrs]
    memory = [(u, v) for u, v, attrs in _edges(dot) if "style=dashed" in attrs]
    assert len(cross) == count
    assert sorted(v for _, v in memory) == sorted(cross)
    encoder_out = "encoder.blocks.0.norm2" if view == "collapsed" else "encoder.blocks.5.norm2"
    assert {u for u, _ in memory} == {encoder_out}
    assert all("constraint=false" in attrs for _, _, attrs in _edges(dot) if "style=dashed" in attrs)
    clusters = _clusters(dot)  # encoder and decoder, each block drawn, head
    assert clusters[0] == "encoder" and "decoder" in clusters and clusters[-1] == "head"
    assert "- - - memory: encoder output" in dot  # in the legend
    assert sum(c.startswith("decoder.blocks.") for c in clusters) == count


def test_pre_and_post_norm_blocks_are_wired_differently() -> None:
    post = {(u, v) for u, v, _ in _edges(to_dot(_graph("transformer_base")))}
    pre = {(u, v) for u, v, _ in _edges(to_dot(_graph("transformer_base_prenorm")))}
    b = "encoder.blocks.0"
    # post-norm: attention reads the block input, the norm follows the residual add
    assert {
        ("encoder.pos_drop", f"{b}.attn"),
        (f"{b}.add1", f"{b}.norm1"),
        (f"{b}.norm1", f"{b}.mlp"),
    } <= post
    # pre-norm: the norm comes first and the residual stream skips it
    assert {
        ("encoder.pos_drop", f"{b}.norm1"),
        (f"{b}.norm1", f"{b}.attn"),
        (f"{b}.add1", f"{b}.norm2"),
    } <= pre
    assert ("encoder.pos_drop", f"{b}.attn") not in pre and (f"{b}.add1", f"{b}.norm1") not in pre
    # in both the residual reaches the add straight from the block input
    assert ("encoder.pos_drop", f"{b}.add1") in pre & post


def test_residual_edges_are_styled_apart() -> None:
    edges = {(u, v): attrs for u, v, attrs in _edges(to_dot(_graph("gpt2_small")))}
    assert "#8c8c8c" in edges[("decoder.pos_drop", "decoder.blocks.0.add1")]
    assert "#8c8c8c" not in edges[("decoder.blocks.0.attn", "decoder.blocks.0.add1")]


def test_direction_and_bad_arguments() -> None:
    graph = _graph("mnist_vit")
    assert "rankdir=LR" in to_dot(graph, direction="LR") and "rankdir=TB" in to_dot(graph)
    with pytest.raises(ValueError, match="view"):
        to_dot(graph, view="folded")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="direction"):
        to_mermaid(graph, direction="BT")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- Mermaid


def test_mermaid_flowchart() -> None:
    text = to_mermaid(_graph("transformer_base"))
    lines = text.splitlines()
    assert lines[:4] == [
        "---",
        'title: "transformer_base · 63.1M params · 16.7G FLOPs (2 x MACs; useful 16.6G) at B=1, S_src=128, '
        'S_tgt=128"',
        "---",
        "flowchart TB",
    ]
    assert sum(line.strip().startswith("subgraph ") for line in lines) == 5  # encoder, decoder, 2 runs, head
    assert sum(line.strip() == "end" for line in lines) == 5
    assert 'subgraph sg_encoder_blocks_0["<b>encoder.blocks.0-5  x6</b><br/>3.2M params per block"]' in text
    memory = [line for line in lines if "-.->" in line]
    assert memory == ["  n_encoder_blocks_0_norm2 -.->|memory| n_decoder_blocks_0_cross_attn"]
    assert "heads 8 · kv_heads 8 · head_dim 64<br/>causal" in text
    ids = re.findall(r"^\s*(\w+)[\[(]", text, re.M)
    assert ids and all(re.fullmatch(r"[A-Za-z0-9_]+", i) for i in ids)
    for category in ("attention", "mlp", "norm", "embedding", "structural", "head"):
        assert f"classDef {category} fill:#" in text and re.search(rf"^  class \S+ {category}$", text, re.M)
    expanded = to_mermaid(_graph("transformer_base"), view="expanded", direction="LR")
    assert "flowchart LR" in expanded and expanded.count("-.->") == 6


# ---------------------------------------------------------------------------------- files


def test_render_writes_every_format(tmp_path: Path) -> None:
    spec_path = ROOT / "specs" / "mnist_vit.yaml"
    spec = specvit.load_spec(spec_path)
    graph = build_graph(spec)
    svg = render(spec_path, tmp_path / "m.svg")
    assert svg == tmp_path / "m.svg"
    assert ET.parse(svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    assert render(spec, tmp_path / "m.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert render(graph, tmp_path / "m.pdf").read_bytes().startswith(b"%PDF")
    assert render(graph, tmp_path / "m.dot", direction="LR").read_text() == to_dot(graph, direction="LR")
    assert render(graph, tmp_path / "m.mmd", view="expanded").read_text() == to_mermaid(
        graph, view="expanded"
    )
    with pytest.raises(RenderError, match=r"\.svg, \.png, \.pdf, \.dot, \.mmd"):
        render(graph, tmp_path / "m.jpg")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.dot", "m.mmd", "m.pdf", "m.png", "m.svg"]


def test_a_failing_engine_leaves_the_old_file_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pygraphviz

    out = tmp_path / "model.svg"
    out.write_text("old diagram")

    def boom(self: object, *args: object, **kwargs: object) -> bytes:
        assert list(tmp_path.glob(".model.svg.*.tmp")), "the engine runs while the temporary file is open"
        raise ValueError("Graphviz raised a layout error.")

    monkeypatch.setattr(pygraphviz.AGraph, "draw", boom)
    with pytest.raises(
        RenderError, match=r"Graphviz failed to draw .*model\.svg: Graphviz raised a layout error"
    ):
        render(_graph("mnist_vit"), out)
    assert out.read_text() == "old diagram"
    assert [p.name for p in tmp_path.iterdir()] == ["model.svg"]


def test_without_pygraphviz_the_system_dot_draws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import graphviz

    calls: list[str] = []

    def pipe(self: graphviz.Source, format: str) -> bytes:
        calls.append(format)
        return b"%PDF-1.5 drawn by dot"

    monkeypatch.setitem(sys.modules, "pygraphviz", None)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/dot" if name == "dot" else None)
    monkeypatch.setattr(graphviz.Source, "pipe", pipe)
    out = render(_graph("mnist_vit"), tmp_path / "m.pdf")
    assert calls == ["pdf"] and out.read_bytes() == b"%PDF-1.5 drawn by dot"


def test_without_any_engine_the_dot_file_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    graph = _graph("mnist_vit")
    monkeypatch.setitem(sys.modules, "pygraphviz", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = tmp_path / "m.png"
    with pytest.raises(RenderError) as info:
        render(graph, out)
    message = str(info.value)
    assert "pip install pygraphviz" in message and "apt-get install graphviz" in message
    assert f"dot -Tpng {tmp_path / 'm.dot'} -o {out}" in message
    assert not out.exists()
    assert (tmp_path / "m.dot").read_text() == to_dot(graph)
    assert [p.name for p in tmp_path.iterdir()] == ["m.dot"]


# ---------------------------------------------------------------------------------- gallery


def test_gallery_page_lists_the_diagrams_it_writes(tmp_path: Path) -> None:
    docs = ROOT / "docs"
    text = (docs / "diagrams.md").read_text()
    assert text == gallery.page(docs), "run: python -m specvit.diagram.gallery"
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert linked == [p.relative_to(docs).as_posix() for p in gallery.diagrams(docs)]
    assert all((docs / link).is_file() for link in linked)
    written = gallery.build(tmp_path)
    assert written == [*gallery.diagrams(tmp_path), tmp_path / "diagrams.md"]
    assert sorted((tmp_path / "diagrams").iterdir()) == sorted(gallery.diagrams(tmp_path))
    assert (tmp_path / "diagrams.md").read_text() == text


def test_cli_render_writes_file_and_refuses_unknown_extension(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "deep" / "gpt2.svg"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "specvit.cli",
            "render",
            "specs/gpt2_small.yaml",
            "-o",
            str(out),
            "--view",
            "expanded",
            "--direction",
            "LR",
            "--set",
            "decoder.depth=2",
        ],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert run.returncode == 0, run.stderr
    assert out.read_text().lstrip().startswith(("<?xml", "<svg", "<!DOCTYPE"))
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "specvit.cli",
            "render",
            "specs/gpt2_small.yaml",
            "-o",
            str(tmp_path / "x.txt"),
        ],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "the extension must be one of .svg, .png, .pdf, .dot, .mmd" in bad.stderr
    assert not (tmp_path / "x.txt").exists()


@pytest.mark.parametrize("preset", sorted((ROOT / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_preset_renders_to_svg(preset: Path, tmp_path: Path) -> None:
    """Every node's label is valid for Graphviz, those without a shape (a KV cache) included."""
    pytest.importorskip("pygraphviz")
    out = render(specvit.load_spec(preset), tmp_path / "model.svg")
    assert out.read_text().lstrip().startswith("<?xml")


def test_render_without_a_path_displays_inline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    diagram = specvit.render("mnist_vit")
    assert isinstance(diagram, specvit.diagram.Diagram) and "mnist_vit" in repr(diagram)
    svg = diagram._repr_svg_()
    assert svg is not None and ET.fromstring(svg).tag == "{http://www.w3.org/2000/svg}svg"
    assert diagram.dot == to_dot(_graph("mnist_vit"))
    assert diagram.save(tmp_path / "m.mmd").read_text() == to_mermaid(_graph("mnist_vit"))
    assert diagram.save(tmp_path / "m.svg").read_text() == svg
    with pytest.raises(RenderError, match="extension must be one of"):
        diagram.save(tmp_path / "m.gif")
    bare = specvit.render("mnist_vit", view="expanded")
    monkeypatch.setitem(sys.modules, "pygraphviz", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert bare._repr_svg_() is None  # Jupyter then shows the text repr, not a traceback
    with pytest.raises(RenderError, match="no Graphviz to lay out the diagram"):
        _ = bare.svg


def test_dpi_scales_a_png_and_is_refused_elsewhere(tmp_path: Path) -> None:
    import struct

    def size(path: Path) -> tuple[int, int]:
        return struct.unpack(">II", path.read_bytes()[16:24])  # the PNG's IHDR width and height

    graph = _graph("mnist_vit")
    w96, h96 = size(render(graph, tmp_path / "a.png", dpi=96))
    w192, h192 = size(render(graph, tmp_path / "b.png", dpi=192))
    assert abs(w192 / w96 - 2) < 0.02 and abs(h192 / h96 - 2) < 0.02
    with pytest.raises(RenderError, match=r"dpi 192 is for \.png files"):
        render(graph, tmp_path / "c.svg", dpi=192)
    assert not (tmp_path / "c.svg").exists()


def test_flops_on_the_nodes_on_request(tmp_path: Path) -> None:
    graph = _graph("mnist_vit")
    plain, with_flops = _nodes(to_dot(graph)), _nodes(to_dot(graph, flops=True))
    assert "FLOPs" not in plain["encoder.blocks.0.mlp"]
    mlp = graph["encoder.blocks.0.mlp"]["flops"]  # 35.7M at B=1
    assert f"1.1M params · {format_count(mlp)} FLOPs" in with_flops["encoder.blocks.0.mlp"]
    assert "FLOPs" not in with_flops["encoder.blocks.0.add1"]  # an add counts none: nothing to write
    assert set(plain) == set(with_flops)
    written = tmp_path / "m.dot"
    assert main_cli(["render", "mnist_vit", "--flops", "-o", str(written)]) == 0
    assert written.read_text() == to_dot(graph, flops=True)
