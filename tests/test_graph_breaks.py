"""Whole-graph compile stays whole: TorchDynamo traces every preset's forward, in eval and train mode, and
the KV-cache decode step of every causal preset, as one graph (no graph breaks), so torch.compile with
fullgraph=True can take any of them."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from presets import PRESETS, small_spec

import specvit
from specvit.export import example_inputs
from specvit.nn.attention import KVCache

pytestmark = pytest.mark.slow  # `make test-all` runs it; `make test` leaves it out (see README)


def _breaks(fn: object, *args: object, **kwargs: object) -> list[str]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    return [str(b.reason) for b in explained.break_reasons]


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_forward_is_one_graph(path: Path) -> None:
    model = specvit.build_model(small_spec(path))
    args = example_inputs(model, batch=2)
    for train in (False, True):
        model.train(train)
        assert _breaks(model, *args) == [], f"train={train}"


CAUSAL = [p for p in PRESETS if any(s.causal for s in small_spec(p).stacks.values())]


@pytest.mark.parametrize("path", CAUSAL, ids=[p.stem for p in CAUSAL])
def test_cached_decode_step_is_one_graph(path: Path) -> None:
    model = specvit.build_model(small_spec(path)).eval()
    assert "cache" in inspect.signature(model.forward).parameters
    *context, tokens = example_inputs(model, batch=2)
    cache = KVCache()
    with torch.no_grad():
        model(*context, tokens[:, :-1], cache=cache)  # prefill, eagerly
        step = tokens[:, -1:]
        assert _breaks(model, *context, step, cache=cache, offset=tokens.shape[1] - 1) == []
