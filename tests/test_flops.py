"""Attention under a causal mask or a sliding window is counted both as a dense kernel computes it (what
FlopCounterMode measures) and as its useful part; every count halves exactly into multiply-adds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import specvit
from specvit.codegen.check import module_flops
from specvit.export import example_inputs
from specvit.nn.attend import visible_keys
from specvit.ops.base import visible_pairs
from specvit.units import MACS

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


def test_causal_attention_counts_half_the_pairs_plus_the_diagonal() -> None:
    graph = specvit.build_graph(TINY_LM, batch=B, seq_len=N)
    attn = graph["decoder.blocks.0.attn"]
    # a dense kernel computes all N x N = 100 pairs; the causal mask keeps N(N+1)/2 = 55 of them
    assert attn["flops"] == PROJECTIONS + _products(N * N) == 706_560
    assert attn["useful_flops"] == PROJECTIONS + _products(N * (N + 1) // 2) == 683_520
    hidden = 2 * (_products(N * N) - _products(N * (N + 1) // 2))  # two blocks, 45 pairs each
    assert graph.total_flops - graph.total_useful_flops == hidden == 46_080
    assert graph.masked


def test_a_sliding_window_counts_the_pairs_in_the_window() -> None:
    w = 4
    graph = specvit.build_graph(TINY_LM, {"decoder.block.sliding_window": w}, batch=B, seq_len=N)
    attn = graph["decoder.blocks.0.attn"]
    # query i sees keys i-3..i: 1, 2, 3 keys for the first three, then 4 each: w N - w (w - 1) / 2 = 34 pairs
    pairs = w * N - w * (w - 1) // 2
    assert pairs == 1 + 2 + 3 + 4 * (N - 3) == 34
    assert attn["flops"] == PROJECTIONS + _products(N * N) == 706_560  # the dense count does not change
    assert attn["useful_flops"] == PROJECTIONS + _products(pairs) == 672_768


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


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_count_halves_exactly_into_macs(preset: Path) -> None:
    graph = specvit.build_graph(specvit.load_spec(preset))
    for n in graph:
        for key in ("flops", "useful_flops"):
            assert graph[n][key] % 2 == 0 and 2 * MACS.of(graph[n][key]) == graph[n][key], (n, key)
