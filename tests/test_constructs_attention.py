"""Parts of the attention core checked in float64 against the model that published them: ConViT's gated
positional self-attention (timm), in its local blocks before the class token enters.

Every test has a control: the same spec with only that construct switched off must fail the same
assertion.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import float64_reference, perturbed
from test_constructs import Rename, _check, renamed

from specvit.compile import build_graph, build_model, eject
from specvit.errors import SpecError
from specvit.spec.loader import parse_spec

IMAGE, LOCAL = 24, 2


def _convit_spec(gated: bool = True) -> dict[str, Any]:
    return {
        "specvit": 1,
        "name": "convit",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "image", "size": IMAGE, "patch": 4},
            "prefix": {"cls": True, "at": LOCAL},  # ConViT's class token joins after its local blocks
            "position": {"kind": "learned", "include_prefix": False},
            "width": 48,
            "depth": 4,
            "block": {
                "heads": 4,
                "norm": {"kind": "layernorm", "eps": 1e-6},
                "mlp": {"ratio": 4, "activation": "gelu"},
                "qkv_bias": False,
            },
            "overrides": [{"layers": list(range(LOCAL)), "block": {"gated_positions": gated}}],
            "final_norm": True,
        },
        "head": {"kind": "classifier", "pool": "cls", "classes": 5},
    }


_CONVIT_KEYS: Rename = [
    (r"encoder\.patch_embed\.proj\.(\w+)", "patch_embed.proj.{0}"),
    (r"encoder\.prefix\.cls_token", "cls_token"),
    (r"encoder\.pos_embed\.weight", "pos_embed"),
    (
        r"encoder\.blocks\.([01])\.attn\.qkv\.weight",
        ("blocks.{0}.attn.qk.weight", "blocks.{0}.attn.v.weight"),
    ),
    (r"encoder\.blocks\.(\d+)\.(.*)", "blocks.{0}.{1}"),
    (r"encoder\.norm\.(\w+)", "norm.{0}"),
    (r"head\.fc\.(\w+)", "head.{0}"),
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
    graph = build_graph(parse_spec(_convit_spec()), batch=2)
    torch.manual_seed(0)
    compiled = build_model(graph).eval()
    namespace: dict[str, Any] = {"__name__": "ejected"}
    exec(compile(eject(graph), "<ejected>", "exec"), namespace)
    ejected = namespace["Model"]().eval()
    ejected.load_state_dict(compiled.state_dict())
    x = torch.randn(2, 3, IMAGE, IMAGE)
    with torch.no_grad():
        assert (ejected(x) - compiled(x)).abs().max().item() == 0.0
    node = "encoder.blocks.0.attn"
    assert "gated positions" in " ".join(graph.op(node).label(graph[node]["p"]))


def _problem(spec: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        build_graph(parse_spec(spec))
    return str(info.value.problems[0]).removeprefix("<string>: ")


def test_gated_positions_need_the_grid_alone() -> None:
    late = _convit_spec()
    late["encoder"]["overrides"][0]["layers"] = [2]
    assert _problem(late) == (
        "encoder.overrides.0.block.gated_positions: layer 2 sees the prefix tokens, and gated positions are "
        "over the patch grid alone (set prefix.at above 2 (ConViT adds its class token after the gated blocks))"
    )
    text = _convit_spec()
    text["encoder"] |= {"input": {"kind": "tokens", "vocab": 50}, "position": "none"}
    del text["encoder"]["prefix"]
    assert _problem(text | {"head": "none"}) == (
        "encoder.overrides.0.block.gated_positions: gated positions are over the patch grid of a plain image "
        "stack (remove it)"
    )
