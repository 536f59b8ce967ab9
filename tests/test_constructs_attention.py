"""Parts of the attention core checked in float64 against the model that published them: ConViT's gated
positional self-attention (timm), in its local blocks before the class token enters.

Every test has a control: the same spec with only that construct switched off must fail the same
assertion.
"""

from __future__ import annotations

from typing import Any

import torch
from reference import float64_reference, perturbed
from test_constructs import Rename, _check, renamed
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
