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
    "decoder.blocks.cross.cross_attention_head_dim": 12,
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
    wk, wv = sd[f"{at}.cross_attn.kv.weight"].chunk(2)  # each (hd, C): q, k and v are hd wide
    bk, bv = sd[f"{at}.cross_attn.kv.bias"].chunk(2)
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


def test_padded_inputs_are_hidden_from_the_latents() -> None:
    torch.manual_seed(0)
    model = perturbed(specvit.build_model(_small()), seed=6).double()
    x = torch.randn(2, 30, 12, dtype=torch.float64)
    mask = torch.zeros(2, 30, dtype=torch.bool)
    mask[:, 20:] = True  # the last 10 inputs are padding
    padded = model(x, src_key_padding_mask=mask)
    assert (padded - model(x[:, :20])).abs().max().item() < 1e-12
    assert (padded - model(x)).abs().max().item() > 1e-6


def test_latents_over_image_patches() -> None:
    """The encoder of depth 0 may embed any input: here patches with 2D positions, never self-attended."""
    patches = {"encoder.input": {"kind": "image", "size": 32, "patch": 4}, "encoder.position": "sincos2d"}
    spec = _small(**patches, **{"decoder.blocks.cross.cross_attention_head_dim": None})
    graph = specvit.build_graph(spec, batch=2)
    assert [n for n in graph if n.startswith("encoder.")] == [
        "encoder.input",
        "encoder.patch_embed",
        "encoder.pos_embed",
    ]
    assert graph["decoder.blocks.0.cross_attn"]["inputs"]["memory"] == ("B", 64, 12)
    torch.manual_seed(0)
    assert specvit.build_model(spec)(torch.randn(2, 3, 32, 32)).shape == (2, 5)


# --------------------------------------------------------------------------------------------- preset


def _independent_count(cross_attends: int) -> int:
    """The paper's ImageNet Perceiver's distinct parameters from its layer sizes, counted without specvit."""
    d, c, n, classes = 1024, 261, 512, 1000
    ln = lambda k: 2 * k  # noqa: E731
    linear = lambda i, o: i * o + o  # noqa: E731
    mlp = linear(d, d) * 2  # widening factor 1
    # q, k, v c wide (shape_for_attn 'kv'), one head; the output projection back to the latents
    cross = ln(d) + ln(c) + linear(d, c) + 2 * linear(c, c) + linear(c, d) + ln(d) + mlp
    latent_block = ln(d) + 3 * linear(d, d) + linear(d, d) + ln(d) + mlp
    return n * d + cross_attends * cross + 6 * latent_block + linear(d, classes)


def test_preset_parameter_count() -> None:
    graph = specvit.build_graph(specvit.load_spec(PRESET))
    assert graph.total_params == _independent_count(1) == 42_135_859
    with torch.device("meta"):
        model = specvit.build_model(PRESET)
    assert sum(p.numel() for p in model.parameters()) == 42_135_859
    # the paper's model: the first cross-attend and the one shared by the other 7: 44.9M in Table 1
    cross = sum(int(graph[n]["params"]) for n in graph if n.startswith("decoder.blocks.0."))
    assert graph.total_params + cross == _independent_count(2) == 44_912_254


def _flops(length: int) -> tuple[int, dict[str, int]]:
    graph = specvit.build_graph(specvit.load_spec(PRESET), src_len=length)
    attention = {n: int(graph[n]["flops"]) for n in graph if "attention" in graph[n]["op"]}
    return graph.total_flops, attention


def test_cost_grows_linearly_with_the_input_length() -> None:
    (f1, a1), (f4, a4), (f16, a16) = _flops(1024), _flops(4096), _flops(16384)
    # 16384 - 4096 = 4 * (4096 - 1024): a cost linear in the length grows 4 times as much, exactly
    assert f16 - f4 == 4 * (f4 - f1)
    assert (f1, f4, f16) == (48_620_425_216, 51_099_566_080, 61_016_129_536)  # specvit summary --src-len
    # only the single cross-attention reads the input: k, v projections and the scores are linear in M
    b, d, c, n = 1, 1024, 261, 512
    for m, a in ((1024, a1), (4096, a4), (16384, a16)):
        assert (
            a["decoder.blocks.0.cross_attn"]
            == 2 * b * n * d * c * 2 + 2 * b * m * c * 2 * c + 4 * b * n * m * c  # q, proj; k, v; scores
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
        "heads 1 · kv_heads 1 · head_dim 261",
        "memory dim 261",
    ):
        assert text in dot, text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"decoder.depth": 0}, "decoder.depth: a stack of depth 0 has no blocks"),
        ({"decoder.position": "learned"}, "decoder.position: learned latents have no order"),
        (
            {
                "decoder.blocks.cross.cross_attention_heads": 3,
                "decoder.blocks.cross.cross_attention_head_dim": None,
            },
            "decoder.blocks.cross.cross_attention_heads: width 1024 is not divisible by 3 cross-attention heads",
        ),
        (
            {"decoder.block.cross_attention_heads": 2},
            "decoder.block.cross_attention_heads: cross_attention_heads shapes the heads of a cross_attention, and the block has none",
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


# ------------------------------------------------------------------------------- HF transformers' model


def _hf_perceiver() -> Any:
    """transformers' PerceiverModel class (its import reaches torchvision, whose op schemas a CPU-only
    machine lacks: specvit's hook, installed by conftest.py, defines them)."""
    from transformers import PerceiverConfig, PerceiverModel

    return PerceiverConfig, PerceiverModel


def _from_hf(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF PerceiverModel's weights (one cross-attend, then the self-attends) as specvit's."""
    out = {"decoder.latents.weight": sd["embeddings.latents"]}
    count = len({k.split(".")[2] for k in sd if k.startswith("encoder.self_attends.")})
    layers = ["encoder.cross_attention"] + [f"encoder.self_attends.{i}" for i in range(count)]
    for i, hf in enumerate(layers):
        at, a = f"decoder.blocks.{i}", f"{hf}.attention"
        for p in ("weight", "bias"):
            out[f"{at}.norm1.{p}"] = sd[f"{a}.self.layernorm1.{p}"]
            out[f"{at}.norm2.{p}"] = sd[f"{hf}.layernorm.{p}"]
            out[f"{at}.mlp.fc1.{p}"] = sd[f"{hf}.mlp.dense1.{p}"]
            out[f"{at}.mlp.fc2.{p}"] = sd[f"{hf}.mlp.dense2.{p}"]
            q, k, v = (sd[f"{a}.self.{n}.{p}"] for n in ("query", "key", "value"))
            if i == 0:
                out[f"{at}.memory_norm.{p}"] = sd[f"{a}.self.layernorm2.{p}"]
                out[f"{at}.cross_attn.q.{p}"] = q
                out[f"{at}.cross_attn.kv.{p}"] = torch.cat((k, v))
                out[f"{at}.cross_attn.proj.{p}"] = sd[f"{a}.output.dense.{p}"]
            else:
                out[f"{at}.attn.qkv.{p}"] = torch.cat((q, k, v))
                out[f"{at}.attn.proj.{p}"] = sd[f"{a}.output.dense.{p}"]
    return out


def test_latent_tower_matches_hf_perceiver_model() -> None:
    config_cls, model_cls = _hf_perceiver()
    config = config_cls(
        num_latents=6,
        d_latents=32,
        d_model=12,
        num_blocks=1,
        num_self_attends_per_block=2,
        num_self_attention_heads=4,
        num_cross_attention_heads=1,
        cross_attention_shape_for_attention="kv",  # q, k, v of the input's width, as the preset's
    )
    torch.manual_seed(0)
    ref = perturbed(model_cls(config), seed=5)
    model = specvit.build_model(_small(head={"kind": "none"})).eval()
    model.load_state_dict(_from_hf(ref.state_dict()), strict=True)
    x = torch.randn(2, 50, 12)
    with torch.no_grad():
        expected = ref(inputs=x).last_hidden_state
        assert (model(x) - expected).abs().max().item() <= 1e-5
