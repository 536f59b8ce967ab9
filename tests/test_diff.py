"""`specvit diff A B`: node-by-node differences with parameter and FLOP deltas, as text, JSON and a diagram."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import specvit
from specvit.cli import main
from specvit.diagram.diff import diff_graphs, diff_json, format_diff, highlight, marked, row_text
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
    assert text[:3] == [
        "A: gpt2_small  124.4M params  32.2G FLOPs (2 x MACs; useful 31.9G) at B=1, S=128",
        "B: gpt2_small  115.0M params  29.8G FLOPs (2 x MACs; useful 29.5G) at B=1, S=128",
        "B - A: -9.4M params, -2.4G FLOPs (useful -2.4G); 1 difference",
    ]
    assert text[4].split() == ["path", "op", "what", "changed", "params", "FLOPs", "useful", "FLOPs"]
    assert re.fullmatch(
        r"changed\s+decoder\.blocks\.0-11\.attn\s+self_attention\s.*-9\.4M\s+-2\.4G\s+-2\.4G", text[-1]
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
    rows = diff_graphs(a, b)
    dot = highlight(to_dot(b), marked(rows, b))
    assert [line.strip().split(" [")[0] for line in dot.splitlines() if "penwidth=3" in line] == [
        '"head.fc"'
    ]  # the removed blocks 6-11 are not in B's diagram; the text lists them
    # the output is reshaped by head.fc's change, not changed itself: listed, not outlined
    assert ("reshaped", "output") in {(r.status, r.path) for r in rows}


# -- every kind of setting is reported, in words -------------------------------------------------------

TINY = "vit_tiny_patch16_224"


def _said(preset: str, a: dict[str, object], b: dict[str, object]) -> list[tuple[str, str, str]]:
    """The rows of ``preset`` with overrides ``a`` against ``b``: (status, path, what the row says)."""
    rows = diff_graphs(specvit.build_graph(preset, a), specvit.build_graph(preset, b))
    return [(r.status, r.path, row_text(r)) for r in rows]


ENCODER_RESHAPED_197_201 = [
    ("reshaped", f"encoder.blocks.0-11.{n}", "shape (B, 197, 192) -> (B, 201, 192)")
    for n in ("norm1", "attn", "add1", "norm2", "mlp", "add2")
] + [("reshaped", "encoder.norm", "shape (B, 197, 192) -> (B, 201, 192)")]

SETTINGS = {  # one pair per kind of setting: (preset, overrides of A, overrides of B, the rows quoted)
    "activation": (TINY, {}, {"encoder.block.mlp.activation": "relu"}, [
        ("changed", "encoder.blocks.0-11.mlp", "activation gelu -> relu")]),
    "eps": (TINY, {}, {"encoder.block.norm.eps": 1e-5}, [
        ("changed", "encoder.blocks.0-11.norm1", "eps 1e-06 -> 1e-05"),
        ("changed", "encoder.blocks.0-11.attn", "eps 1e-06 -> 1e-05"),  # its QK-norm's eps, a setting too
        ("changed", "encoder.blocks.0-11.norm2", "eps 1e-06 -> 1e-05"),
        ("changed", "encoder.norm", "eps 1e-06 -> 1e-05")]),
    "norm_kind": (TINY, {}, {"encoder.block.norm.kind": "rmsnorm"}, [
        ("changed", "encoder.blocks.0-11.norm1", "op layernorm -> rmsnorm"),
        ("changed", "encoder.blocks.0-11.norm2", "op layernorm -> rmsnorm"),
        ("changed", "encoder.norm", "op layernorm -> rmsnorm")]),
    "norm_placement": (TINY, {}, {"encoder.block.norm.placement": "post"}, [
        ("rewired", "encoder.blocks.0-11.norm1", "norm placement: reads x -> add1; feeds attn -> add2, mlp"),
        ("rewired", "encoder.blocks.0-11.attn", "reads norm1 -> x"),
        ("rewired", "encoder.blocks.0-11.norm2", "norm placement: reads add1 -> add2; feeds mlp -> out"),
        ("rewired", "encoder.blocks.0-11.mlp", "reads norm2 -> norm1"),
        ("rewired", "encoder.blocks.0-11.add2", "reads add1 -> norm1"),
        ("rewired", "encoder.norm", "norm placement: reads encoder.blocks.*.add2 -> encoder.blocks.*.norm2")]),
    "heads": (TINY, {}, {"encoder.block.heads": 6}, [
        ("changed", "encoder.blocks.0-11.attn", "heads 3 -> 6; kv_heads 3 -> 6; head_dim 64 -> 32")]),
    "heads_same_params_and_flops": ("vit_base_patch16_224", {}, {"encoder.block.heads": 8}, [
        ("changed", "encoder.blocks.0-11.attn", "heads 12 -> 8; kv_heads 12 -> 8; head_dim 64 -> 96")]),
    "head_dim": (TINY, {}, {"encoder.block.head_dim": 32}, [
        ("changed", "encoder.blocks.0-11.attn", "head_dim 64 -> 32")]),
    "kv_heads": ("gpt2_small", {}, {"decoder.block.kv_heads": 4}, [
        ("changed", "decoder.blocks.0-11.attn", "kv_heads 12 -> 4")]),
    "pool": ("eva02_tiny_patch14_224", {}, {"head.pool": "cls"}, [
        ("changed", "head.pool", "kind mean -> cls")]),
    "sliding_window_removed": ("mistral_7b", {}, {"decoder.block.sliding_window": None}, [
        ("changed", "decoder.blocks.0-31.attn", "window 4096 -> none")]),
    "window_size": ("swin_tiny_patch4_window7_224", {}, {"encoder.block.window.size": 14}, [
        ("changed", "encoder.stages.0.blocks.0.attn", "window 7 -> 14"),
        ("changed", "encoder.stages.0.blocks.1.attn", "window 7 -> 14; shift 3 -> 7"),
        ("changed", "encoder.stages.1.blocks.0.attn", "window 7 -> 14"),
        ("changed", "encoder.stages.1.blocks.1.attn", "window 7 -> 14; shift 3 -> 7"),
        ("changed", "encoder.stages.2.blocks.0,2,4.attn", "window 7 -> 14"),  # a stage of 14x14: one window
        ("changed", "encoder.stages.2.blocks.1,3,5.attn", "window 7 -> 14; shift 3 -> 0")]),
    "rope_base": ("llama_smollm_135m", {}, {"decoder.position.base": 500000.0}, [
        ("changed", "decoder.rope", "base 10000 -> 500000")]),
    "position_kind": (TINY, {}, {"encoder.position": "sincos2d"}, [
        ("rewired", "encoder.prefix", "reads encoder.patch_embed -> encoder.pos_embed"),
        ("changed", "encoder.pos_embed", "op pos_learned -> pos_sincos2d; shape (B, 197, 192) -> (B, 196, 192); "
         "reads encoder.prefix -> encoder.patch_embed")]),
    "qkv_bias": (TINY, {}, {"encoder.block.qkv_bias": [True, False, True]}, [
        ("changed", "encoder.blocks.0-11.attn", "qkv_bias (true, true, true) -> (true, false, true)")]),
    "dropout": ("gpt2_small", {}, {"decoder.dropout.attention": 0.2, "decoder.dropout.embedding": 0.2}, [
        ("changed", "decoder.pos_drop", "p 0.1 -> 0.2"),
        ("changed", "decoder.blocks.0-11.attn", "attn_drop 0.1 -> 0.2")]),
    "drop_path_rate": ("deit_small_patch16_224", {}, {"encoder.drop_path": 0.2}, [
        ("changed", "encoder.blocks.1-11.drop_path1", "p 0.009091..0.1 -> 0.018182..0.2"),
        ("changed", "encoder.blocks.1-11.drop_path2", "p 0.009091..0.1 -> 0.018182..0.2")]),
    "init": (TINY, {}, {"init": "xavier"}, [
        ("changed", "model", "init vit -> xavier"),
        ("changed", "head.fc", "zero_init true -> false")]),
    "mlp_hidden": (TINY, {}, {"encoder.block.mlp.ratio": 2}, [
        ("changed", "encoder.blocks.0-11.mlp", "hidden 768 -> 384")]),
    "layer_scale_value": (TINY, {"encoder.block.layer_scale": 1e-5}, {"encoder.block.layer_scale": 1e-4}, [
        ("changed", "encoder.blocks.0-11.ls1", "init 1e-05 -> 0.0001"),
        ("changed", "encoder.blocks.0-11.ls2", "init 1e-05 -> 0.0001")]),
    "layer_scale_added": (TINY, {}, {"encoder.block.layer_scale": 1e-5}, [
        ("added", "encoder.blocks.0-11.ls1", "(B, 197, 192), 192 params each"),
        ("rewired", "encoder.blocks.0-11.add1", "reads branch=attn -> branch=ls1"),
        ("added", "encoder.blocks.0-11.ls2", "(B, 197, 192), 192 params each"),
        ("rewired", "encoder.blocks.0-11.add2", "reads branch=mlp -> branch=ls2")]),
    "prefix_tokens": (TINY, {}, {"encoder.prefix.registers": 4}, [
        ("changed", "encoder.prefix", "registers 0 -> 4; shape (B, 197, 192) -> (B, 201, 192)"),
        ("changed", "encoder.pos_embed", "max_len 197 -> 201; shape (B, 197, 192) -> (B, 201, 192)"),
        *ENCODER_RESHAPED_197_201,
        ("changed", "head.pool", "prefix 1 -> 5")]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SETTINGS))
def test_each_kind_of_setting_is_reported_in_words(case: str) -> None:
    preset, a, b, expected = SETTINGS[case]
    assert _said(preset, a, b) == expected


def test_a_diff_blind_to_settings_misses_the_activation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of the claim above: comparing shapes, parameters and FLOPs only (the old diff) calls
    gelu -> relu the same model; the settings make the difference."""
    import specvit.diagram.compare as compare

    preset, a, b, expected = SETTINGS["activation"]
    assert _said(preset, a, b) == expected
    monkeypatch.setattr(compare, "settings", lambda p: {})
    assert _said(preset, a, b) == []


def test_a_kv_cache_layer_index_is_no_setting() -> None:
    """A second attention in block 0 shifts the cache index of every later layer: not a difference of theirs."""
    two = {
        "decoder.overrides": [{"layers": [0], "block": {"layers": ["masked_self_attention"] * 2 + ["mlp"]}}]
    }
    a, b = specvit.build_graph("gpt2_small"), specvit.build_graph("gpt2_small", two)
    assert a["decoder.blocks.1.attn"]["p"].layer != b["decoder.blocks.1.attn"]["p"].layer  # it did shift
    rows = diff_graphs(a, b)
    assert rows and all(r.path.startswith("decoder.blocks.0.") for r in rows)


DEFAULTS_SPELLED_OUT = """
specvit: 1
name: vit_tiny_patch16_224
model: encoder
init: vit
encoder:
  input: {kind: image, size: [224, 224], patch: [16, 16], channels: 3, projection: conv, bias: true}
  prefix: {cls: true, distillation: false, registers: 0}
  position: {kind: learned, include_prefix: true, offset: 0}
  width: 192
  depth: 12
  block:
    heads: 3
    kv_heads: 3
    head_dim: 64
    layers: [self_attention, mlp]
    norm: {kind: layernorm, placement: pre, eps: 1.0e-6, bias: true}
    parallel: false
    mlp: {hidden: 768, activation: gelu, bias: true, norm: false}
    qkv_bias: [true, true, true]
    proj_bias: true
    qk_norm: false
    attention_scale: null
    sliding_window: null
    layer_scale: null
    window: null
  dropout: {embedding: 0.0, attention: 0.0, projection: 0.0, mlp: 0.0}
  drop_path: 0.0
  embed_norm: false
  final_norm: true
head: {kind: classifier, pool: cls, classes: 1000, norm: false, bias: true, dropout: 0.0}
"""


def test_a_spec_with_its_defaults_spelled_out_is_the_same(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(DEFAULTS_SPELLED_OUT)
    a, b = specvit.build_graph(TINY), specvit.build_graph(str(path))
    assert diff_graphs(a, b) == []
    assert format_diff(a, b).endswith("the two models are the same, node for node")
    assert diff_json(a, b)["same"] is True
    path.write_text(DEFAULTS_SPELLED_OUT.replace("eps: 1.0e-6", "eps: 1.0e-5"))  # and one setting off is not
    assert not diff_json(a, specvit.build_graph(str(path)))["same"]


def test_json_rows_give_each_field_before_and_after(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", TINY, TINY, "--json", "--set", "encoder.block.heads=6"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["same"] is False and data["a"]["params"] == data["b"]["params"]
    (row,) = data["rows"]
    assert (row["status"], row["path"], row["op"], row["count"]) == (
        "changed", "encoder.blocks.0-11.attn", "self_attention", 12)  # fmt: skip
    assert row["paths"] == [f"encoder.blocks.{i}.attn" for i in range(12)]
    assert row["changes"] == {
        "heads": {"before": 3, "after": 6, "per_block": False, "text": "heads 3 -> 6"},
        "kv_heads": {"before": 3, "after": 6, "per_block": False, "text": "kv_heads 3 -> 6"},
        "head_dim": {"before": 64, "after": 32, "per_block": False, "text": "head_dim 64 -> 32"},
    }
    assert row["before"] == {
        "shape": ["B", 197, 192],
        "params": row["after"]["params"],
        "flops": row["after"]["flops"],
        "useful_flops": row["after"]["flops"],  # no mask: all of a ViT's attention is used
    }
    assert (
        main(
            [
                "diff",
                "deit_small_patch16_224",
                "deit_small_patch16_224",
                "--json",
                "--set",
                "encoder.drop_path=0.2",
            ]
        )
        == 0
    )
    rate = json.loads(capsys.readouterr().out)["rows"][0]["changes"]["p"]  # per block, aligned with paths
    assert rate["per_block"] is True and len(rate["before"]) == len(rate["after"]) == 11
    assert rate["after"] == pytest.approx([2 * x for x in rate["before"]], abs=1e-5)  # rates kept to 6 places
    assert rate["after"][-1] == 0.2
    assert main(["diff", TINY, TINY, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) | {"a": None, "b": None} == {
        "unit": "FLOPs (2 x MACs)",
        "a": None,
        "b": None,
        "same": True,
        "rows": [],
    }


def _outlined(dot: str) -> set[str]:
    return {line.strip().split(" [")[0].strip('"') for line in dot.splitlines() if "penwidth=3" in line}


def test_o_outlines_the_nodes_that_differ_by_themselves_not_what_they_reshape(tmp_path: Path) -> None:
    """A larger image: the input, the patch embedding and the position table change; every block after
    them is reshaped, listed in the text, and not outlined."""
    out = tmp_path / "d.dot"
    assert main(["diff", TINY, TINY, "--set", "encoder.input.size=384", "-o", str(out)]) == 0
    assert _outlined(out.read_text()) == {"encoder.input", "encoder.patch_embed", "encoder.pos_embed"}
    a, b = specvit.build_graph(TINY), specvit.build_graph(TINY, {"encoder.input.size": 384})
    rows = diff_graphs(a, b)
    assert marked(rows, b) == {"encoder.input", "encoder.patch_embed", "encoder.pos_embed"}
    assert {r.status for r in rows} == {"changed", "reshaped"}
    assert [r.path for r in rows if r.status == "reshaped"][:2] == [
        "encoder.prefix",
        "encoder.blocks.0-11.norm1",
    ]


def test_o_outlines_each_drawn_box_of_a_changed_run() -> None:
    """Collapsed, a run of 12 is one box; expanded, 12; Swin's alternating blocks are two boxes per stage."""
    a, b = specvit.build_graph(TINY), specvit.build_graph(TINY, {"encoder.block.heads": 6})
    rows = diff_graphs(a, b)
    assert marked(rows, b) == {"encoder.blocks.0.attn"}
    expanded = {f"encoder.blocks.{i}.attn" for i in range(12)}
    assert marked(rows, b, "expanded") == expanded == _outlined(highlight(to_dot(b, "expanded"), expanded))
    swin = "swin_tiny_patch4_window7_224"
    a, b = specvit.build_graph(swin), specvit.build_graph(swin, {"encoder.block.window.size": 14})
    # stage 0's attention, and the boxes drawing its shifted block and stages 1 and 2 (stage 2, 14x14, is one
    # unshifted window now); stage 3 (7x7) is unchanged
    assert marked(diff_graphs(a, b), b) == {
        "encoder.stages.0.blocks.0.attn",
        "encoder.stages.0.blocks.1",
        "encoder.stages.1.blocks.0-1",
        "encoder.stages.2",
    }
    rewired = specvit.build_graph(TINY, {"encoder.block.norm.placement": "post"})
    assert marked(diff_graphs(specvit.build_graph(TINY), rewired), rewired) == {
        "encoder.blocks.0.norm1", "encoder.blocks.0.attn", "encoder.blocks.0.norm2", "encoder.blocks.0.mlp",
        "encoder.blocks.0.add2", "encoder.norm"}  # fmt: skip
