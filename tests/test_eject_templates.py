"""The plain layers an ejected file holds (``specvit.codegen.templates``) compute what the compiled model's
layers compute, bit for bit, for every configuration they take: the attention core's parts (GQA, head
widths, QK-norms, q/v biases, scale, causal and sliding windows, padding, a bias, DETR's positions, rotary
tables, the KV cache while decoding), the MLPs, the embeddings; and a layer they cannot compute is left to
its own source (``template_for`` is None)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from specvit.codegen.templates import template_for
from specvit.codegen.templates.decoding import KVCache as PlainCache
from specvit.codegen.templates.decoding import next_token
from specvit.generate import _pick
from specvit.nn.attention import Attention
from specvit.nn.cache import KVCache
from specvit.nn.embed import PatchEmbed, PrefixTokens, TokenEmbed
from specvit.nn.mlp import GluMlp, Mlp
from specvit.nn.position import LearnedPosition, Rope
from specvit.ops.core import core_args

TARGET = "specvit.nn.attention:Attention"


def _pair(library: type, target: str, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """The library layer (random weights, away from any init) and its template holding the same weights."""
    torch.manual_seed(0)
    ours = library(**kwargs).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p))
    found = template_for(target, kwargs)
    assert found is not None, kwargs
    cls, args = found
    plain = cls(**args).eval()
    assert list(plain.state_dict()) == list(ours.state_dict())
    plain.load_state_dict(ours.state_dict())
    return ours, plain


ATTENTION = {
    "mha": {},
    "gqa": {"num_kv_heads": 2, "qkv_bias": False, "proj_bias": False},
    "head_dim": {"head_dim": 8},
    "qk_layernorm": {"qk_norm": "layernorm"},
    "qk_rmsnorm": {"qk_norm": "rmsnorm", "qk_norm_affine": False},
    "qv_bias": {"qkv_bias": (True, False, True)},
    "scale": {"scale": 1.0},
    "causal": {"causal": True},
    "causal_window": {"causal": True, "window": 3},
    "window": {"window": 2},
    "dropout": {"attn_drop": 0.1, "proj_drop": 0.1},
}
PORTS = ["mask", "rope", "bias", "pos", "cache"]


def _inputs(ports: tuple[str, ...], n: int, past: int, heads: int, hd: int) -> dict[str, Any]:
    """Keyword inputs for ``n`` new tokens after ``past`` cached ones; row 1 of the mask pads its first two
    keys, row 2 all of them."""
    g = torch.Generator().manual_seed(n + 7 * past)
    t = past + n
    out: dict[str, Any] = {}
    if "mask" in ports:
        mask = torch.zeros(3, t, dtype=torch.bool)
        mask[1, :2] = True
        mask[2] = True
        out["mask"] = mask
    if "rope" in ports:
        out["rope"] = Rope(hd)(torch.zeros(1, n, 1), offset=past)
    if "bias" in ports:
        out["bias"] = torch.randn(1, heads, n, t, generator=g)
    if "pos" in ports:
        out["pos"] = torch.randn(1, n, 24, generator=g)
    return out


COMBINED = [("mask", "cache"), ("rope", "cache"), ("bias", "mask"), ("bias", "cache"), ("pos", "mask")]


@pytest.mark.parametrize("ports", [(), *((p,) for p in PORTS), *COMBINED], ids=str)
@pytest.mark.parametrize("name", ATTENTION)
def test_plain_attention_equals_the_core(name: str, ports: tuple[str, ...]) -> None:
    kwargs = core_args(dim=24, num_heads=4, **ATTENTION[name])
    ours, plain = _pair(Attention, TARGET, **kwargs)
    caches = (KVCache(), PlainCache()) if "cache" in ports else (None, None)
    past = 0
    for n in (5, 1, 2) if "cache" in ports else (5,):  # a prompt, then decoding steps
        x = torch.randn(3, n, 24)
        hd = ATTENTION[name].get("head_dim", 6)
        kw = _inputs(ports, n, past, 4, hd)
        with torch.no_grad():
            want = ours(x, **kw, cache=caches[0])
            got = plain(x, **kw, cache=caches[1])
        assert not want.isnan().any()
        assert (got - want).abs().max().item() == 0.0, (name, ports, n)
        past += n


def test_plain_cross_attention_equals_the_core() -> None:
    kwargs = core_args(dim=24, num_heads=4, memory_dim=16, num_kv_heads=2)
    ours, plain = _pair(Attention, TARGET, **kwargs)
    memory, mask = torch.randn(3, 7, 16), torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 3:] = mask[2] = True
    caches = (KVCache(), PlainCache())
    for n, pos in ((4, torch.randn(1, 4, 24)), (1, None)):
        x = torch.randn(3, n, 24)
        kw = {"memory": memory, "memory_mask": mask, "pos": pos, "memory_pos": torch.randn(1, 7, 16)}
        with torch.no_grad():
            want, got = ours(x, **kw, cache=caches[0]), plain(x, **kw, cache=caches[1])
        assert (got - want).abs().max().item() == 0.0
    assert list(caches[1].memory) == [0]  # the memory's keys and values, computed once


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cosine": True},
        {"talking_heads": True},
        {"softcap": 30.0},
        {"queries": 1, "projection": "split"},
        {"qkv_bias": (False, True, True)},
    ],
    ids=str,
)
def test_a_part_the_plain_attention_lacks_keeps_the_cores_source(kwargs: dict[str, Any]) -> None:
    assert template_for(TARGET, core_args(dim=24, num_heads=4, **kwargs)) is None
    assert template_for(TARGET, core_args(dim=24, num_heads=4)) is not None  # control


@pytest.mark.parametrize(
    ("library", "target", "kwargs"),
    [
        (Mlp, "specvit.nn.mlp:Mlp", {"dim": 8, "hidden": 16}),
        (Mlp, "specvit.nn.mlp:Mlp", {"dim": 8, "hidden": 16, "activation": "gelu_tanh", "bias": False}),
        (Mlp, "specvit.nn.mlp:Mlp", {"dim": 8, "hidden": 16, "activation": "relu", "norm": "layernorm"}),
        (Mlp, "specvit.nn.mlp:Mlp", {"dim": 8, "hidden": 16, "activation": "silu", "dwconv": (2, 3)}),
        (GluMlp, "specvit.nn.mlp:GluMlp", {"dim": 8, "hidden": 16, "norm": "rmsnorm", "dropout": 0.1}),
        (GluMlp, "specvit.nn.mlp:GluMlp", {"dim": 8, "hidden": 16, "activation": "geglu_tanh"}),
        (LearnedPosition, "specvit.nn.position:LearnedPosition", {"num_positions": 12, "dim": 8, "start": 2}),
        (PrefixTokens, "specvit.nn.embed:PrefixTokens", {"dim": 8, "cls": True}),
        (
            PrefixTokens,
            "specvit.nn.embed:PrefixTokens",
            {"dim": 8, "cls": True, "distillation": True, "registers": 2},
        ),
        (TokenEmbed, "specvit.nn.embed:TokenEmbed", {"vocab": 10, "dim": 8, "scale": True}),
        (TokenEmbed, "specvit.nn.embed:TokenEmbed", {"vocab": 10, "dim": 8, "padding_idx": 0}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_plain_layers_equal_the_library(library: type, target: str, kwargs: dict[str, Any]) -> None:
    ours, plain = _pair(library, target, **kwargs)
    x = torch.randint(0, 10, (2, 6)) if library is TokenEmbed else torch.randn(2, 6, 8)
    calls = [{}, {"offset": 3}] if library is LearnedPosition else [{}]
    for kw in calls:
        with torch.no_grad():
            assert torch.equal(plain(x, **kw), ours(x, **kw))


@pytest.mark.parametrize("projection", ["conv", "linear"])
def test_plain_patch_embed_equals_the_library(projection: str) -> None:
    kwargs = {"img_size": (8, 12), "patch": (4, 4), "in_chans": 3, "dim": 8, "projection": projection}
    ours, plain = _pair(PatchEmbed, "specvit.nn.embed:PatchEmbed", **kwargs)
    x = torch.randn(2, 3, 8, 12)
    with torch.no_grad():
        assert torch.equal(plain(x), ours(x))


def test_next_token_draws_what_specvits_decoding_draws() -> None:
    logits = torch.randn(3, 50)
    assert torch.equal(next_token(logits, False, 1.0, None, None), _pick(logits, 0.0, None, None))
    for top_k in (None, 5):
        draws = [
            fn(torch.Generator().manual_seed(2))
            for fn in (
                lambda g, k=top_k: next_token(logits, True, 0.7, k, g),
                lambda g, k=top_k: _pick(logits, 0.7, k, g),
            )
        ]
        assert torch.equal(draws[0], draws[1])
    other = next_token(logits, True, 0.7, None, torch.Generator().manual_seed(3))
    assert not torch.equal(other, _pick(logits, 0.7, None, torch.Generator().manual_seed(2)))
