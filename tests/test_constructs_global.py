"""Global tokens beside a sliding window (Longformer, Beltagy et al. 2020), checked in float64 against HF's
``LongformerModel``: a symmetric window per layer (``attention_window`` w is ``sliding_window: w / 2 + 1``),
the tokens ``global_attention_mask`` marks (different ones per sample, one of them on padding) seen by every
token and seeing every token through ``query_global``, ``key_global`` and ``value_global``. HF pads the
sequence to a multiple of the window inside the model; specvit attends over the tokens as they are, so a
length that is a multiple of every window and one that is not give HF's outputs alike. HF zeroes the
padding's rows, specvit attends them like BERT: the tokens HF defines are compared.

Each comparison has its control: the same spec with only the global part switched off (no global tokens, or
the layer's own projections for the global rows) must fail the same assertion.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from reference import float64_reference, perturbed
from test_constructs import TOL, Rename, _check, block_keys, renamed
from test_constructs_stems import problem
from torch.nn.attention import SDPBackend, sdpa_kernel

from specvit.codegen.check import differences, executed_graph, module_flops
from specvit.compile import build_graph, build_model, eject
from specvit.inputs import InputError
from specvit.spec.loader import parse_spec

VOCAB, PAD, WINDOWS = 97, 1, (4, 8)  # Longformer's attention_window per layer


def _spec(global_tokens: dict[str, Any] | None = None, windows: tuple[int, int] = WINDOWS) -> dict[str, Any]:
    """Longformer's encoder at a small size: RoBERTa's embeddings (positions from row pad + 1 = 2), post-norm
    blocks, a sliding window of w / 2 + 1 per layer."""
    block: dict[str, Any] = {
        "heads": 3,
        "norm": {"kind": "layernorm", "placement": "post", "eps": 1e-5},
        "mlp": {"hidden": 40, "activation": "gelu"},
        "sliding_window": windows[0] // 2 + 1,
    }
    if global_tokens is not None:
        block["global_tokens"] = global_tokens
    return {
        "specvit": 1,
        "name": "longformer",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "tokens", "vocab": VOCAB, "padding_idx": PAD, "type_vocab": 1},
            "position": {"kind": "learned", "max_len": 62, "offset": PAD + 1},
            "width": 48,
            "depth": 2,
            "block": block,
            "overrides": [{"layers": [1], "block": {"sliding_window": windows[1] // 2 + 1}}],
            "embed_norm": True,
            "final_norm": False,
        },
        "head": "none",
    }


_KEYS: Rename = [
    ("encoder.tok_embed.weight", "embeddings.word_embeddings.weight"),
    ("encoder.type_embed.weight", "embeddings.token_type_embeddings.weight"),
    ("encoder.pos_embed.weight", "embeddings.position_embeddings.weight"),
    (r"encoder\.embed_norm\.(\w+)", "embeddings.LayerNorm.{0}"),
    (
        r"encoder\.blocks\.(\d+)\.attn\.qkv_global\.(\w+)",
        tuple(f"encoder.layer.{{0}}.attention.self.{c}_global.{{1}}" for c in ("query", "key", "value")),
    ),
    *block_keys(
        "encoder.layer.{0}.",
        ("attention.self.query", "attention.self.key", "attention.self.value"),
        "attention.output.dense",
        "attention.output.LayerNorm",
        "intermediate.dense",
        "output.dense",
        "output.LayerNorm",
    ),
]


def _longformer(windows: tuple[int, int] = WINDOWS) -> torch.nn.Module:
    from transformers import LongformerConfig, LongformerModel

    config = LongformerConfig(
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40,
        max_position_embeddings=64, attention_window=list(windows), pad_token_id=PAD, type_vocab_size=1,
        layer_norm_eps=1e-5, hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return perturbed(LongformerModel(config, add_pooling_layer=False), 0).double().eval()


def _inputs(n: int, first: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids (B, n) right-padded with PAD, the padding (True = padding) and the global tokens: different
    ones per sample, the last sample's second on its padding (which stays padding, as HF's merge makes it);
    with ``first`` the first token of every sample."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(PAD + 1, VOCAB, (3, n), generator=g)
    padding = torch.arange(n)[None] >= torch.tensor([n, n - 3, n - 5])[:, None]  # (B, n)
    ids = ids.masked_fill(padding, PAD)
    chosen = torch.zeros(3, n, dtype=torch.bool)
    if first:
        chosen[:, 0] = True
    else:
        chosen[0, 0] = chosen[1, [2, n - 4]] = chosen[2, [5, n - 1]] = True
    return ids, padding, chosen


def _diff(ref: torch.nn.Module, spec: dict[str, Any], n: int, first: bool = False) -> float:
    """Max abs difference of ``spec``'s model (``ref``'s weights renamed into it) from ``ref`` over the tokens
    HF defines, n tokens per sample."""
    source = ref.state_dict()
    model = build_model(parse_spec(spec)).double().eval()
    weights, used = renamed(model, source, _KEYS)
    g = spec["encoder"]["block"].get("global_tokens")
    assert used == {k for k in source if "_global" not in k or (g is not None and g.get("projections", True))}
    model.load_state_dict(weights, strict=True)
    ids, padding, chosen = _inputs(n, first)
    with torch.no_grad(), float64_reference():
        theirs = ref(input_ids=ids, attention_mask=(~padding).long(), global_attention_mask=chosen.long())
    marked = {"global_attention_mask": chosen} if g is not None and "first" not in g else {}
    with torch.no_grad():
        ours = model(ids, key_padding_mask=padding, **marked)
    keep = ~padding
    return (ours[keep] - theirs.last_hidden_state[keep]).abs().max().item()


@pytest.mark.parametrize(
    ("windows", "n"),
    [((4, 8), 16), ((4, 8), 13), ((4, 6), 12)],
    ids=["multiple_of_the_windows", "padded_by_hf", "windows_4_6"],
)
def test_global_tokens_are_longformers(windows: tuple[int, int], n: int) -> None:
    """HF pads to a multiple of the largest window, which every window must divide: 13 tokens with windows
    4 and 6 would be 18, and HF's layer of window 4 refuses them."""
    ref = _longformer(windows)
    _check(lambda on: _diff(ref, _spec({} if on else None, windows), n))
    assert (
        _diff(ref, _spec({"projections": False}, windows), n) > TOL
    )  # the global rows need their own q, k, v


def test_the_first_tokens_global_are_longformers_first_token_marked() -> None:
    ref = _longformer()
    _check(lambda on: _diff(ref, _spec({"first": 1} if on else None), 13, first=True))


def test_global_tokens_run_sdpa_and_the_math_path_alike() -> None:
    """In the core, talking heads send both passes through the math path: with identity maps across the
    heads it computes what SDPA does; without the global mask no token is global."""
    from specvit.nn.attention import Attention

    parts = {"window": 3, "global_tokens": "mask", "global_projection": True, "dtype": torch.float64}
    torch.manual_seed(0)
    fused = Attention(48, 3, **parts).eval()
    math = Attention(48, 3, talking_heads=True, **parts).eval()
    math.load_state_dict(fused.state_dict(), strict=False)
    for mix in (math.proj_l, math.proj_w):
        torch.nn.init.eye_(mix.weight)
        torch.nn.init.zeros_(mix.bias)
    x = torch.randn(3, 13, 48, dtype=torch.float64)
    _, padding, chosen = _inputs(13)
    kwargs = {"mask": padding, "global_mask": chosen}
    with torch.no_grad():
        assert (fused(x, **kwargs) - math(x, **kwargs)).abs().max().item() < 1e-12
        assert (fused(x, **kwargs) - fused(x, mask=padding)).abs().max().item() > 1e-3
        local = Attention(48, 3, window=3, dtype=torch.float64).eval()
        local.load_state_dict(fused.state_dict(), strict=False)
        assert torch.equal(fused(x, mask=padding), local(x, mask=padding))


def _graph_and_inputs(global_tokens: dict[str, Any]) -> tuple[Any, tuple[torch.Tensor, ...], dict[str, Any]]:
    graph = build_graph(parse_spec(_spec(global_tokens)), batch=3, seq_len=13)
    ids, padding, chosen = _inputs(13)
    kwargs = {"global_attention_mask": chosen} if global_tokens.get("first") is None else {}
    return graph, (ids, padding), kwargs


@pytest.mark.parametrize("global_tokens", [{}, {"first": 2, "projections": False}], ids=["mask", "first"])
def test_global_tokens_eject_to_the_same_model(global_tokens: dict[str, Any]) -> None:
    graph, args, kwargs = _graph_and_inputs(global_tokens)
    torch.manual_seed(0)
    compiled = build_model(graph).eval()
    text = eject(graph)
    namespace: dict[str, Any] = {"__name__": "ejected"}
    exec(compile(text, "<ejected>", "exec"), namespace)
    ejected = namespace["Model"]().eval()
    ejected.load_state_dict(compiled.state_dict())
    with torch.no_grad():
        assert (ejected(*args, **kwargs) - compiled(*args, **kwargs)).abs().max().item() == 0.0
    assert ("qkv_global" in text) == (global_tokens.get("projections", True))
    assert "global_rows(" in text


def test_global_tokens_are_drawn_as_built() -> None:
    graph, args, kwargs = _graph_and_inputs({})
    assert graph.nx.has_edge("encoder.global_mask", "encoder.blocks.0.attn")
    assert graph["encoder.global_mask"]["p"].keyword
    label = " ".join(graph.op("encoder.blocks.0.attn").label(graph["encoder.blocks.0.attn"]["p"]))
    assert "global tokens (the global mask's) see and are seen by every token" in label
    assert "sliding window 3" in label
    torch.manual_seed(0)
    model = build_model(graph).eval()
    assert differences(graph, executed_graph(model)) == []
    with sdpa_kernel(SDPBackend.MATH):
        unmarked = module_flops(model, args)  # no token global: the global pass runs for no row
        model.forward = partial(model.forward, **kwargs)  # type: ignore[method-assign]
        counted = module_flops(model, args)
    assert counted == unmarked == {n: graph[n]["flops"] for n in graph.module_nodes()}
    plain = build_graph(parse_spec(_spec(None)), batch=3, seq_len=13)
    extra = 2 * (48 * 144 + 144)  # qkv_global's weights and biases in each of the two layers
    assert graph.total_params == plain.total_params + extra


def test_the_global_mask_is_checked_like_the_padding_mask() -> None:
    model = build_model(parse_spec(_spec({})))
    ids, _, chosen = _inputs(13)
    with pytest.raises(InputError) as info:
        model(ids, global_attention_mask=chosen[:, :12])
    assert str(info.value) == "global_attention_mask: seq_len is 12 but x has 13; they must agree"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda s: s["encoder"]["block"].pop("sliding_window"),
            "encoder.block.global_tokens: global tokens are seen beside a sliding window, and the block has "
            "none (set sliding_window (Longformer's attention_window w: sliding_window w / 2 + 1), or remove "
            "global_tokens)",
        ),
        (
            lambda s: s["encoder"]["block"].update(layers=["masked_self_attention", "mlp"]),
            "encoder.block.global_tokens: global tokens attend to every token, later ones too, and this stack "
            "is causal (a KV cache) (use global_tokens in an encoder's self_attention)",
        ),
        (
            lambda s: s["encoder"]["block"].update(layers=["mlp"]),
            "encoder.block.global_tokens: global_tokens change a self_attention, and the block has none (add "
            "self_attention to the layers, or remove global_tokens)",
        ),
        (
            lambda s: s["encoder"].update(prefix={"cls": True}),
            "encoder.block.global_tokens.first: prefix tokens join the tokens the mask marks (make the first "
            "K tokens global with first: K)",
        ),
    ],
    ids=["no_window", "causal", "no_self_attention", "prefix"],
)
def test_global_tokens_are_refused_where_they_mean_nothing(edit: Any, expected: str) -> None:
    spec = _spec({})
    edit(spec)
    assert problem(spec) == expected


def test_global_tokens_are_an_encoders() -> None:
    spec = _spec({})
    spec["model"], spec["decoder"] = "decoder", spec.pop("encoder")
    spec["decoder"]["block"]["layers"] = ["masked_self_attention", "mlp"]
    assert problem(spec) == (
        "decoder.block.global_tokens: global tokens attend to every token, later ones too, and this stack is "
        "causal (a KV cache) (use global_tokens in an encoder's self_attention)"
    )
    override = _spec(None)
    override["encoder"]["overrides"].append({"layers": [0], "block": {"global_tokens": {}, "window": None}})
    override["encoder"]["overrides"][1]["block"]["sliding_window"] = None
    assert problem(override) == (
        "encoder.overrides.1.block.global_tokens: global tokens are seen beside a sliding window, and the "
        "block has none (set sliding_window (Longformer's attention_window w: sliding_window w / 2 + 1), or "
        "remove global_tokens)"
    )
