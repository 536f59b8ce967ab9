"""The graph is the model: modules, parameters, shapes and FLOPs of every preset; masks, caches, init."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from presets import PRESETS, small_spec
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import specvit
from specvit.compile import build_model
from specvit.export import example_inputs
from specvit.graph import build_graph

ROOT = Path(__file__).resolve().parents[1]


def _recorder(seen: dict[str, tuple[int, ...]], path: str) -> Any:
    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        seen.setdefault(path, tuple((out[0] if isinstance(out, tuple) else out).shape))  # rotary: (cos, sin)

    return hook


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_graph_is_the_model(preset: Path) -> None:
    torch.manual_seed(0)
    batch = 2
    spec = small_spec(preset)
    sizes = {"src_len": 12, "tgt_len": 9} if spec.model == "encoder_decoder" else {"seq_len": 12}
    graph = build_graph(spec, batch=batch, **sizes)
    model = build_model(graph).eval()

    seen: dict[str, tuple[int, ...]] = {}  # first call: a shared embedding also runs for the decoder
    hooks = []
    for path in graph.module_nodes():
        module = model.get_submodule(path)  # one module per module node, at the node's path
        own = sum(p.numel() for p in module.parameters())
        assert own == graph[path]["params"], path
        hooks.append(module.register_forward_hook(_recorder(seen, path)))
    assert sum(p.numel() for p in model.parameters()) == graph.total_params

    x = example_inputs(graph, batch)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(*x)
    for h in hooks:
        h.remove()
    assert {p: graph.concrete(graph[p]["shape"]) for p in graph.module_nodes()} == seen
    outputs = graph[graph.output]
    if isinstance(out, dict):  # DETR: {logits, boxes}; MAE: {loss, logits, mask, ids_restore}
        feeds = {d["port"]: u for u, _, d in graph.nx.in_edges(graph.output, data=True)}
        assert list(out) == list(outputs["p"].keys)
        for key, value in out.items():
            assert tuple(value.shape) == graph.concrete(graph[feeds[key]]["shape"]), key
            assert torch.isfinite(value.float()).all(), key
        out = out[outputs["p"].keys[0]]
    assert tuple(out.shape) == graph.concrete(outputs["shape"])
    assert counter.get_total_flops() == graph.total_flops
    assert torch.isfinite(out).all()


_TEXTS = {
    "decoder": """specvit: 1
name: tiny_lm
model: decoder
decoder:
  input: {kind: tokens, vocab: 50}
  position: rope
  width: 32
  depth: 2
  block: {heads: 4, kv_heads: 2, layers: [masked_self_attention, mlp], qk_norm: true, mlp: {activation: swiglu}}
head: {kind: lm, tied: true}
""",
    "encoder_decoder": """specvit: 1
name: tiny_seq2seq
model: encoder_decoder
encoder:
  input: {kind: tokens, vocab: 40}
  position: sincos
  width: 32
  depth: 2
  block: {heads: 4, norm: {placement: post}}
decoder:
  input: {kind: tokens, vocab: 40}
  position: {kind: learned, max_len: 64}
  width: 32
  depth: 2
  block: {heads: 4, layers: [masked_self_attention, cross_attention, mlp], norm: {placement: post}}
shared_embeddings: true
head: {kind: lm, tied: true}
""",
}


def _tiny(kind: str, dtype: torch.dtype | None = None, **over: Any) -> specvit.SpecModel:
    torch.manual_seed(0)
    return build_model(specvit.parse_spec(_TEXTS[kind], overrides=over), dtype=dtype).eval()


def test_causal_decoder_ignores_the_future() -> None:
    """Exact in float64: a causal position never reads a later token."""
    model = _tiny("decoder", torch.float64)
    a = torch.randint(0, 50, (2, 10))
    b = a.clone()
    b[:, 6:] = torch.randint(0, 50, (2, 4))
    with torch.no_grad():
        ya, yb = model(a), model(b)
    torch.testing.assert_close(ya[:, :6], yb[:, :6], atol=1e-12, rtol=0)
    assert (ya[:, 6:] - yb[:, 6:]).abs().max() > 1e-3


def test_encoder_decoder_masks() -> None:
    """Exact in float64: the decoder is causal and padded source tokens are invisible."""
    model = _tiny("encoder_decoder", torch.float64)
    src, tgt = torch.randint(0, 40, (2, 8)), torch.randint(0, 40, (2, 7))
    tgt2 = tgt.clone()
    tgt2[:, 4:] = (tgt[:, 4:] + 1) % 40
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[:, 6:] = True
    src2 = src.clone()
    src2[:, 6:] = (src[:, 6:] + 5) % 40
    with torch.no_grad():
        y = model(src, tgt, src_key_padding_mask=pad)
        y_future = model(src, tgt2, src_key_padding_mask=pad)
        y_padded = model(src2, tgt, src_key_padding_mask=pad)
    torch.testing.assert_close(y[:, :4], y_future[:, :4], atol=1e-12, rtol=0)  # decoder is causal
    torch.testing.assert_close(y, y_padded, atol=1e-12, rtol=0)  # padded source tokens are invisible


@pytest.mark.parametrize("kind", ["decoder", "encoder_decoder"])
def test_cached_generation_equals_uncached(kind: str) -> None:
    """In float64, where the cached and uncached logits agree to ~1e-15: in fp32 they differ by rounding
    (~1e-6), which a near-tie in the argmax or in a sampled token's cumulative probability could turn into
    another token on another CPU. The head is untied: a random tied model greedily repeats one token (the
    encoder-decoder only BOS), which would hide a broken cache; untied, the greedy tokens vary."""
    model = _tiny(kind, torch.float64, **{"head.tied": False})
    prompt = torch.randint(0, 40, (3, 5))
    kwargs: dict[str, Any] = {"bos_id": 1} if kind == "encoder_decoder" else {}
    fast = model.generate(prompt, 20, use_cache=True, **kwargs)  # type: ignore[operator]
    slow = model.generate(prompt, 20, use_cache=False, **kwargs)  # type: ignore[operator]
    assert torch.equal(fast, slow)
    assert fast.shape == ((3, 21) if kind == "encoder_decoder" else (3, 25))
    g = torch.Generator().manual_seed(3)
    s1 = model.generate(prompt, 10, temperature=0.8, top_k=5, generator=g, **kwargs)  # type: ignore[operator]
    g = torch.Generator().manual_seed(3)
    s2 = model.generate(prompt, 10, temperature=0.8, top_k=5, generator=g, use_cache=False, **kwargs)  # type: ignore[operator]
    assert torch.equal(s1, s2)


def test_generation_stops_at_eos() -> None:
    # untied: a random tied model repeats one token, and the stop at EOS would not show
    model = _tiny("decoder", **{"head.tied": False})
    prompt = torch.randint(0, 50, (2, 4))
    greedy = model.generate(prompt, 8)
    eos = int(greedy[0, 5])  # the second generated token of sequence 0
    assert (greedy[0, 6:] != eos).any()  # without eos_id, sequence 0 goes on with other tokens
    out = model.generate(prompt, 8, eos_id=eos)
    assert int(out[0, 5]) == eos and (out[0, 5:] == eos).all()


def test_meta_build_then_init_equals_normal_build() -> None:
    torch.manual_seed(7)
    normal = build_model(ROOT / "specs" / "mnist_vit.yaml")
    meta = build_model(ROOT / "specs" / "mnist_vit.yaml", device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.init_weights()
    for (k, a), (k2, b) in zip(normal.state_dict().items(), meta.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k


def test_init_conventions() -> None:
    vit = build_model(ROOT / "specs" / "mnist_vit.yaml")
    assert torch.count_nonzero(vit.head.fc.weight) == 0  # type: ignore[union-attr]
    assert 0.015 < float(vit.encoder.blocks[0].attn.qkv.weight.detach().std()) < 0.025
    assert float(vit.encoder.prefix.cls_token.detach().abs().max()) < 1e-4
    seq = _tiny("encoder_decoder")
    w = seq.encoder.blocks[0].attn.qkv.weight
    bound = (6 / (w.shape[0] + w.shape[1])) ** 0.5
    assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.9 * bound  # xavier-uniform
    assert seq.decoder.tok_embed.source is seq.encoder.tok_embed  # type: ignore[attr-defined]
    assert seq.head.fc.weight is seq.encoder.tok_embed.weight  # type: ignore[union-attr]


def test_activation_checkpointing_gives_equal_loss_and_gradients() -> None:
    """Exact in float64: checkpointing recomputes the same forward, dropout masks included."""
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        spec = specvit.parse_spec(_TEXTS["encoder_decoder"])
        model = build_model(spec, dtype=torch.float64, checkpointing=checkpointing)
        model.train()
        src, tgt = torch.randint(0, 40, (2, 8)), torch.randint(0, 40, (2, 7))
        loss = model(src, tgt).logsumexp(-1).mean()
        loss.backward()
        grads.append(
            (loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        )
    (loss_a, ga), (loss_b, gb) = grads
    assert torch.equal(loss_a, loss_b)
    assert ga.keys() == gb.keys() and len(ga) > 20
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], atol=1e-12, rtol=0, msg=k)
