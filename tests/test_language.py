"""The language composes: schedules along the depth, residual patterns and block graphs, attention masks,
biases and scales, several positions, offsets; each computed as written (float64 references) and drawn."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import specvit
from specvit.errors import SpecError
from specvit.nn.attention import KVCache, SelfAttention
from specvit.nn.functional import eos_pool
from specvit.nn.mlp import QuickGELU
from specvit.nn.position import Rope, apply_rope
from specvit.nn.relative import relative_buckets


@pytest.fixture(autouse=True)
def _float64() -> Any:
    """Exactness: every module and reference here computes in float64."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _spec(
    block: str, *, stack: str = "", model: str = "encoder", layers: str = "[self_attention, mlp]"
) -> specvit.Spec:
    text = f"""\
specvit: 1
name: t
model: {model}
{model}:
  input: {{kind: {"features, dim: 8" if model == "encoder" else "tokens, vocab: 50"}}}
  position: {"none" if model == "encoder" else "rope"}
  width: 16
  depth: 6
  final_norm: false
  block:
    heads: 2
    layers: {layers}
{block}
{stack}
"""
    return specvit.parse_spec(text, source="t.yaml")


def _problems(text: str) -> str:
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(text, source="t.yaml")
    return str(info.value)


# -- schedules -----------------------------------------------------------------------------------------


def test_a_schedule_repeats_named_blocks_along_the_depth() -> None:
    spec = _spec(
        "",
        model="decoder",
        layers="[masked_self_attention, mlp]",
        stack="  blocks:\n    local: {sliding_window: 3}\n  schedule: [local, local, block]",
    )
    s = spec.decoder
    assert s is not None
    assert [s.layer(i).sliding_window for i in range(6)] == [3, 3, None, 3, 3, None]
    graph = specvit.build_graph(spec)
    assert [graph[f"decoder.blocks.{i}.attn"]["p"].window for i in range(6)] == [3, 3, None, 3, 3, None]
    folds = graph.fold()  # period 3, twice: blocks 0,3 / 1,4 / 2,5
    assert {b: (f.rep, f.count) for b, f in folds.items()}["decoder.blocks.4"] == ("decoder.blocks.1", 2)
    assert folds["decoder.blocks.5"].label == "decoder.blocks.2,5"


def test_runs_and_overrides_make_sequences_of_block_kinds() -> None:
    spec = _spec(
        "",
        stack="  blocks:\n    mlp_only: {layers: [mlp]}\n  schedule: [{block: 4}, {mlp_only: 2}]\n"
        "  overrides:\n    - {layers: [0, -1], block: {norm: {placement: sandwich}}}",
    )
    s = spec.encoder
    assert s is not None
    assert [s.layer(i).sublayers for i in range(6)] == [["self_attention", "mlp"]] * 4 + [["mlp"]] * 2
    assert [s.layer(i).norm.placement for i in range(6)] == [
        "sandwich",
        "pre",
        "pre",
        "pre",
        "pre",
        "sandwich",
    ]
    graph = specvit.build_graph(spec)
    assert "encoder.blocks.0.post_norm1" in graph and "encoder.blocks.5.post_norm1" in graph
    assert "encoder.blocks.1.post_norm1" not in graph and "encoder.blocks.4.attn" not in graph
    assert s.layer(1) is s.layer(2)  # equal layers are one block: drawn and generated once


@pytest.mark.parametrize(
    ("stack", "expected"),
    [
        (
            "  schedule: [local, block]",
            "t.yaml:15:14: encoder.schedule.0: there is no block named 'local' (use one of block, or add local: "
            "under encoder.blocks)",
        ),
        (
            "  blocks:\n    wide: {mlp: {ratio: 8}}",
            "t.yaml:16:11: encoder.blocks.wide: block 'wide' is never used (name it in encoder.schedule, e.g. "
            "schedule: [block, wide])",
        ),
        (
            "  overrides:\n    - {layers: [6], block: {qk_norm: true}}",
            "t.yaml:16:17: encoder.overrides.0.layers.0: layer 6 does not exist: the stack has 6 (use 0 .. 5, "
            "or -6 .. -1 from the end)",
        ),
        (
            "  overrides:\n    - {layers: [1], block: {heads: 4}}",
            "t.yaml:16:29: encoder.overrides.0.block.heads: unknown key 'heads' (valid keys: layers, norm, parallel,",
        ),
    ],
    ids=["unknown", "unused", "index", "stack-wide"],
)
def test_schedule_mistakes_point_at_the_line(stack: str, expected: str) -> None:
    text = _spec_text(stack)
    assert _problems(text).splitlines()[0].startswith(expected)


def _spec_text(stack: str) -> str:
    return (
        "specvit: 1\nname: t\nmodel: encoder\nencoder:\n  input: {kind: features, dim: 8}\n  position: none\n"
        "  width: 16\n  depth: 6\n  final_norm: false\n  block:\n    heads: 2\n    layers: [self_attention, mlp]\n"
        "\n\n" + stack + "\n"
    )


# -- residual patterns and block graphs ----------------------------------------------------------------


def _one_block(block: str) -> Any:
    spec = specvit.parse_spec(
        "specvit: 1\nname: t\nmodel: encoder\nencoder:\n  input: {kind: features, dim: 8}\n  position: none\n"
        f"  width: 16\n  depth: 1\n  final_norm: false\n  block:\n    heads: 2\n{block}\n",
        source="t.yaml",
    )
    torch.manual_seed(0)
    model = specvit.build_model(spec, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # norms off their ones and zeros
    return model.encoder.blocks[0]


PATTERNS = {
    "pre": ("    norm: {placement: pre}", lambda b, x: (y := x + b.attn(b.norm1(x))) + b.mlp(b.norm2(y))),
    "post": ("    norm: {placement: post}", lambda b, x: b.norm2((y := b.norm1(x + b.attn(x))) + b.mlp(y))),
    "sandwich": (
        "    norm: {placement: sandwich}",
        lambda b, x: (y := x + b.post_norm1(b.attn(b.norm1(x)))) + b.post_norm2(b.mlp(b.norm2(y))),
    ),
    "res_post": (
        "    norm: {placement: res_post}",
        lambda b, x: (y := x + b.norm1(b.attn(x))) + b.norm2(b.mlp(y)),
    ),
    "parallel": ("    parallel: true", lambda b, x: x + b.attn(b.norm1(x)) + b.mlp(b.norm2(x))),
}


@pytest.mark.parametrize("name", PATTERNS)
def test_residual_patterns_compute_what_they_say(name: str) -> None:
    block_yaml, reference = PATTERNS[name]
    block = _one_block(block_yaml)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(block(x), reference(block, x), atol=1e-12, rtol=0)


def test_a_block_graph_is_the_pattern_it_writes_out() -> None:
    graph_yaml = """\
    graph:
      - {name: norm1, op: norm, inputs: [x]}
      - {name: attn, op: self_attention, inputs: [norm1]}
      - {name: norm2, op: norm, inputs: [x]}
      - {name: mlp, op: mlp, inputs: [norm2]}
      - {name: add2, op: add, inputs: [x, attn, mlp]}"""
    written, pattern = _one_block(graph_yaml), _one_block("    parallel: true")
    assert list(written.state_dict()) == list(pattern.state_dict())
    written.load_state_dict(pattern.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(written(x), pattern(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        (
            "[{name: a, op: self_attention, inputs: [n]}, {name: n, op: norm, inputs: [x]}]",
            "encoder.block.graph.0.inputs.0: 'n' is defined after this node",
        ),
        (
            "[{name: n, op: norm, inputs: [x]}, {name: a, op: mlp, inputs: [x]}]",
            "encoder.block.graph.0.name: 'n' is computed but never read",
        ),
        (
            "[{name: a, op: add, inputs: [x]}]",
            "encoder.block.graph.0.inputs: add reads two or more inputs, got 1",
        ),
        ("[{name: a, op: mlpp, inputs: [x]}]", "encoder.block.graph.0.op: 'mlpp' is not one of"),
    ],
    ids=["order", "unused", "arity", "kind"],
)
def test_block_graph_mistakes_point_at_the_line(nodes: str, expected: str) -> None:
    text = _spec_text("").replace("    layers: [self_attention, mlp]", f"    graph: {nodes}")
    assert "t.yaml:12:" in _problems(text).splitlines()[0]
    assert expected in _problems(text)


# -- attention options ---------------------------------------------------------------------------------


def _reference_attention(attn: SelfAttention, x: Tensor, visible: Tensor, scale: float) -> Tensor:
    """Softmax attention written out: one head at a time, explicit mask."""
    b, n, _ = x.shape
    h, hd = attn.num_heads, attn.head_dim
    q, k, v = attn.qkv(x).view(b, n, 3, h, hd).permute(2, 0, 3, 1, 4)  # (B, H, N, hd) each
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, N, N)
    weights = scores.masked_fill(~visible, -math.inf).softmax(-1)
    return attn.proj((weights @ v).transpose(1, 2).reshape(b, n, h * hd))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "symmetric"])
def test_sliding_window_attention(causal: bool) -> None:
    torch.manual_seed(1)
    attn = SelfAttention(16, 2, causal=causal, window=3).eval()
    x = torch.randn(2, 9, 16)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    visible = ((j <= i) if causal else torch.ones(9, 9, dtype=torch.bool)) & ((i - j).abs() < 3)
    with torch.no_grad():
        torch.testing.assert_close(
            attn(x), _reference_attention(attn, x, visible, 8**-0.5), atol=1e-12, rtol=0
        )


def test_sliding_window_cache_stays_exact_past_the_window() -> None:
    torch.manual_seed(2)
    attn = SelfAttention(16, 2, causal=True, window=3).eval()
    x = torch.randn(2, 10, 16)
    cache = KVCache()
    with torch.no_grad():
        steps = [attn(x[:, :4], cache=cache)] + [attn(x[:, t : t + 1], cache=cache) for t in range(4, 10)]
        torch.testing.assert_close(torch.cat(steps, 1), attn(x), atol=1e-12, rtol=0)


def test_attention_scale_and_partial_qkv_bias() -> None:
    torch.manual_seed(3)
    attn = SelfAttention(16, 2, qkv_bias=(True, False, True), scale=1.0).eval()
    names = [n for n, _ in attn.named_parameters()]
    assert names == ["q_bias", "v_bias", "qkv.weight", "proj.weight", "proj.bias"]
    with torch.no_grad():
        attn.q_bias.normal_(), attn.v_bias.normal_()
        plain = SelfAttention(16, 2, qkv_bias=True, scale=1.0).eval()
        plain.load_state_dict(
            {
                "qkv.weight": attn.qkv.weight,
                "qkv.bias": torch.cat((attn.q_bias, torch.zeros(16), attn.v_bias)),
                "proj.weight": attn.proj.weight,
                "proj.bias": attn.proj.bias,
            }
        )
        x = torch.randn(2, 5, 16)
        visible = torch.ones(5, 5, dtype=torch.bool)
        torch.testing.assert_close(attn(x), _reference_attention(plain, x, visible, 1.0), atol=1e-12, rtol=0)
    spec = _one_block_spec("    qkv_bias: [true, false, true]")
    graph = specvit.build_graph(spec)
    assert graph["encoder.blocks.0.attn"]["params"] == sum(
        p.numel() for p in specvit.build_model(spec).encoder.blocks[0].attn.parameters()
    )


def _one_block_spec(block: str) -> specvit.Spec:
    return specvit.parse_spec(
        "specvit: 1\nname: t\nmodel: encoder\nencoder:\n  input: {kind: features, dim: 8}\n  position: none\n"
        f"  width: 16\n  depth: 1\n  block:\n    heads: 2\n{block}\n"
    )


# -- positions -----------------------------------------------------------------------------------------


def test_partial_rotary_rotates_the_first_channels_only() -> None:
    x = torch.randn(2, 3, 5, 16)  # (B, H, N, hd)
    cos, sin = Rope(4)(x[:, 0])  # 4 of 16 channels
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out[..., 4:], x[..., 4:], atol=0, rtol=0)
    full_cos, full_sin = Rope(4)(x[:, 0])
    torch.testing.assert_close(out[..., :4], apply_rope(x[..., :4], full_cos, full_sin), atol=0, rtol=0)


def test_several_positions_in_one_stack() -> None:
    spec = _spec("", model="decoder", layers="[masked_self_attention, mlp]").model_dump()
    spec["decoder"]["position"] = [{"kind": "learned", "max_len": 32, "offset": 2}, "rope"]
    graph = specvit.build_graph(specvit.parse_spec(spec), seq_len=8)
    assert graph["decoder.pos_embed"]["params"] == (32 + 2) * 16  # two rows before position 0
    assert ("decoder.rope", "decoder.blocks.0.attn") in graph.nx.edges
    spec["decoder"]["position"] = ["learned", "sincos"]
    with pytest.raises(
        SpecError, match=r"decoder\.position\.1: sincos and learned both give the positions added"
    ):
        specvit.parse_spec(spec)


def test_learned_offset_reads_rows_from_the_offset() -> None:
    from specvit.nn.position import LearnedPosition

    table = LearnedPosition(10 + 2, 4, start=2)
    x = torch.zeros(1, 3, 4)
    torch.testing.assert_close(table(x, offset=1), table.weight[:, 3:6], atol=0, rtol=0)
    with pytest.raises(ValueError, match="has 10 positions"):
        table(torch.zeros(1, 11, 4))


def test_relative_buckets_as_t5_defines_them() -> None:
    d = torch.arange(-200, 201)
    both = relative_buckets(d, True, 32, 128)
    assert both[200].item() == 0 and both[201].item() == 17 and both[199].item() == 1  # 0, +1, -1
    assert both[:72].unique().tolist() == [15] and both[-72:].unique().tolist() == [31]  # beyond 128
    before = relative_buckets(d, False, 32, 128)
    assert before[200:].unique().tolist() == [0]  # a causal bias has no buckets for later keys
    assert before[200 - 15].item() == 15 and before[200 - 16].item() == 16  # exact below 16, log from there


# -- kinds ---------------------------------------------------------------------------------------------


def test_causal_encoder_eos_pooling_and_quick_gelu() -> None:
    x = torch.randn(4)
    torch.testing.assert_close(QuickGELU()(x), x * torch.sigmoid(1.702 * x), atol=0, rtol=0)
    tokens = torch.tensor([[5, 9, 2, 0], [7, 2, 2, 9]])
    hidden = torch.arange(2 * 4 * 3.0).view(2, 4, 3)
    torch.testing.assert_close(eos_pool(hidden, tokens, 2), hidden[[0, 1], [2, 1]], atol=0, rtol=0)
    torch.testing.assert_close(eos_pool(hidden, tokens, None), hidden[[0, 1], [1, 3]], atol=0, rtol=0)
    spec = _spec("", layers="[masked_self_attention, mlp]")
    assert spec.encoder is not None and spec.encoder.causal  # CLIP's text tower: a causal encoder


# -- errors for what does not exist --------------------------------------------------------------------

GPT2 = (Path(__file__).resolve().parents[1] / "specs" / "gpt2_small.yaml").read_text()


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "kind: layernorm",
            "kind: RMSNorm",
            "decoder.block.norm.kind: 'RMSNorm' is not one of layernorm, rmsnorm (did you mean 'rmsnorm'?)",
        ),
        ("activation: gelu_tanh", "activation: SwiGLU", "(did you mean 'swiglu'?)"),
        (
            "activation: gelu_tanh",
            "activation: gelu_new",
            "(there is no gelu_new; for HF's gelu_new (GPT-2's tanh GELU) write gelu_tanh)",
        ),
        (
            "{kind: learned, max_len: 1024}",
            "rotary",
            "g.yaml:11:13: decoder.position.kind: 'rotary' is not one of none, learned",
        ),
        ("placement: pre", "placement: parallel", "write parallel: true in the block)"),
        (
            "  block:\n    heads: 12",
            "  block:\n  - heads: 12",
            "g.yaml:15:3: decoder.block: expected a mapping of keys, got a list (a stack has one base block; for "
            "blocks that differ along the depth, name them under decoder.blocks (each the keys it changes) and "
            "order them with decoder.schedule, e.g. schedule: [local, local, global])",
        ),
    ],
    ids=["case", "case-gated", "alias", "alias-position", "concept", "list-for-block"],
)
def test_what_does_not_exist_points_at_what_does(old: str, new: str, expected: str) -> None:
    assert old in GPT2
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(GPT2.replace(old, new, 1), source="g.yaml")
    first = str(info.value).splitlines()[0]
    assert expected in first and first.startswith("g.yaml:")


def _beit(shared: bool) -> specvit.Spec:
    return specvit.parse_spec(
        "specvit: 1\nname: beit\nmodel: encoder\nencoder:\n  input: {kind: image, size: 32, patch: 8, channels: 3}\n"
        f"  prefix: {{cls: true}}\n  position: {{kind: relative2d, shared: {str(shared).lower()}}}\n"
        "  width: 24\n  depth: 2\n  block: {heads: 3, qkv_bias: [true, false, true], layer_scale: 0.1}\n"
        "head: {kind: classifier, classes: 5, pool: mean, norm: true}\n"
    )


@pytest.mark.parametrize("shared", [False, True], ids=["per-layer", "shared"])
def test_beit_relative_bias_matches_hf(shared: bool) -> None:
    """BEiT's 2D relative bias with its class-token entries, as HF's BeitRelativePositionBias computes it."""
    from transformers import BeitConfig
    from transformers.models.beit.modeling_beit import BeitRelativePositionBias

    spec = _beit(shared)
    model = specvit.build_model(spec).eval()
    graph = specvit.build_graph(spec)
    tables = [n for n, _ in model.named_parameters() if n.endswith("relative_position_bias_table")]
    if shared:
        assert tables == ["encoder.rel_bias.relative_position_bias_table"]
    else:
        assert tables == [f"encoder.blocks.{i}.rel_bias.relative_position_bias_table" for i in range(2)]
    assert sum(p.numel() for p in model.parameters()) == graph.total_params
    ours = model.encoder.rel_bias if shared else model.encoder.blocks[0].rel_bias
    ref = BeitRelativePositionBias(BeitConfig(image_size=32, patch_size=8, num_attention_heads=3))
    with torch.no_grad():
        ref.relative_position_bias_table.normal_()
        ours.relative_position_bias_table.copy_(ref.relative_position_bias_table)
        expected = ref((4, 4), dim_size=24)
        torch.testing.assert_close(ours(torch.zeros(1, 17, 24)), expected, atol=0, rtol=0)
