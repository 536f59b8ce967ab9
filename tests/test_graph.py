"""The architecture graph: parameter counts of real models, FLOPs, shapes, verifier, summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specvit
from specvit import SpecError
from specvit.graph import build_graph, verify

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "specs").glob("*.yaml"))


def _graph(name: str, **sizes: int) -> specvit.ArchGraph:
    return build_graph(specvit.load_spec(ROOT / "specs" / f"{name}.yaml"), **sizes)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------- parameter counts

TIMM_VIT = {  # timm's reported counts, 1000-class heads
    "vit_tiny_patch16_224": 5_717_416,
    "vit_small_patch16_224": 22_050_664,
    "vit_base_patch16_224": 86_567_656,
    "vit_large_patch16_224": 304_326_632,
    "vit_huge_patch14_224": 632_045_800,
}


@pytest.mark.parametrize("name", sorted(TIMM_VIT))
def test_vit_params_equal_timm_and_hf(name: str) -> None:
    from transformers import ViTConfig, ViTForImageClassification

    spec = specvit.load_spec(ROOT / "specs" / f"{name}.yaml")
    enc = spec.encoder
    assert enc is not None and enc.input.kind == "image"
    config = ViTConfig(
        hidden_size=enc.width,
        num_hidden_layers=enc.depth,
        num_attention_heads=enc.block.heads,
        intermediate_size=enc.mlp_hidden,
        image_size=224,
        patch_size=enc.input.patch[0],
        num_labels=1000,
    )
    with torch.device("meta"):
        hf = ViTForImageClassification(config)
    graph = build_graph(spec)
    assert graph.total_params == TIMM_VIT[name] == _count(hf)


def test_bert_params_equal_hf() -> None:
    from transformers import BertConfig, BertModel

    with torch.device("meta"):
        hf = BertModel(BertConfig(), add_pooling_layer=False)
    assert _graph("bert_base").total_params == _count(hf) == 108_891_648


def test_gpt2_params_equal_hf() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config())
    assert _graph("gpt2_small").total_params == _count(hf) == 124_439_808


def test_transformer_params_equal_torch() -> None:
    graph = _graph("transformer_base")
    with torch.device("meta"):
        core = torch.nn.Transformer(
            d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6, dim_feedforward=2048
        )
    # torch.nn.Transformer always has final norms (2 x 1024) and no embeddings; the paper's model has
    # no final norms and one shared 37000 x 512 embedding (tied to the output layer).
    assert graph.total_params == _count(core) - 2 * 1024 + 37000 * 512


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_node_params_add_up(preset: Path) -> None:
    graph = build_graph(specvit.load_spec(preset))
    rows = graph.summary()
    assert sum(r.params * r.count for r in rows) == graph.total_params
    assert sum(r.flops * r.count for r in rows) == graph.total_flops
    assert graph.total_params == sum(graph[n]["params"] for n in graph.module_nodes())


# ---------------------------------------------------------------------------------------------- FLOPs


def test_vit_base_flops_by_hand() -> None:
    graph = _graph("vit_base_patch16_224")
    n, d, h = 197, 768, 3072
    per_block = 2 * n * d * 3 * d + 2 * (2 * n * n * d) + 2 * n * d * d + 2 * (2 * n * d * h)
    patch = 2 * 196 * (3 * 16 * 16) * d
    head = 2 * d * 1000
    assert graph.total_flops == patch + 12 * per_block + head == 35_127_656_448
    assert graph["encoder.blocks.0.attn"]["flops"] == 2 * n * d * 3 * d + 4 * n * n * d + 2 * n * d * d


def test_flops_scale_with_batch_and_length() -> None:
    one = _graph("gpt2_small", seq_len=64)
    four = _graph("gpt2_small", batch=4, seq_len=64)
    assert four.total_flops == 4 * one.total_flops
    n, d, v = 64, 768, 50257
    attn = 2 * n * d * 3 * d + 4 * n * n * d + 2 * n * d * d
    mlp = 2 * 2 * n * d * 4 * d
    assert one.total_flops == 12 * (attn + mlp) + 2 * n * d * v


def test_cross_attention_flops_use_both_lengths() -> None:
    g = _graph("transformer_base", src_len=100, tgt_len=30)
    d = 512
    assert g["decoder.blocks.0.cross_attn"]["flops"] == (
        2 * 30 * d * d + 2 * 100 * d * 2 * d + 4 * 30 * 100 * d + 2 * 30 * d * d
    )


# --------------------------------------------------------------------------------------- shapes, nodes


def test_vit_shapes_and_sources() -> None:
    g = _graph("vit_base_patch16_224")
    assert g["encoder.input"]["shape"] == ("B", 3, 224, 224)
    assert g["encoder.patch_embed"]["shape"] == ("B", 196, 768)
    assert g["encoder.prefix"]["shape"] == ("B", 197, 768)
    assert g["encoder.blocks.11.attn"]["p"].heads == 12
    assert g["head.fc"]["shape"] == ("B", 1000)
    assert g["encoder.blocks.3.attn"]["source"].endswith("vit_base_patch16_224.yaml:16:14")
    assert g.dims == {"B": 1}


def test_encoder_decoder_shapes_and_memory_edges() -> None:
    g = _graph("transformer_base", src_len=20, tgt_len=7)
    assert g.dims == {"B": 1, "S_src": 20, "S_tgt": 7}
    assert g["encoder.blocks.0.attn"]["shape"] == ("B", "S_src", 512)
    assert g["decoder.blocks.0.cross_attn"]["inputs"] == {
        "x": ("B", "S_tgt", 512),
        "memory": ("B", "S_src", 512),
        "memory_mask": ("B", "S_src"),
        "cache": (),
    }
    memory_edges = [(u, v) for u, v, p in g.nx.edges(data="port") if p == "memory"]
    assert memory_edges == [("encoder.blocks.5.norm2", f"decoder.blocks.{i}.cross_attn") for i in range(6)]
    assert g["head.fc"]["p"].tied_to == "encoder.tok_embed"
    assert g["decoder.tok_embed"]["params"] == 0 and g["head.fc"]["params"] == 0


def test_pre_and_post_norm_wire_differently() -> None:
    pre, post = _graph("transformer_base_prenorm"), _graph("transformer_base")
    assert list(pre.nx.successors("encoder.blocks.0.norm1")) == ["encoder.blocks.0.attn"]
    assert list(post.nx.predecessors("encoder.blocks.0.norm1")) == ["encoder.blocks.0.add1"]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_node_has_shape_source_and_verifies(preset: Path) -> None:
    g = build_graph(specvit.load_spec(preset))
    verify(g)
    for path, attrs in g.nx.nodes(data=True):
        assert all(isinstance(d, int) and d > 0 for d in g.concrete(attrs["shape"])), path
        if attrs["op"] != "output":  # a preset that extends another points into its base for inherited keys
            assert Path(attrs["source"].split(":")[0]).parent == preset.parent, path


def test_verifier_names_node_and_line() -> None:
    g = _graph("vit_base_patch16_224")
    g["encoder.blocks.2.mlp"]["inputs"]["x"] = ("B", 197, 512)
    g.nx.remove_edge("encoder.blocks.5.norm1", "encoder.blocks.5.attn")
    with pytest.raises(SpecError) as info:
        verify(g)
    text = str(info.value)
    assert (
        "encoder.blocks.2.mlp: input 'x' from encoder.blocks.2.norm2 has shape (B, 197, 768), expected (B, 197, 512)"
        in text
    )
    assert "encoder.blocks.5.attn: has no input" in text
    assert "vit_base_patch16_224.yaml:16:14" in text  # block.layers.0, where attention came from


# ----------------------------------------------------------------------------------------------- summary


def test_summary_folds_identical_blocks() -> None:
    g = _graph("vit_base_patch16_224")
    folded, expanded = g.summary(), g.summary(expand=True)
    assert len(expanded) == len(g) == 80
    assert len(folded) == 14
    row = next(r for r in folded if r.path == "encoder.blocks.0-11.attn")
    assert (row.count, row.params) == (12, 2_362_368)


def test_summary_cli_json_and_table() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "specvit.cli",
            "summary",
            "specs/gpt2_small.yaml",
            "--batch",
            "2",
            "--seq-len",
            "64",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["total_params"] == 124_439_808
    assert data["dims"] == {"B": 2, "S": 64}
    assert data["total_flops"] == _graph("gpt2_small", batch=2, seq_len=64).total_flops
    assert data["rows"][0] == {
        "path": "decoder.input",
        "op": "input",
        "shape": ["B", "S"],
        "params": 0,
        "flops": 0,
        "useful_flops": 0,
        "count": 1,
    }
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "summary", "specs/vit_base_patch16_224.yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    table = run.stdout.splitlines()
    assert table[0].split() == [
        "path",
        "op",
        "output",
        "shape",
        "params",
        "param",
        "%",
        "FLOPs",
        "output",
        "x",
    ]
    # 2,362,368 params, 2.7% of 86.6M, per block; 197 x 768 float32 outputs = 605,184 bytes
    assert (
        "encoder.blocks.0-11.attn   self_attention  (B, 197, 768)       2.4M     2.7%    1.0G  605.2KB  x12"
        in table
    )
    assert table[-4:] == [
        "xN rows: a run of N identical blocks shown once; their numbers are per block, totals count all",
        "total params:           86,567,656 (86.6M; trainable 86,567,656, non-trainable 0)",
        "total FLOPs (2 x MACs): 35,127,656,448 (35.1G) at B=1",
        "memory (float32): params 346.3MB, outputs of every node 46.6MB at B=1",
    ]


def test_summary_param_shares_add_up_and_counts_have_one_format() -> None:
    from specvit.diagram.text import format_table
    from specvit.units import format_count

    graph = _graph("vit_tiny_patch16_224")
    rows = format_table(graph, expand=True).splitlines()[2:-4]
    shares = [float(c.rstrip("%")) for r in rows for c in r.split() if c.endswith("%")]
    assert abs(sum(shares) - 100.0) < 0.05 * len(shares)  # each rounded to 0.1%
    assert [format_count(n) for n in (950, 1936, 148_352, 2_362_368, 999_960, 35_127_656_448)] == [
        "950", "1.9K", "148.4K", "2.4M", "1.0M", "35.1G"
    ]  # fmt: skip


def test_seq_len_beyond_learned_table_is_an_error() -> None:
    with pytest.raises(SpecError, match="longer than the 1024 learned positions"):
        _graph("gpt2_small", seq_len=2048)
