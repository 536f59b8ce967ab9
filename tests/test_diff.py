"""`specvit diff A B`: node-by-node differences with parameter and FLOP deltas, as text, JSON and a diagram."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import specvit
from specvit.cli import main
from specvit.diagram.diff import diff_graphs, format_diff, highlight
from specvit.diagram.graphviz import to_dot


def test_depth_width_and_head_changes_fold_over_blocks() -> None:
    a = specvit.build_graph("vit_base_patch16_224")
    b = specvit.build_graph("vit_base_patch16_224", {"encoder.depth": 6, "encoder.block.mlp.ratio": 2})
    rows = diff_graphs(a, b)
    assert [(r.status, r.path, r.count) for r in rows] == [
        ("changed", "encoder.blocks.0-5.mlp", 6),
        ("removed", "encoder.blocks.6-11", 6),
    ]
    removed_params = sum(a[n]["params"] for n in a if a[n]["block"] == "encoder.blocks.6") * 6
    assert rows[1].before is not None and rows[1].before[1] * 6 == removed_params  # per block, x6
    mlp = rows[0]
    assert mlp.before is not None and mlp.after is not None
    changed = (mlp.after[1] - mlp.before[1]) * 6
    assert b.total_params - a.total_params == changed - removed_params  # the rows account for the total


def test_added_nodes_and_rewiring_are_found() -> None:
    rows = diff_graphs(
        specvit.build_graph("transformer_base"), specvit.build_graph("transformer_base_prenorm")
    )
    statuses = {(r.status, r.path) for r in rows}
    assert ("added", "encoder.norm") in statuses and ("added", "decoder.norm") in statuses
    assert ("rewired", "encoder.blocks.0-5.norm1") in statuses  # post -> pre: same nodes, other inputs
    assert not any(r.status in ("changed", "removed") for r in rows)


def test_the_same_model_has_no_differences() -> None:
    g = specvit.build_graph("swin_tiny_patch4_window7_224")
    assert diff_graphs(g, g) == []
    assert format_diff(g, g).endswith("the two models are the same, node for node")


def test_cli_diff_text_json_and_diagram(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["diff", "gpt2_small", "gpt2_small", "--set", "decoder.block.kv_heads=4"]
    assert main(argv) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[2] == "B - A: -9.4M params, -2.4G FLOPs; 1 difference"
    assert re.fullmatch(
        r"changed\s+decoder\.blocks\.0-11\.attn\s+self_attention\s.*-9\.4M\s+-2\.4G", text[-1]
    )
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # 12 blocks x (k and v) x (768 x 512 weights + 512 biases) fewer: 4 kv heads of 64 instead of 12
    assert data["b"]["params"] - data["a"]["params"] == -12 * 2 * (768 * 512 + 512)
    assert [r["path"] for r in data["rows"]] == ["decoder.blocks.0-11.attn"]
    out = tmp_path / "d.dot"
    assert main([*argv, "-o", str(out)]) == 0
    marked = [line for line in out.read_text().splitlines() if "penwidth=3" in line]
    assert len(marked) == 1 and marked[0].strip().startswith('"decoder.blocks.0.attn"')


def test_highlight_marks_only_what_b_draws() -> None:
    a = specvit.build_graph("vit_tiny_patch16_224")
    b = specvit.build_graph("vit_tiny_patch16_224", {"encoder.depth": 6, "head.classes": 10})
    dot = highlight(to_dot(b), diff_graphs(a, b))
    assert [line.strip().split(" [")[0] for line in dot.splitlines() if "penwidth=3" in line] == [
        '"head.fc"',
        "output",
    ]  # the removed blocks 6-11 are not in B's diagram; the text lists them
