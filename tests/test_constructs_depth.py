"""Settings that vary along the depth, each stated in a spec and checked in float64 against the model that
published it (HF transformers, built from a config with random weights): a rotary theta per block (Gemma 3's
local and global layers) and blocks without positions (SmolLM3's NoPE layers).

Every test has a control: the same spec with only that construct switched off must fail the same
assertion.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_constructs import EJECTED, _check, _decoder, _diff, _hf, _llama_keys, _ours, block_keys, renamed
from test_constructs import test_the_constructs_eject_to_the_same_model as _ejects_the_same
from test_constructs_stems import ejects_the_same, problem

from specvit.compile import build_graph, build_model
from specvit.errors import SpecError
from specvit.spec.loader import parse_spec

# --------------------------------------------------------------------------------- Gemma 3: theta per block

LOCAL, GLOBAL = 10_000.0, 1_000_000.0


def _gemma3() -> Any:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kw = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=40)
    kw |= dict(query_pre_attn_scalar=36, sliding_window=4, num_hidden_layers=3)
    kw |= dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    kw |= dict(
        rope_parameters={
            t: {"rope_type": "default", "rope_theta": b}
            for t, b in (("sliding_attention", LOCAL), ("full_attention", GLOBAL))
        }
    )
    ref = _hf(Gemma3TextConfig, Gemma3ForCausalLM, 7, **kw)
    ref.model.embed_tokens.embed_scale = torch.tensor(48**0.5, dtype=torch.float64)
    return ref


def _gemma3_spec(per_block: bool) -> dict[str, Any]:
    block = {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "norm": {"kind": "rmsnorm", "eps": 1e-6, "unit_offset": True, "placement": "sandwich"},
        "qk_norm": True,
        "attention_scale": 36**-0.5,
        "qkv_bias": False,
        "proj_bias": False,
        "mlp": {"hidden": 40, "activation": "geglu_tanh", "bias": False},
        "sliding_window": 4,
        **({"rope": {"base": LOCAL}} if per_block else {}),
    }
    spec = _decoder(block, {"kind": "rope", "base": GLOBAL}, 48, tied=True)
    spec["decoder"] |= {
        "depth": 3,
        "overrides": [{"layers": [2], "block": {"sliding_window": None, "rope": None}}],
    }
    spec["decoder"]["input"]["scale"] = True
    return spec


def _gemma3_keys() -> list[tuple[str, str | tuple[str, ...]]]:
    names = ("input_layernorm", "pre_feedforward_layernorm")
    post = [
        (rf"decoder\.blocks\.(\d+)\.post_norm{i}\.weight", "model.layers.{0}." + name + ".weight")
        for i, name in ((1, "post_attention_layernorm"), (2, "post_feedforward_layernorm"))
    ]
    return [*post, *_llama_keys(names)]


def test_a_rotary_theta_per_block_is_gemma3s() -> None:
    ref = _gemma3()
    _check(lambda on: _diff(_ours(_gemma3_spec(on), ref, _gemma3_keys()), ref))


def _rope_read(graph: Any, node: str) -> str | None:
    return next((u for u, _, d in graph.nx.in_edges(node, data=True) if d["port"] == "rope"), None)


def test_blocks_of_one_theta_read_one_table() -> None:
    graph = build_graph(parse_spec(_gemma3_spec(True)))
    tables = {n: graph[n]["p"].base for n in graph if graph[n]["op"] == "rope"}
    assert tables == {"decoder.rope": GLOBAL, "decoder.rope_10000": LOCAL}
    reads = [_rope_read(graph, f"decoder.blocks.{i}.attn") for i in range(3)]
    assert reads == ["decoder.rope_10000", "decoder.rope_10000", "decoder.rope"]


# ------------------------------------------------------------------------------- SmolLM3: NoPE layers


def test_blocks_without_positions_are_smollm3s_nope_layers() -> None:
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    kw = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40)
    kw |= dict(
        num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    ref = _hf(SmolLM3Config, SmolLM3ForCausalLM, 8, **kw)

    def diff(on: bool) -> float:
        block = {
            "heads": 4,
            "kv_heads": 2,
            "norm": {"kind": "rmsnorm", "eps": 1e-6},
            "qkv_bias": False,
            "proj_bias": False,
            "mlp": {"hidden": 40, "activation": "swiglu", "bias": False},
        }
        spec = _decoder(block, {"kind": "rope", "base": 2e6}, 48, tied=True)
        nope = [{"layers": [1, 3], "block": {"rope": False}}] if on else []
        spec["decoder"] |= {"depth": 4, "overrides": nope}
        return _diff(_ours(spec, ref, _llama_keys()), ref)

    _check(diff)


def test_a_theta_per_block_ejects_and_decodes_as_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ejected model equals the built one (its blocks read ``rope_10000``), and decoding with the KV
    cache gives the tokens of decoding without it."""
    import torch

    from specvit.compile import build_model

    monkeypatch.setitem(EJECTED, "gemma3", _gemma3_spec(True))
    _ejects_the_same("gemma3")
    model = build_model(parse_spec(_gemma3_spec(True))).eval()
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    tokens = ids
    with torch.no_grad():
        for _ in range(8):  # past the sliding window of 4
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(model.generate(ids, 8), tokens)


def test_a_block_rope_needs_the_stacks() -> None:
    spec = _gemma3_spec(True)
    spec["decoder"]["position"] = "learned"
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert (
        "decoder.block.rope: rope changes the stack's rotary positions for this block, and the stack "
        in str(err.value)
    )
    assert "add rope to decoder.position, or remove rope" in str(err.value)


# ------------------------------------------------------------------------------- UMT5: a table per layer

UMT5 = dict(vocab_size=97, d_model=32, d_kv=8, num_heads=4, d_ff=40, num_layers=2, num_decoder_layers=3)
UMT5 |= dict(
    feed_forward_proj="gated-gelu",
    relative_attention_num_buckets=8,
    relative_attention_max_distance=10,
    dropout_rate=0.0,
)


def _umt5_keys() -> list[tuple[str, str | tuple[str, ...]]]:
    """specvit's T5 keys (regex) -> HF's: T5's names, with every layer's own relative table."""
    out: list[tuple[str, str | tuple[str, ...]]] = [(r"encoder\.tok_embed\.weight", "shared.weight")]
    for role, ff in (("encoder", 1), ("decoder", 2)):
        block, layer = rf"{role}\.blocks\.(\d+)\.", role + ".block.{0}.layer."
        attn = layer + "0.SelfAttention."
        out += [
            (block + r"rel_bias\.embedding\.weight", attn + "relative_attention_bias.weight"),
            (block + r"norm1\.weight", layer + "0.layer_norm.weight"),
            (block + r"attn\.qkv\.weight", tuple(attn + f"{c}.weight" for c in "qkv")),
            (block + r"attn\.proj\.weight", attn + "o.weight"),
            (block + rf"norm{ff + 1}\.weight", layer + f"{ff}.layer_norm.weight"),
            (block + r"mlp\.fc1\.weight", tuple(layer + f"{ff}.DenseReluDense.wi_{k}.weight" for k in "01")),
            (block + r"mlp\.fc2\.weight", layer + f"{ff}.DenseReluDense.wo.weight"),
            (rf"{role}\.norm\.weight", role + ".final_layer_norm.weight"),
        ]
    cross = "decoder.block.{0}.layer.1."
    return [
        *out,
        (r"decoder\.blocks\.(\d+)\.norm2\.weight", cross + "layer_norm.weight"),
        (r"decoder\.blocks\.(\d+)\.cross_attn\.q\.weight", cross + "EncDecAttention.q.weight"),
        (
            r"decoder\.blocks\.(\d+)\.cross_attn\.kv\.weight",
            tuple(cross + f"EncDecAttention.{c}.weight" for c in "kv"),
        ),
        (r"decoder\.blocks\.(\d+)\.cross_attn\.proj\.weight", cross + "EncDecAttention.o.weight"),
    ]


def test_a_relative_table_per_layer_is_umt5s() -> None:
    """UMT5 is T5 with a bucketed relative table in every layer (T5 shares its first layer's)."""
    import torch
    import yaml
    from reference import float64_reference, perturbed
    from transformers import T5Config, UMT5Config, UMT5ForConditionalGeneration

    import specvit

    torch.manual_seed(9)
    ref = perturbed(UMT5ForConditionalGeneration(UMT5Config(**UMT5)), 9).double().eval()
    source = ref.state_dict()
    g = torch.Generator().manual_seed(4)
    src, tgt = torch.randint(0, 97, (2, 16), generator=g), torch.randint(0, 97, (2, 18), generator=g)
    with torch.no_grad(), float64_reference():
        theirs = ref(input_ids=src, decoder_input_ids=tgt).logits

    def diff(on: bool) -> float:
        data = yaml.safe_load(specvit.from_hf(T5Config(**UMT5)).to_yaml())  # T5 of UMT5's sizes
        for role in ("encoder", "decoder"):
            data[role]["position"]["shared"] = not on
        model = specvit.build_model(specvit.parse_spec(data)).double().eval()
        weights, used = renamed(model, source, _umt5_keys())  # a stack's shared table (the control) below
        tied = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
        assert not on or set(source) - used == tied  # every other HF weight has its place
        if not on:  # T5's layout: each stack's one table is its first layer's
            for role in ("encoder", "decoder"):
                weights[f"{role}.rel_bias.embedding.weight"] = source[
                    f"{role}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
                ]
        model.load_state_dict(weights, strict=True)
        with torch.no_grad():
            return (model(src, tgt) - theirs).abs().max().item()

    _check(diff)


# ---------------------------------------------------------------- ALBERT: embeddings narrower than the blocks

ALBERT_KEYS: list[tuple[str, str | tuple[str, ...]]] = [
    ("encoder.tok_embed.weight", "embeddings.word_embeddings.weight"),
    ("encoder.type_embed.weight", "embeddings.token_type_embeddings.weight"),
    ("encoder.pos_embed.weight", "embeddings.position_embeddings.weight"),
    (r"encoder\.embed_norm\.(\w+)", "embeddings.LayerNorm.{0}"),
    (r"encoder\.embed_proj\.(\w+)", "encoder.embedding_hidden_mapping_in.{0}"),
    *block_keys(
        "encoder.albert_layer_groups.{0}.albert_layers.0.",  # a group's one layer
        ("attention.query", "attention.key", "attention.value"),
        "attention.dense",
        "attention.LayerNorm",
        "ffn",
        "ffn_output",
        "full_layer_layer_norm",
    ),
]


def _albert(layers: int, groups: int) -> tuple[Any, dict[str, Any], torch.Tensor, torch.Tensor]:
    """HF's AlbertModel in float64 with ``groups`` layer groups over ``layers`` layers; its state dict,
    token ids and last hidden state; and the BERT config of the same sizes (whose spec specvit reads)."""
    from reference import float64_reference, perturbed
    from transformers import AlbertConfig, AlbertModel, BertConfig

    sizes = dict(
        vocab_size=97, hidden_size=48, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=40
    )
    sizes |= dict(max_position_embeddings=32)
    torch.manual_seed(10)
    config = AlbertConfig(embedding_size=16, num_hidden_groups=groups, **sizes)
    ref = perturbed(AlbertModel(config), 10).double().eval()
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), float64_reference():
        theirs = ref(input_ids=ids).last_hidden_state
    return BertConfig(hidden_act="gelu_new", **sizes), ref.state_dict(), ids, theirs


def _albert_diff(
    bert: Any, source: dict[str, Any], ids: torch.Tensor, theirs: torch.Tensor, on: bool, **stack: Any
) -> float:
    """Max abs difference with ALBERT of the BERT spec of its sizes with ``stack``'s keys set (``on``: the
    construct tested is, and every weight of ALBERT but its pooler has a place)."""
    import yaml

    import specvit

    data = yaml.safe_load(specvit.from_hf(bert).to_yaml())
    data["encoder"] |= stack
    model = specvit.build_model(specvit.parse_spec(data)).double().eval()
    weights, used = renamed(model, source, ALBERT_KEYS)
    assert not on or set(source) - used == {"pooler.weight", "pooler.bias"}  # the rest has its place
    model.load_state_dict(weights, strict=on)
    with torch.no_grad():
        return (model(ids) - theirs).abs().max().item()


def test_embeddings_narrower_than_the_blocks_are_alberts() -> None:
    """ALBERT's token, type and position tables and their LayerNorm are 16 wide; a linear layer maps them
    to the 48-wide blocks (one layer here: its weights shared along the depth are the next test)."""
    case = _albert(1, 1)
    _check(lambda on: _albert_diff(*case, on, embed_width=16 if on else None))


@pytest.mark.parametrize("groups", [1, 2])
def test_shared_blocks_are_alberts_layer_groups(groups: int) -> None:
    """Four layers over ``groups`` sets of weights, consecutive layers sharing one (ALBERT's
    ``num_hidden_groups``); the control gives every layer weights of its own."""
    case = _albert(4, groups)
    _check(lambda on: _albert_diff(*case, on, embed_width=16, share={"blocks": groups} if on else None))


def _shared(share: dict[str, Any] | None, **stack: Any) -> dict[str, Any]:
    block = {"heads": 4, "mlp": {"hidden": 40, "activation": "gelu"}}
    encoder = {"input": {"kind": "tokens", "vocab": 50}, "position": "rope", "width": 48, "depth": 6}
    encoder |= {"block": block, "share": share, **stack}
    return {"specvit": 1, "name": "shared", "model": "encoder", "encoder": encoder, "head": "none"}


def test_shared_blocks_hold_one_copy_and_run_in_order() -> None:
    graph = build_graph(parse_spec(_shared({"blocks": 2, "order": "cycle"})))
    calls = [n for n in graph if graph[n]["op"] == "call"]
    assert [graph[n]["p"].scope for n in calls] == [f"encoder.blocks.{i % 2}" for i in range(2, 6)]
    model = build_model(graph)
    assert {k.split(".")[2] for k in model.state_dict() if k.startswith("encoder.blocks.")} == {"0", "1"}
    assert sum(graph[n]["params"] for n in graph) == sum(p.numel() for p in model.parameters())
    block = sum(graph[n]["flops"] for n in graph if graph[n]["block"] == "encoder.blocks.0")
    assert [graph[n]["flops"] for n in calls] == [block] * 4
    grouped = build_graph(parse_spec(_shared({"blocks": 2})))
    assert [grouped[n]["p"].scope for n in grouped if grouped[n]["op"] == "call"] == [
        "encoder.blocks.0", "encoder.blocks.0", "encoder.blocks.1", "encoder.blocks.1"
    ]  # fmt: skip
    ejects_the_same(_shared({"blocks": 1}), torch.randint(0, 50, (2, 9)))


def test_a_shared_block_is_drawn_once_with_its_runs() -> None:
    from specvit.diagram.scene import Cluster, plan

    graph = build_graph(parse_spec(_shared({"blocks": 1})))
    collapsed = plan(graph)
    (stack,) = [m for m in collapsed.members if isinstance(m, Cluster) and m.id == "encoder"]
    (block,) = [m for m in stack.members if isinstance(m, Cluster)]
    assert (block.title, block.note) == ("encoder.blocks.0  x6", "13.5K params · shared weights")
    assert not [b for b in collapsed.boxes.values() if b.op == "call"]
    assert ("encoder.blocks.0.add2", "encoder.norm") in {(link.src, link.dst) for link in collapsed.links}
    expanded = plan(graph, "expanded")
    assert [b.op for b in expanded.boxes.values()].count("call") == 5


def test_a_shared_decoder_block_caches_each_run_apart() -> None:
    """Six layers over three sets of weights in a decoder: each later run of a block keeps its keys and
    values in a sub-cache of its own, so decoding token by token equals the whole forward, and generation
    with the cache gives the tokens of generation without it. The control shares one cache entry between
    a block's runs (as if a run had no cache of its own) and must fail the same assertion."""
    from specvit.nn import KVCache

    data = _shared(
        {"blocks": 3}, block={"heads": 4, "kv_heads": 2, "layers": ["masked_self_attention", "mlp"]}
    )
    data["model"], data["decoder"] = "decoder", data.pop("encoder")
    data["head"] = {"kind": "lm", "tied": True}
    torch.manual_seed(0)
    model = build_model(parse_spec(data)).double().eval()
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))

    def stepwise(cache: KVCache) -> torch.Tensor:
        with torch.no_grad():
            steps = [model(ids[:, :8], cache=cache)]
            steps += [model(ids[:, i : i + 1], cache=cache, offset=i) for i in range(8, 12)]
        return torch.cat(steps, dim=1)

    with torch.no_grad():
        full = model(ids)
    assert (stepwise(KVCache()) - full).abs().max().item() <= 1e-12
    one = KVCache()
    one.sub = lambda key: one  # type: ignore[method-assign]  # every run in the block's own entry
    with pytest.raises(AssertionError):
        assert (stepwise(one) - full).abs().max().item() <= 1e-12
    prompt = ids[:, :4]
    assert torch.equal(model.generate(prompt, 6), model.generate(prompt, 6, use_cache=False))
    from specvit.diagram.scene import plan

    drawn = [b.op for b in plan(model.graph).boxes.values()]  # type: ignore[arg-type]
    assert "call" not in drawn and "sub_cache" not in drawn  # the runs and their caches fold into the blocks


@pytest.mark.parametrize(
    ("share", "stack", "message"),
    [
        ({"blocks": 4}, {}, "encoder.share: 4 sets of block weights do not divide the depth 6 (set share.blocks "
         "to a divisor of 6)"),
        ({"blocks": 1}, {"drop_path": 0.1}, "encoder.drop_path: stochastic depth's rate grows with the layer, "
         "and shared blocks have one (set drop_path: 0, or remove share)"),
        ({"blocks": 3, "order": "cycle"}, {"overrides": [{"layers": [4], "block": {"qkv_bias": False}}]},
         "encoder.share: layers 1 and 4 share one set of weights, and their blocks differ (give the layers "
         "of a set the same block, or remove share)"),
    ],
)  # fmt: skip
def test_shared_blocks_refuse_what_differs_between_their_layers(
    share: dict[str, Any], stack: dict[str, Any], message: str
) -> None:
    assert problem(_shared(share, **stack)) == message


def test_embed_width_names_what_it_cannot_meet() -> None:
    spec = _gemma3_spec(True)
    spec["decoder"]["embed_width"] = 16
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert "decoder.embed_width: a tied head uses the 16-wide token table on 48-wide tokens" in str(err.value)
    spec["head"]["tied"] = False
    graph = build_graph(parse_spec(spec))
    assert graph["decoder.tok_embed"]["shape"][-1] == 16 and graph["decoder.embed_proj"]["shape"][-1] == 48
