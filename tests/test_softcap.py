"""Soft-capping (Gemma 2): attention logits (``block.attention_softcap``) and final logits (``head.softcap``).

The reference is HF transformers' Gemma-2 attention, built from a config with random weights, in float64. Its
eager path upcasts the softmax to float32 (meant for half precision; in float64 it is a downcast), so the tests
keep that softmax in the input's dtype; everything else is HF's code as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import specvit
from specvit.errors import SpecError
from specvit.nn.attention import Attention
from specvit.spec.loader import parse_spec

D, HEADS, KV_HEADS, HEAD_DIM, N, CAP, SCALAR = 48, 4, 2, 16, 9, 5.0, 20


@pytest.fixture
def float64_softmax(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """HF's ``softmax(..., dtype=torch.float32)`` kept in float64 for float64 inputs."""
    softmax = F.softmax

    def keep(x: torch.Tensor, *args: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        return softmax(x, *args, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", keep)
    yield


def _gemma2_attention(cap: float | None) -> tuple[Any, Any]:
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding

    config = Gemma2Config(
        hidden_size=D,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=SCALAR,
        attn_logit_softcapping=cap,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    attn = Gemma2Attention(config, layer_idx=0).double().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # large logits, so that the cap bites
    return attn, Gemma2RotaryEmbedding(config).double()


def _hf(attn: Any, rotary: Any, x: torch.Tensor) -> torch.Tensor:
    cos, sin = rotary(x, torch.arange(N)[None])
    causal = torch.full((N, N), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        return attn(x, position_embeddings=(cos, sin), attention_mask=causal)[0]


def _ours(ours: Attention, attn: Any, rotary: Any, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        ours.proj.weight.copy_(attn.o_proj.weight)
        cos, sin = rotary(x, torch.arange(N)[None])
        return ours(x, rope=(cos[0], sin[0]))


def _core(cap: float | None) -> Attention:
    return Attention(
        D,
        HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        qkv_bias=False,
        proj_bias=False,
        scale=SCALAR**-0.5,
        softcap=cap,
        causal=True,
        dtype=torch.float64,
    ).eval()


@pytest.mark.usefixtures("float64_softmax")
def test_soft_capped_attention_equals_gemma2_in_float64() -> None:
    attn, rotary = _gemma2_attention(CAP)
    x = torch.randn(2, N, D, dtype=torch.float64)
    want = _hf(attn, rotary, x)
    assert (_ours(_core(CAP), attn, rotary, x) - want).abs().max().item() <= 1e-10
    # the control: the same layer without the cap misses HF's output by far more than the tolerance
    assert (_ours(_core(None), attn, rotary, x) - want).abs().max().item() > 1e-3


def _lm(block: str = "", head: str = "") -> str:
    return f"""
specvit: 1
name: capped_lm
model: decoder
decoder:
  input: {{kind: tokens, vocab: 64}}
  position: {{kind: rope, base: 10000.0}}
  width: {D}
  depth: 3
  block:
    heads: {HEADS}
    kv_heads: {KV_HEADS}
    head_dim: {HEAD_DIM}
    qkv_bias: false
    proj_bias: false
    attention_scale: {SCALAR**-0.5!r}
    layers: [masked_self_attention, mlp]
    norm: {{kind: rmsnorm}}
    {block}
head: {{kind: lm{head}}}
"""


@pytest.mark.usefixtures("float64_softmax")
def test_a_spec_soft_caps_the_blocks_it_names_as_gemma2() -> None:
    text = _lm("attention_softcap: 5.0", "").replace(
        "  block:", "  overrides: [{layers: [1], block: {attention_softcap: null}}]\n  block:"
    )
    model = specvit.build_model(parse_spec(text)).double().eval()
    caps = [block.attn.softcap for block in model.decoder.blocks]
    assert caps == [CAP, None, CAP]  # per block, through overrides
    attn, rotary = _gemma2_attention(CAP)
    x = torch.randn(2, N, D, dtype=torch.float64)
    built = model.decoder.blocks[0].attn
    assert (_ours(built, attn, rotary, x) - _hf(attn, rotary, x)).abs().max().item() <= 1e-10
    graph = specvit.build_graph(parse_spec(text))
    assert "softcap 5" in " ".join(
        graph.op("decoder.blocks.0.attn").label(graph["decoder.blocks.0.attn"]["p"])
    )


def test_final_logit_softcap_is_gemma2s() -> None:
    capped = specvit.build_model(parse_spec(_lm(head=", softcap: 3.0"))).double().eval()
    plain = specvit.build_model(parse_spec(_lm())).double().eval()
    plain.load_state_dict(capped.state_dict())
    tokens = torch.randint(0, 64, (2, N))
    with torch.no_grad():
        logits = plain(tokens) * 4  # large logits, so that the cap bites
        capped.head.fc.weight.mul_(4)
        got = capped(tokens)
    want = torch.tanh(logits / 3.0) * 3.0  # Gemma2ForCausalLM.forward: logits / cap, tanh, * cap
    assert (got - want).abs().max().item() <= 1e-10
    assert (logits - want).abs().max().item() > 1e-3  # the control: without the cap
    assert got.abs().max().item() < 3.0


def test_softcap_is_refused_where_the_layer_is_not_the_core() -> None:
    text = """
specvit: 1
name: sagan
model: encoder
encoder:
  input: {kind: feature_map, channels: 16, size: [4, 4]}
  position: none
  width: 16
  depth: 1
  block:
    heads: 1
    layers: [sagan_attention]
    attention_softcap: 10.0
head: {kind: none}
"""
    with pytest.raises(SpecError, match="sagan_attention has no soft-capping"):
        parse_spec(text)


@pytest.mark.parametrize(
    "masks",
    [{"causal": True}, {"causal": True, "window": 3}, {"padding": True}, {"causal": True, "padding": True}],
    ids=["causal", "sliding", "padding", "causal_padding"],
)
def test_the_math_path_equals_sdpa_where_the_cap_does_nothing(masks: dict[str, Any]) -> None:
    """Grouped query heads (GQA read as one kv head's queries stacked), masks and empty rows on the math
    path give SDPA's result when the cap is too large to bite."""
    padding = masks.pop("padding", False)
    torch.manual_seed(1)
    sdpa = Attention(D, HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, **masks).double().eval()
    math = (
        Attention(D, HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, softcap=1e12, **masks).double().eval()
    )
    math.load_state_dict(sdpa.state_dict())
    x = torch.randn(2, N, D, dtype=torch.float64)
    mask = torch.zeros(2, N, dtype=torch.bool)
    if padding:
        mask[0, 4:] = True
        mask[1, :] = True  # a row with no key at all: zeros on both paths
    with torch.no_grad():
        got, want = math(x, mask=mask), sdpa(x, mask=mask)
    assert (got - want).abs().max().item() <= 1e-12
