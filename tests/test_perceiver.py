"""Perceiver (Jaegle et al., 2021): learned latents cross-attend once to a long input, then self-attend.

The model is an encoder_decoder whose encoder has depth 0 (it only passes the input through: the input
is never self-attended) and whose decoder starts from ``input: {kind: latents}``; its first block
cross-attends to the input, the rest self-attend among the latents. The reference below is written from
the paper's equations (Sec. 2: cross-attend, latent Transformer, average of the latents, linear layer).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import perturbed
from torch import Tensor

import specvit
from specvit.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "specs" / "perceiver_imagenet.yaml"

SMALL: dict[str, Any] = {
    "encoder.input.dim": 12,
    "encoder.width": 12,
    "decoder.input.count": 6,
    "decoder.width": 32,
    "decoder.depth": 3,
    "decoder.block.heads": 4,
    "decoder.schedule": ["cross", {"block": 2}],
    "head.classes": 5,
}


def _small(**changes: Any) -> specvit.Spec:
    return specvit.load_spec(PRESET, overrides={**SMALL, **changes})


# ----------------------------------------------------------------------- the paper's equations, float64


def _ln(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _attend(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    """softmax(Q K^T / sqrt(d)) V per head; q (B, N, D), k and v (B, M, D) -> (B, N, D)."""
    b, n, d = q.shape
    hd = d // heads
    q, k, v = (t.reshape(b, -1, heads, hd).transpose(1, 2) for t in (q, k, v))  # (B, H, ., hd)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1)  # (B, H, N, M)
    return (weights @ v).transpose(1, 2).reshape(b, n, d)


def _mlp(x: Tensor, sd: dict[str, Tensor], at: str) -> Tensor:
    h = torch.nn.functional.gelu(x @ sd[f"{at}.fc1.weight"].T + sd[f"{at}.fc1.bias"])
    return h @ sd[f"{at}.fc2.weight"].T + sd[f"{at}.fc2.bias"]


def perceiver_reference(sd: dict[str, Tensor], x: Tensor, heads: int, eps: float) -> Tensor:
    """Logits of a Perceiver with one cross-attend (1 head) and self-attention blocks, from its weights.

    Cross-attend: z = z0 + Attn(LN(z0), LN(x)), z = z + MLP(LN(z)); each latent block:
    z = z + SelfAttn(LN(z)), z = z + MLP(LN(z)); logits = W mean_n(z) + b.
    """
    b, d = x.shape[0], sd["decoder.latents.weight"].shape[1]
    z = sd["decoder.latents.weight"].expand(b, -1, -1)
    at = "decoder.blocks.0"
    q_in = _ln(z, sd[f"{at}.norm1.weight"], sd[f"{at}.norm1.bias"], eps)
    kv_in = _ln(x, sd[f"{at}.memory_norm.weight"], sd[f"{at}.memory_norm.bias"], eps)
    wk, wv = sd[f"{at}.cross_attn.kv.weight"].split(d)
    bk, bv = sd[f"{at}.cross_attn.kv.bias"].split(d)
    q = q_in @ sd[f"{at}.cross_attn.q.weight"].T + sd[f"{at}.cross_attn.q.bias"]
    o = _attend(q, kv_in @ wk.T + bk, kv_in @ wv.T + bv, 1)
    z = z + o @ sd[f"{at}.cross_attn.proj.weight"].T + sd[f"{at}.cross_attn.proj.bias"]
    z = z + _mlp(_ln(z, sd[f"{at}.norm2.weight"], sd[f"{at}.norm2.bias"], eps), sd, f"{at}.mlp")
    i = 1
    while f"decoder.blocks.{i}.attn.qkv.weight" in sd:
        at = f"decoder.blocks.{i}"
        h = _ln(z, sd[f"{at}.norm1.weight"], sd[f"{at}.norm1.bias"], eps)
        q, k, v = (h @ sd[f"{at}.attn.qkv.weight"].T + sd[f"{at}.attn.qkv.bias"]).split(d, dim=-1)
        z = z + _attend(q, k, v, heads) @ sd[f"{at}.attn.proj.weight"].T + sd[f"{at}.attn.proj.bias"]
        z = z + _mlp(_ln(z, sd[f"{at}.norm2.weight"], sd[f"{at}.norm2.bias"], eps), sd, f"{at}.mlp")
        i += 1
    return z.mean(1) @ sd["head.fc.weight"].T + sd["head.fc.bias"]


def test_forward_equals_the_papers_equations_in_float64() -> None:
    torch.manual_seed(0)
    model = perturbed(specvit.build_model(_small()), seed=1).double()
    x = torch.randn(2, 50, 12, dtype=torch.float64)
    expected = perceiver_reference(model.state_dict(), x, heads=4, eps=1e-5)
    out = model(x)
    assert out.shape == (2, 5)
    assert (out - expected).abs().max().item() < 1e-10


def test_the_output_does_not_depend_on_the_input_order() -> None:
    """Without positions, cross-attention pools over the input: permuting it changes nothing."""
    torch.manual_seed(0)
    model = perturbed(specvit.build_model(_small()), seed=2).double()
    x = torch.randn(1, 40, 12, dtype=torch.float64)
    assert torch.allclose(model(x), model(x[:, torch.randperm(40)]), atol=1e-12)


# --------------------------------------------------------------------------------------------- preset


def _independent_count() -> int:
    """The preset's parameters from the paper's layer sizes, counted without specvit."""
    d, c, n, classes = 1024, 261, 512, 1000
    ln = lambda k: 2 * k  # noqa: E731
    linear = lambda i, o: i * o + o  # noqa: E731
    mlp = linear(d, d) * 2  # widening factor 1
    cross = ln(d) + ln(c) + linear(d, d) + 2 * linear(c, d) + linear(d, d) + ln(d) + mlp
    latent_block = ln(d) + 3 * linear(d, d) + linear(d, d) + ln(d) + mlp
    return n * d + cross + 6 * latent_block + linear(d, classes)


def test_preset_parameter_count() -> None:
    graph = specvit.build_graph(specvit.load_spec(PRESET))
    assert graph.total_params == _independent_count() == 44_099_058
    with torch.device("meta"):
        model = specvit.build_model(PRESET)
    assert sum(p.numel() for p in model.parameters()) == 44_099_058


def _flops(length: int) -> tuple[int, dict[str, int]]:
    graph = specvit.build_graph(specvit.load_spec(PRESET), src_len=length)
    attention = {n: int(graph[n]["flops"]) for n in graph if "attention" in graph[n]["op"]}
    return graph.total_flops, attention


def test_cost_grows_linearly_with_the_input_length() -> None:
    (f1, a1), (f4, a4), (f16, a16) = _flops(1024), _flops(4096), _flops(16384)
    # 16384 - 4096 = 4 * (4096 - 1024): a cost linear in the length grows 4 times as much, exactly
    assert f16 - f4 == 4 * (f4 - f1)
    assert (f1, f4, f16) == (52_636_368_896, 62_362_959_872, 101_269_323_776)
    # only the single cross-attention reads the input: k, v projections and the scores are linear in M
    b, d, c, n = 1, 1024, 261, 512
    for m, a in ((1024, a1), (4096, a4), (16384, a16)):
        assert (
            a["decoder.blocks.0.cross_attn"]
            == 2 * b * n * d * d * 2 + 2 * b * m * c * 2 * d + 4 * b * n * m * d
        )
        latent = [v for k, v in a.items() if k != "decoder.blocks.0.cross_attn"]
        assert latent == [2 * b * n * d * 3 * d + 4 * b * n * n * d + 2 * b * n * d * d] * 6


def test_the_input_is_never_self_attended() -> None:
    graph = specvit.build_graph(specvit.load_spec(PRESET))
    reads = {n for n in graph if any("S_src" in str(d) for d in graph[n]["inputs"].get("x", ()))}
    assert reads == {"decoder.blocks.0.memory_norm", "decoder.latents"}  # the latents take its batch size
    assert graph["decoder.latents"]["flops"] == 0
    cross = [n for n in graph if graph[n]["op"] == "cross_attention"]
    assert cross == ["decoder.blocks.0.cross_attn"]
    assert graph["decoder.blocks.0.cross_attn"]["inputs"]["memory"] == ("B", "S_src", 261)
    assert graph["decoder.latents"]["shape"] == ("B", 512, 1024)
    assert [graph[n]["op"] for n in graph if n.startswith("encoder.")] == ["input", "input"]


def test_diagram_shows_the_latents_and_the_single_cross_attention() -> None:
    from specvit.diagram import to_dot

    dot = to_dot(specvit.build_graph(specvit.load_spec(PRESET)))
    for text in (
        "512 learned latents",
        "cross_attention",
        "heads 1 · kv_heads 1 · head_dim 1024",
        "memory dim 261",
    ):
        assert text in dot, text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"decoder.depth": 0}, "decoder.depth: a stack of depth 0 has no blocks"),
        ({"decoder.position": "learned"}, "decoder.position: learned latents have no order"),
        (
            {"decoder.blocks.cross.cross_attention_heads": 3},
            "decoder.blocks.cross.cross_attention_heads: width 1024 is not divisible by 3 cross-attention heads",
        ),
        (
            {"decoder.block.cross_attention_heads": 2},
            "decoder.block.cross_attention_heads: cross_attention_heads are the heads of a cross_attention, and the block has none",
        ),
    ],
)
def test_misuse_is_refused_with_a_fix(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError) as info:
        specvit.load_spec(PRESET, overrides=overrides)
    assert message in str(info.value)


def test_latents_are_a_decoder_input() -> None:
    spec = {
        "specvit": 1,
        "name": "latents_encoder",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "latents", "count": 4},
            "position": "none",
            "width": 8,
            "depth": 1,
            "block": {"heads": 2},
        },
    }
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(spec)
    assert "encoder.input.kind: latents are the input of an encoder_decoder's decoder" in str(info.value)
