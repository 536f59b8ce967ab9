"""Parts of the attention core checked in float64 against the model that published them: ConViT's gated
positional self-attention (timm), in its local blocks before the class token enters; attention pooling with
a learned probe (timm's ``global_pool='map'``, HF's SigLIP head), the core as a cross-attention.

Every test has a control: the same spec with only that construct switched off must fail the same
assertion.
"""

from __future__ import annotations

from typing import Any

import torch
from reference import float64_reference, perturbed
from test_constructs import Rename, _check, block_keys, renamed
from test_constructs_stems import IMAGE, VIT_KEYS, ejects_the_same, problem, vit_spec

from specvit.compile import build_graph, build_model
from specvit.spec.loader import parse_spec

LOCAL = 2


def _convit_spec(gated: bool = True) -> dict[str, Any]:
    spec = vit_spec([], patch=4)
    stack = spec["encoder"]
    stack["prefix"]["at"] = LOCAL  # ConViT's class token joins after its local blocks
    stack["position"] = {"kind": "learned", "include_prefix": False}
    stack["depth"] = 4
    stack["block"]["qkv_bias"] = False
    stack["overrides"] = [{"layers": list(range(LOCAL)), "block": {"gated_positions": gated}}]
    return spec


_CONVIT_KEYS: Rename = [  # the gated blocks' q and k are one linear, their v another
    (
        r"encoder\.blocks\.([01])\.attn\.qkv\.weight",
        ("blocks.{0}.attn.qk.weight", "blocks.{0}.attn.v.weight"),
    ),
    *VIT_KEYS,
]


def test_convit_gated_positional_attention() -> None:
    from timm.models.convit import ConVit

    torch.manual_seed(0)
    ref = ConVit(
        img_size=IMAGE,
        patch_size=4,
        embed_dim=12,
        num_heads=4,
        depth=4,
        local_up_to_layer=LOCAL,
        num_classes=5,
    )  # embed_dim is per head: width 48
    ref = perturbed(ref, 0).double().eval()
    x = torch.randn(2, 3, IMAGE, IMAGE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def diff(gated: bool) -> float:
        model = build_model(parse_spec(_convit_spec(gated))).double().eval()
        weights, used = renamed(model, ref.state_dict(), _CONVIT_KEYS)
        model.load_state_dict(weights, strict=gated)  # the control has no gates to load
        assert used == set(ref.state_dict()) or not gated
        with torch.no_grad(), float64_reference():
            return (model(x) - ref(x)).abs().max().item()

    _check(diff)


def test_gated_attention_ejects_to_the_same_model() -> None:
    ejects_the_same(_convit_spec(), torch.randn(2, 3, IMAGE, IMAGE))
    graph = build_graph(parse_spec(_convit_spec()))
    node = "encoder.blocks.0.attn"
    assert "gated positions" in " ".join(graph.op(node).label(graph[node]["p"]))


def test_gated_positions_need_the_grid_alone() -> None:
    late = _convit_spec()
    late["encoder"]["overrides"][0]["layers"] = [2]
    assert problem(late) == (
        "encoder.overrides.0.block.gated_positions: layer 2 sees the prefix tokens, and gated positions are "
        "over the patch grid alone (set prefix.at above 2 (ConViT adds its class token after the gated blocks))"
    )
    text = _convit_spec()
    text["encoder"] |= {"input": {"kind": "tokens", "vocab": 50}, "position": "none"}
    del text["encoder"]["prefix"]
    assert problem(text | {"head": "none"}) == (
        "encoder.overrides.0.block.gated_positions: gated positions are over the patch grid of a plain image "
        "stack (remove it)"
    )


# ----------------------------------------------------------------- attention pooling with a learned probe


def _probe_spec(on: bool = True, **head: Any) -> dict[str, Any]:
    spec = vit_spec([], patch=6)
    spec["encoder"]["prefix"]["cls"] = False
    spec["head"] |= {"pool": "attention" if on else "mean", **head}
    return spec


_PROBE_KEYS: Rename = [
    (r"head\.pool\.latent\.weight", "attn_pool.latent"),
    (r"head\.pool\.attn\.(.*)", "attn_pool.{0}"),
    (r"head\.pool\.(norm|mlp)\.(.*)", "attn_pool.{0}.{1}"),
    *VIT_KEYS,
]


def _probe_diff(ref: Any, rename: Rename, source: dict[str, torch.Tensor], on: bool, **head: Any) -> float:
    """Max abs difference of the probe spec (pool mean when off; ``head``'s keys set) with ``ref``'s
    weights (``source``)."""
    model = build_model(parse_spec(_probe_spec(on, **head))).double().eval()
    weights, used = renamed(model, source, rename)
    model.load_state_dict(weights, strict=on)  # the control has no probe to load
    assert used == set(source) or not on
    x = torch.randn(2, 3, IMAGE, IMAGE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), float64_reference():
        return (model(x) - ref(x)).abs().max().item()


def test_attention_pool_is_timms_map_pool() -> None:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    ref = VisionTransformer(
        img_size=IMAGE, patch_size=6, embed_dim=48, depth=2, num_heads=4, num_classes=5,
        class_token=False, global_pool="map",
    )  # fmt: skip
    ref = perturbed(ref, 0).double().eval()
    _check(lambda on: _probe_diff(ref, _PROBE_KEYS, ref.state_dict(), on))


def test_attention_pool_is_siglips_head() -> None:
    """HF's SigLIP vision tower pools with ``nn.MultiheadAttention`` over a probe; with ``classes: null``
    the pooled features are its ``pooler_output``."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(
        hidden_size=48, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE, patch_size=6, hidden_act="gelu", attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    tower = perturbed(SiglipVisionModel(config), 0).double().eval()
    source = dict(tower.state_dict())
    packed = source.pop("head.attention.in_proj_weight"), source.pop("head.attention.in_proj_bias")
    for name, w in zip(("weight", "bias"), packed, strict=True):  # (3D, ...) as [q; k; v]
        source[f"q.{name}"], source[f"kv.{name}"] = w[:48], w[48:]
    rename: Rename = [
        (r"encoder\.patch_embed\.proj\.(\w+)", "embeddings.patch_embedding.{0}"),
        (r"encoder\.pos_embed\.weight", "embeddings.position_embedding.weight"),
        (r"encoder\.blocks\.(\d+)\.norm(\d)\.(\w+)", "encoder.layers.{0}.layer_norm{1}.{2}"),
        (
            r"encoder\.blocks\.(\d+)\.attn\.qkv\.(\w+)",
            tuple(f"encoder.layers.{{0}}.self_attn.{c}_proj.{{1}}" for c in "qkv"),
        ),
        (r"encoder\.blocks\.(\d+)\.attn\.proj\.(\w+)", "encoder.layers.{0}.self_attn.out_proj.{1}"),
        (r"encoder\.blocks\.(\d+)\.mlp\.(.*)", "encoder.layers.{0}.mlp.{1}"),
        (r"encoder\.norm\.(\w+)", "post_layernorm.{0}"),
        (r"head\.pool\.latent\.weight", "head.probe"),
        (r"head\.pool\.attn\.(q|kv)\.(\w+)", "{0}.{1}"),
        (r"head\.pool\.attn\.proj\.(\w+)", "head.attention.out_proj.{0}"),
        (r"head\.pool\.norm\.(\w+)", "head.layernorm.{0}"),
        (r"head\.pool\.mlp\.(.*)", "head.mlp.{0}"),
    ]
    features = {"classes": None}
    _check(lambda on: _probe_diff(lambda x: tower(x).pooler_output, rename, source, on, **features))


def test_attention_pool_ejects_and_checks_its_heads() -> None:
    ejects_the_same(_probe_spec(), torch.randn(2, 3, IMAGE, IMAGE))
    graph = build_graph(parse_spec(_probe_spec()))
    assert graph["head.pool.attn"]["op"] == "cross_attention"
    assert graph["head.pool.token"]["shape"] == ("B", 48)
    spec = _probe_spec()
    spec["head"]["probe"] = {"heads": 5}
    assert (
        problem(spec) == "head.probe.heads: the probe's 5 heads do not divide the width 48 (set "
        "head.probe.heads to a divisor of 48)"
    )
    spec = _probe_spec(on=False)
    spec["head"]["probe"] = {"heads": 4}
    assert problem(spec) == (
        "head.probe: probe sets the attention pool, and this head pools by mean (set pool: attention, or "
        "remove probe)"
    )


# ------------------------------------------------------------------------------ DeBERTa: disentangled


def _deberta_spec(on: bool = True) -> dict[str, Any]:
    position = {"kind": "disentangled", "buckets": 8, "max_distance": 64} if on else "none"
    block = {"heads": 4, "norm": {"kind": "layernorm", "eps": 1e-7, "placement": "post"}}
    return {
        "specvit": 1,
        "name": "deberta",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "tokens", "vocab": 97},
            "position": position,
            "width": 48,
            "depth": 2,
            "block": block | {"mlp": {"hidden": 40, "activation": "gelu"}},
            "embed_norm": True,
            "final_norm": False,
        },
        "head": "none",
    }


_DEBERTA_KEYS: Rename = [
    ("encoder.tok_embed.weight", "embeddings.word_embeddings.weight"),
    (r"encoder\.embed_norm\.(\w+)", "embeddings.LayerNorm.{0}"),
    ("encoder.rel_embed.weight", "encoder.rel_embeddings.weight"),
    (r"encoder\.rel_embed\.norm\.(\w+)", "encoder.LayerNorm.{0}"),
    *block_keys(
        "encoder.layer.{0}.",
        ("attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj"),
        "attention.output.dense",
        "attention.output.LayerNorm",
        "intermediate.dense",
        "output.dense",
        "output.LayerNorm",
    ),
]


def test_disentangled_attention_is_debertas() -> None:
    """DeBERTa-v3's layout at a small size: 8 log buckets to 64 over 20 tokens, a layer-normed relative
    table shared by the layers, each projecting it with its own query and key weights."""
    from transformers import DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(
        vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=64, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False, type_vocab_size=0,
        layer_norm_eps=1e-7, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    ref = perturbed(DebertaV2Model(config), 0).double().eval()
    source = ref.state_dict()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), float64_reference():
        theirs = ref(input_ids=ids).last_hidden_state

    def diff(on: bool) -> float:
        model = build_model(parse_spec(_deberta_spec(on))).double().eval()
        weights, used = renamed(model, source, _DEBERTA_KEYS)
        assert used == set(source) or not on
        model.load_state_dict(weights, strict=on)
        with torch.no_grad():
            return (model(ids) - theirs).abs().max().item()

    _check(diff)


def test_disentangled_attention_ejects_and_stays_an_encoders() -> None:
    ejects_the_same(_deberta_spec(), torch.randint(0, 97, (2, 20)))
    causal = _deberta_spec()
    causal["model"], causal["decoder"] = "decoder", causal.pop("encoder")
    causal["decoder"]["block"]["layers"] = ["masked_self_attention", "mlp"]
    assert problem(causal) == (
        "decoder.position: disentangled attention scores every key against every query: it is an encoder's "
        "(use another position kind)"
    )
