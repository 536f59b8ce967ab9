"""ALiBi, added as one op definition (specvit/ops/alibi.py) with its layer (specvit/nn/alibi.py): slopes
and biases equal BLOOM's, attention with it equals the paper's formula, and a KV cache decodes exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

import specvit
from specvit.codegen.check import differences, executed_graph
from specvit.diagram import to_dot
from specvit.nn.alibi import Alibi, alibi_slopes

LM = """specvit: 1
name: alibi_lm
model: decoder
decoder:
  input: {kind: tokens, vocab: 50}
  position: alibi
  width: 48
  depth: 2
  block: {heads: 6, layers: [masked_self_attention, mlp]}
head: {kind: lm, tied: true}
"""


@pytest.mark.parametrize("heads", [1, 4, 6, 8, 12, 16, 24, 112])
def test_slopes_and_bias_equal_blooms(heads: int) -> None:
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, :8] = 0
    theirs = build_alibi_tensor(mask, heads, torch.float32).view(3, heads, 1, 9)
    ours = Alibi(heads)(torch.zeros(3, 9, 2), mask=~mask.bool())
    assert torch.equal(ours, theirs)
    assert torch.equal(alibi_slopes(heads), theirs[0, :, 0, 1])  # key 1's bias is the slope itself


def test_attention_with_alibi_is_the_papers_formula() -> None:
    torch.manual_seed(0)
    spec = specvit.parse_spec(LM)
    model = specvit.build_model(spec, dtype=torch.float64).eval()
    tokens = torch.randint(0, 50, (2, 7))
    attn = model.decoder.blocks[0].attn
    x = torch.randn(2, 7, 48, dtype=torch.float64)
    q, k, v = attn.qkv(x).view(2, 7, 3, 6, 8).permute(2, 0, 3, 1, 4)  # (B, H, N, hd) each
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    penalty = -alibi_slopes(6).double()[:, None, None] * (i - j)  # (H, N, N): -m * (i - j)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8) + penalty
    scores = scores.masked_fill(j > i, float("-inf"))
    expected = attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 48))
    with torch.no_grad():
        bias = model.decoder.alibi(x)
        torch.testing.assert_close(attn(x, bias=bias), expected, atol=1e-12, rtol=0)
        assert model(tokens).shape == (2, 7, 50)


def test_kv_cache_decoding_with_alibi_is_exact() -> None:
    torch.manual_seed(0)
    # untied head: a random tied model greedily repeats one token, which a broken cache would repeat too
    model = specvit.build_model(
        specvit.parse_spec(LM, overrides={"head.tied": False}), dtype=torch.float64
    ).eval()
    tokens = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        full = model(tokens)
        cache = specvit.nn.KVCache()
        steps = [model(tokens[:, :4], cache=cache)] + [
            model(tokens[:, t : t + 1], cache=cache, offset=t) for t in range(4, 9)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)
    greedy = [model.generate(tokens[:, :3], 6, use_cache=c) for c in (True, False)]
    assert torch.equal(greedy[0], greedy[1])


def test_alibi_is_drawn_as_built() -> None:
    graph = specvit.build_graph(specvit.parse_spec(LM))
    into = {(u, p) for u, _, p in graph.nx.in_edges("decoder.blocks.1.attn", data="port")}
    assert ("decoder.alibi", "bias") in into
    assert "linear bias · 6 slopes · slope · key position" in to_dot(graph)
    assert differences(graph, executed_graph(specvit.build_model(graph, device="meta"))) == []
    assert graph["decoder.alibi"]["shape"] == ("B", 6, 1, "S")


def test_alibi_needs_a_sequence() -> None:
    bad = LM.replace("input: {kind: tokens, vocab: 50}", "input: {kind: image, size: 32, patch: 8}")
    with pytest.raises(specvit.SpecError, match="alibi biases a 1D sequence"):
        specvit.parse_spec(
            bad.replace("model: decoder", "model: decoder").replace("head: {kind: lm, tied: true}", "")
        )


def test_a_learned_table_beside_alibi_bounds_the_length_once() -> None:
    """The learned table's length holds wherever it is listed among the positions: the lowering's length, the
    input check and ``generate`` read the one resolved limit (a table listed before ALiBi was missed, so a
    20-token call failed inside torch)."""
    from specvit.inputs import InputError, sequence_limits
    from specvit.spec.loader import parse_spec

    text = (Path(__file__).parents[1] / "docs" / "examples" / "alibi_lm.yaml").read_text()
    table = "[{kind: learned, max_len: 16}, alibi]"
    for positions, limit in ((table, 16), ("[alibi, {kind: learned, max_len: 16}]", 16), ("alibi", 1 << 20)):
        spec = parse_spec(text.replace("position: alibi", f"position: {positions}"))
        assert spec.decoder.max_len == sequence_limits(spec)["S"] == limit
        assert specvit.build_graph(spec).dims["S"] == min(limit, 128)
    model = specvit.build_model(parse_spec(text.replace("position: alibi", f"position: {table}"))).eval()
    with pytest.raises(InputError, match=r"tokens: 20 positions are more than alibi_lm takes \(S <= 16"):
        model(torch.zeros(1, 20, dtype=torch.long))
    with pytest.raises(InputError, match="ask for at most 12 new tokens"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 20)
    assert model.generate(torch.zeros(1, 4, dtype=torch.long), 12).shape == (1, 16)
