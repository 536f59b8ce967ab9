"""Batched generation with per-row EOS, and KV caches that stay bounded: sliding-window layers keep their
window, ALiBi models keep ``cache_window`` positions (the ALiBi paper's sliding-window evaluation)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import specvit
from specvit.nn.attention import KVCache, SelfAttention

SPECS = Path(__file__).resolve().parents[1] / "specs"
SMALL = {
    "decoder.depth": 2,
    "decoder.width": 64,
    "decoder.block.heads": 4,
    "decoder.block.mlp.hidden": 128,
    "decoder.input.vocab": 97,
}


def _model(name: str, **over: Any) -> specvit.SpecModel:
    torch.manual_seed(0)
    model = specvit.build_model(SPECS / f"{name}.yaml", overrides={**SMALL, **over}, dtype=torch.float64)
    with torch.no_grad():  # away from init, so that no two logits tie
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _alone(model: Any, prompt: torch.Tensor, n: int, width: int, **kw: Any) -> torch.Tensor:
    """Row by row generation, each padded with ``pad_id`` to ``width`` columns."""
    rows = [model.generate(prompt[i : i + 1], n, **kw)[0] for i in range(prompt.shape[0])]
    return torch.stack([torch.cat((r, r.new_full((width - r.numel(),), kw["pad_id"]))) for r in rows])


def test_batched_greedy_with_per_row_eos_equals_each_row_alone() -> None:
    model = _model("gpt2_small")
    prompt = torch.randint(0, 97, (4, 5), generator=torch.Generator().manual_seed(1))
    free = model.generate(prompt, 12)
    eos = int(free[0, 5 + 2])  # row 0 finishes at its third new token
    got = model.generate(prompt, 12, eos_id=eos, pad_id=96)
    want = _alone(model, prompt, 12, got.shape[1], eos_id=eos, pad_id=96)
    assert torch.equal(got, want)
    assert got[0, 7] == eos and (got[0, 8:] == 96).all()  # row 0 stopped growing after its EOS
    finished = [(r[5:] == eos).nonzero()[:1] for r in got]
    if all(f.numel() for f in finished):  # every row finished: the batch stopped at the last one's EOS
        assert got.shape[1] == 5 + 1 + max(int(f) for f in finished)
    uncached = model.generate(prompt, 12, eos_id=eos, pad_id=96, use_cache=False)
    assert torch.equal(uncached, got)


def test_sampled_generation_pads_finished_rows_and_stops_when_all_are_done() -> None:
    model = _model("gpt2_small")
    prompt = torch.randint(0, 97, (6, 3), generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    eos = 5
    got = model.generate(prompt, 40, eos_id=eos, pad_id=0, temperature=1.5, generator=gen)
    new = got[:, 3:]
    ended = []
    for row in new:
        hits = (row == eos).nonzero()
        if hits.numel():
            first = int(hits[0])
            assert (row[first + 1 :] == 0).all()  # padded after its EOS
            ended.append(first)
    if len(ended) == 6:
        assert new.shape[1] == max(ended) + 1  # stopped when the last row finished
    else:
        assert new.shape[1] == 40
    top1 = model.generate(prompt, 8, temperature=1.0, top_k=1, generator=gen)  # top-1 sampling is greedy
    assert torch.equal(top1, model.generate(prompt, 8))


def _windowed(model: specvit.SpecModel, window: int) -> specvit.SpecModel:
    """A copy whose every self-attention layer has a sliding window of ``window``."""
    out = copy.deepcopy(model)
    for m in out.modules():
        if isinstance(m, SelfAttention):
            m.window = window
    return out


def _stepwise(model: Any, tokens: torch.Tensor, cache: KVCache, prefill: int) -> tuple[torch.Tensor, int]:
    """Logits of every position from a prefill of ``prefill`` tokens then one token per step, and the most
    positions any layer held between forwards."""
    with torch.no_grad():
        outs, most = [model(tokens[:, :prefill], cache=cache)], 0
        for t in range(prefill, tokens.shape[1]):
            most = max(most, *(cache.stored(i) for i in cache.keys))
            outs.append(model(tokens[:, t : t + 1], cache=cache, offset=t))
        most = max(most, *(cache.stored(i) for i in cache.keys))
    return torch.cat(outs, dim=1), most


def test_sliding_window_cache_is_bounded_and_exact() -> None:
    model = _model("mistral_7b", **{"decoder.block.kv_heads": 2, "decoder.block.sliding_window": 4})
    tokens = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(tokens)  # the masked window over the whole sequence
    got, most = _stepwise(model, tokens, KVCache(), prefill=6)
    assert most == 3  # window - 1 positions held between forwards, not 15
    assert (got - full).abs().max().item() < 1e-10
    assert torch.equal(model.generate(tokens[:, :3], 10), model.generate(tokens[:, :3], 10, use_cache=False))


def test_alibi_cache_window_equals_windowed_attention() -> None:
    model = _model("bloom_560m")
    tokens = torch.randint(0, 97, (2, 14), generator=torch.Generator().manual_seed(5))
    windowed = _windowed(model, 5)
    with torch.no_grad():
        want = windowed(tokens)
        unbounded = model(tokens)
    got, most = _stepwise(model, tokens, KVCache(window=5), prefill=7)
    assert most == 4
    assert (got - want).abs().max().item() < 1e-10
    assert (got - unbounded)[:, 5:].abs().max().item() > 1e-6  # the window does change later positions
    assert (got - unbounded)[:, :5].abs().max().item() < 1e-10  # ... and not those it covers whole
    gen = model.generate(tokens[:, :4], 9, cache_window=5)
    assert torch.equal(gen, windowed.generate(tokens[:, :4], 9, use_cache=False))


def test_cache_window_argument_is_checked() -> None:
    with pytest.raises(ValueError, match=r"KVCache\(window=...\) must be an integer >= 1 or None, got 0"):
        _model("bloom_560m").generate(torch.zeros(1, 2, dtype=torch.long), 3, cache_window=0)
