"""FLOPs say what they count: their unit (FLOPs = 2 x MACs, or MACs with --macs) and the sizes they were
counted at on every surface; attention under a causal mask or a sliding window counted both as a dense
kernel computes it and as its useful part; parameter counts in K/M/B."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import specvit
from specvit import demo
from specvit.cli import main
from specvit.codegen.check import module_flops
from specvit.diagram import render, to_mermaid
from specvit.diagram.diff import diff_json, format_diff
from specvit.diagram.graphviz import to_dot
from specvit.diagram.text import format_table
from specvit.export import example_inputs
from specvit.nn.attend import visible_keys
from specvit.ops.base import visible_pairs
from specvit.units import FLOPS, MACS, format_count, format_flops, format_params

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "specs").glob("*.yaml"))

TINY_LM: dict[str, Any] = {
    "specvit": 1,
    "name": "tiny_lm",
    "description": "A two-block causal LM, 64 wide.",
    "model": "decoder",
    "decoder": {
        "input": {"kind": "tokens", "vocab": 100},
        "position": {"kind": "learned", "max_len": 64},
        "width": 64,
        "depth": 2,
        "block": {
            "heads": 4,
            "layers": ["masked_self_attention", "mlp"],
            "norm": {"kind": "layernorm", "placement": "pre"},
            "mlp": {"ratio": 4},
        },
        "final_norm": True,
    },
    "head": {"kind": "lm", "tied": True},
}
B, N, D = 2, 10, 64  # batch, tokens, width (4 heads of 16)
PROJECTIONS = 2 * B * N * D * 3 * D + 2 * B * N * D * D  # qkv and out: 491,520 + 163,840 FLOPs
"""The attention's linears, which a mask does not touch."""
N_PAIRS_CAUSAL_128 = 128 * 129 // 2  # the pairs a causal mask keeps at summary's default length


def _products(pairs: int) -> int:
    """FLOPs of q·k and attention·v over ``pairs`` query-key pairs: 2 FLOPs per multiply-add, D of each."""
    return 2 * B * pairs * D + 2 * B * pairs * D


# -- useful attention FLOPs ------------------------------------------------------------------------------


def test_causal_attention_counts_half_the_pairs_plus_the_diagonal() -> None:
    graph = specvit.build_graph(TINY_LM, batch=B, seq_len=N)
    attn = graph["decoder.blocks.0.attn"]
    # a dense kernel computes all N x N = 100 pairs; the causal mask keeps N(N+1)/2 = 55 of them
    assert attn["flops"] == PROJECTIONS + _products(N * N) == 706_560
    assert attn["useful_flops"] == PROJECTIONS + _products(N * (N + 1) // 2) == 683_520
    hidden = 2 * (_products(N * N) - _products(N * (N + 1) // 2))  # two blocks, 45 pairs each
    assert graph.total_flops - graph.total_useful_flops == hidden == 46_080
    assert graph.masked and "S(S+1)/2 query-key pairs the mask keeps" in format_table(graph)


def test_a_sliding_window_counts_the_pairs_in_the_window() -> None:
    w = 4
    graph = specvit.build_graph(TINY_LM, {"decoder.block.sliding_window": w}, batch=B, seq_len=N)
    attn = graph["decoder.blocks.0.attn"]
    # query i sees keys i-3..i: 1, 2, 3 keys for the first three, then 4 each: w N - w (w - 1) / 2 = 34 pairs
    pairs = w * N - w * (w - 1) // 2
    assert pairs == 1 + 2 + 3 + 4 * (N - 3) == 34
    assert attn["flops"] == PROJECTIONS + _products(N * N) == 706_560  # the dense count does not change
    assert attn["useful_flops"] == PROJECTIONS + _products(pairs) == 672_768
    assert "sliding window of 4: useful counts only the query-key pairs in the window" in format_table(graph)


def test_a_bidirectional_window_counts_both_sides() -> None:
    graph = specvit.build_graph(
        "bert_base", {"encoder.depth": 1, "encoder.block.sliding_window": 4}, seq_len=N
    )
    attn, d = graph["encoder.blocks.0.attn"], 768
    pairs = N + 2 * (3 * N - 3 * 4 // 2)  # the diagonal, and offsets 1..3 on each side: 10 + 2 x 24 = 58
    assert attn["flops"] - attn["useful_flops"] == 4 * (N * N - pairs) * d == 129_024


def test_an_encoder_and_partition_windows_use_all_they_compute() -> None:
    """No mask, and Swin's windows (each computes only its own pairs): useful FLOPs are the FLOPs."""
    for name in ("bert_base", "vit_base_patch16_224", "swin_tiny_patch4_window7_224", "croco_vit_base"):
        graph = specvit.build_graph(name)
        assert all(graph[n]["useful_flops"] == graph[n]["flops"] for n in graph), name
        assert graph.total_useful_flops == graph.total_flops and not graph.masked
        assert "useful" not in format_table(graph)  # no column, no line, no note: nothing to tell apart


@pytest.mark.parametrize("causal", [True, False])
def test_the_pair_count_is_the_mask_the_layer_applies(causal: bool) -> None:
    """visible_pairs is the number of True entries of the mask the attention core builds, for every length
    and window; the dense count (no mask) is the control."""
    for n in range(1, 20):
        for window in (None, 1, 2, 3, 7, 19, 25):
            mask = visible_keys(n, n, 0, causal, window, torch.device("cpu"))
            assert visible_pairs(n, causal, window) == int(mask.sum()), (n, window)
    assert visible_pairs(10, False, None) == 100 != visible_pairs(10, True, None) == 55


def test_the_dense_count_is_what_flop_counter_mode_measures() -> None:
    """The FLOPs stay FlopCounterMode's (it counts a masked kernel whole); the useful ones are fewer."""
    torch.manual_seed(0)
    graph = specvit.build_graph(TINY_LM, {"decoder.block.sliding_window": 4}, batch=B, seq_len=N)
    model = specvit.build_model(graph).eval()
    with sdpa_kernel(SDPBackend.MATH):
        counted = module_flops(model, example_inputs(graph, B))
    assert counted == {n: graph[n]["flops"] for n in graph.module_nodes()}
    assert counted["decoder.blocks.0.attn"] > graph["decoder.blocks.0.attn"]["useful_flops"]


def test_shared_blocks_carry_their_useful_flops() -> None:
    graph = specvit.build_graph(TINY_LM, {"decoder.share": {"blocks": 1}}, batch=B, seq_len=N)
    (call,) = [n for n in graph if graph[n]["op"] == "call"]
    block = [n for n in graph if graph[n]["block"] == "decoder.blocks.0"]
    assert graph[call]["useful_flops"] == sum(graph[n]["useful_flops"] for n in block)
    assert graph[call]["useful_flops"] < graph[call]["flops"] == sum(graph[n]["flops"] for n in block)


# -- MACs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_count_halves_exactly_into_macs(preset: Path) -> None:
    graph = specvit.build_graph(specvit.load_spec(preset))
    for n in graph:
        for key in ("flops", "useful_flops"):
            assert graph[n][key] % 2 == 0 and 2 * MACS.of(graph[n][key]) == graph[n][key], (n, key)


@pytest.mark.parametrize("name", ["gpt2_small", "swin_tiny_patch4_window7_224", "t5_small"])
def test_summary_macs_is_half_the_flops_of_every_node(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    graph = specvit.build_graph(name)
    assert main(["summary", name, "--json", "--view", "expanded"]) == 0
    flops = json.loads(capsys.readouterr().out)
    assert main(["summary", name, "--json", "--view", "expanded", "--macs"]) == 0
    macs = json.loads(capsys.readouterr().out)
    assert (flops["unit"], macs["unit"]) == ("FLOPs (2 x MACs)", "MACs (multiply-adds)")
    assert [r["path"] for r in macs["rows"]] == [r["path"] for r in flops["rows"]] == list(graph)
    for f, m in zip(flops["rows"], macs["rows"], strict=True):
        node = graph[f["path"]]
        assert (f["flops"], f["useful_flops"]) == (node["flops"], node["useful_flops"])
        assert (2 * m["macs"], 2 * m["useful_macs"]) == (node["flops"], node["useful_flops"])
        assert "flops" not in m  # a key names its unit
    assert 2 * macs["total_macs"] == flops["total_flops"] == graph.total_flops
    assert 2 * macs["total_useful_macs"] == flops["total_useful_flops"] == graph.total_useful_flops


# -- every surface names its unit and its sizes -------------------------------------------------------------


def test_the_summary_table_names_its_unit_and_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", "gpt2_small"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[7:11] == ["FLOPs", "useful", "FLOPs", "output"]
    assert "total FLOPs (2 x MACs): 32,228,179,968 (32.2G) at B=1, S=128" in table
    assert "useful FLOPs:           31,928,549,376 (31.9G) at B=1, S=128" in table
    assert main(["summary", "gpt2_small", "--macs"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[7:11] == ["MACs", "useful", "MACs", "output"]
    assert "total MACs (multiply-adds): 16,114,089,984 (16.1G) at B=1, S=128" in table
    assert "useful MACs:                15,964,274,688 (16.0G) at B=1, S=128" in table
    attn = next(line.split() for line in table if ".attn " in line)
    per_block = specvit.build_graph("gpt2_small")["decoder.blocks.0.attn"]
    assert attn[7:9] == [format_count(per_block["flops"] // 2), format_count(per_block["useful_flops"] // 2)]


def test_diagrams_name_the_unit_and_sizes(tmp_path: Path) -> None:
    graph = specvit.build_graph("gpt2_small")
    dot = to_dot(graph, flops=True)
    assert "124.4M params · 32.2G FLOPs (2 x MACs; useful 31.9G) at B=1, S=128" in dot
    assert "654.3M FLOPs (useful 629.3M)" in dot  # an attention block: dense, and what its mask keeps
    assert "1.2G FLOPs" in dot and "MACs" not in dot.replace("2 x MACs", "")
    macs = to_dot(graph, flops=True, unit=MACS)
    assert "16.1G MACs (multiply-adds; useful 16.0G) at B=1, S=128" in macs
    assert "327.2M MACs (useful 314.7M)" in macs and " FLOPs" not in macs
    assert "16.1G MACs (multiply-adds; useful 16.0G) at B=1, S=128" in to_mermaid(graph, unit=MACS)
    out = tmp_path / "g.dot"
    assert main(["render", "gpt2_small", "--flops", "--macs", "-o", str(out)]) == 0
    assert out.read_text() == macs
    assert render(graph, macs=True).mermaid == to_mermaid(graph, unit=MACS)
    vit = to_dot(specvit.build_graph("vit_base_patch16_224"))
    assert "86.6M params · 35.1G FLOPs (2 x MACs) at B=1" in vit and "useful" not in vit


def test_diff_names_the_unit_and_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    a = specvit.build_graph("gpt2_small")
    b = specvit.build_graph("gpt2_small", {"decoder.block.sliding_window": 32})
    text = format_diff(a, b, unit=MACS).splitlines()
    assert text[0] == "A: gpt2_small  124.4M params  16.1G MACs (multiply-adds; useful 16.0G) at B=1, S=128"
    # removing pairs from the window changes no dense count: only the useful one, 12 x 1536 x 4656 MACs
    useful = 12 * (768 + 768) * (N_PAIRS_CAUSAL_128 - (32 * 128 - 32 * 31 // 2))
    assert b.total_flops == a.total_flops and a.total_useful_flops - b.total_useful_flops == 2 * useful
    assert text[2] == f"B - A: ±0 params, ±0 MACs (useful -{format_count(useful)}); 1 difference"
    assert text[4].split()[-3:] == ["MACs", "useful", "MACs"]
    assert re.fullmatch(
        r"changed\s+decoder\.blocks\.0-11\.attn\s+.*window none -> 32\s+±0\s+±0\s+-85\.8M", text[5]
    )
    data = diff_json(a, b, unit=MACS)
    assert data["unit"] == "MACs (multiply-adds)" and data["a"]["dims"] == {"B": 1, "S": 128}
    assert data["a"]["useful_macs"] - data["b"]["useful_macs"] == useful
    assert (
        data["rows"][0]["after"]["useful_macs"] * 12 - data["rows"][0]["before"]["useful_macs"] * 12
        == -useful
    )
    assert main(["diff", "gpt2_small", "gpt2_small", "--macs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["a"]["macs"] == a.total_flops // 2


def test_the_demo_counts_at_summarys_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's FLOPs are summary's, at the sizes printed beside them (it counted at 16 tokens before)."""
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("llama_smollm_135m", "mnist_vit"):
        shutil.copy(ROOT / "specs" / f"{name}.yaml", specs)
    monkeypatch.setattr(demo, "SPECS", specs)
    monkeypatch.setattr(demo, "OUT", tmp_path / "diagrams")
    monkeypatch.setattr(demo, "ROOT", tmp_path)
    assert demo.models() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[2:5] == ["FLOPs", "useful", "at"]
    assert "FLOPs (2 x MACs) of one forward at the sizes under 'at' (specvit summary's)" in out[-2]
    row = next(line for line in out if line.startswith("llama_smollm_135m"))
    assert main(["summary", "llama_smollm_135m"]) == 0
    total = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("total FLOPs"))
    assert total == "total FLOPs (2 x MACs): 35,559,309,312 (35.6G) at B=1, S=128"
    assert row.split()[2:6] == ["35.6G", "35.0G", "B=1,", "S=128"]
    assert "1x128" in row  # and it runs at that length
    at_16 = specvit.build_graph("llama_smollm_135m", seq_len=16).total_flops
    assert format_count(at_16) not in row.split()  # the control: the old count at 16 tokens is another figure


# -- parameters in K/M/B -----------------------------------------------------------------------------------


def test_parameters_are_counted_in_billions_not_giga(capsys: pytest.CaptureFixture[str]) -> None:
    graph = specvit.build_graph("mistral_7b")
    assert graph.total_params == 7_241_732_096
    assert (format_params(graph.total_params), format_count(graph.total_params)) == ("7.2B", "7.2G")
    assert [format_params(n) for n in (950, 1_936, 2_362_368, 999_960_000)] == ["950", "1.9K", "2.4M", "1.0B"]
    assert "total params:           7,241,732,096 (7.2B; " in format_table(graph)
    assert "7.2B params · 1.8T FLOPs (2 x MACs; useful 1.8T) at B=1, S=128" in to_dot(graph)
    assert main(["diff", "mistral_7b", "mistral_7b"]) == 0
    assert capsys.readouterr().out.startswith("A: mistral_7b  7.2B params  1.8T FLOPs")


def test_a_figure_names_its_unit() -> None:
    assert format_flops(35_127_656_448) == "35.1G FLOPs"
    assert format_flops(35_127_656_448, MACS, define=True) == "17.6G MACs (multiply-adds)"
    assert format_flops(1000, FLOPS, useful=600, define=True) == "1.0K FLOPs (2 x MACs; useful 600)"
    assert format_flops(1000, FLOPS, useful=1000) == "1.0K FLOPs"  # nothing hidden: nothing to add
