"""CaiT (Touvron et al. 2021): talking-heads attention, class-attention blocks and a class token entering
late, exact against timm's ``Cait``; the presets equal timm's models; what specvit cannot state is refused.

References are built by timm from kwargs with seeded random weights moved off their init (nothing is
downloaded); fp32, eval, max abs diff <= 1e-5.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from reference import timm_model, timm_parity
from torch import nn

import specvit
from specvit.diagram import to_dot
from specvit.errors import SpecError
from specvit.nn.attention import SelfAttention
from specvit.nn.cait import ClassAttention, TalkingHeadsAttention

CASES: dict[str, dict[str, Any]] = {
    "tiny": {"depth": 2, "img_size": 32, "embed_dim": 64, "num_heads": 4, "num_classes": 10},
    "rect_no_bias_avg_one_ca_block": {
        "depth": 3,
        "depth_token_only": 1,
        "img_size": (32, 48),
        "patch_size": 8,
        "embed_dim": 48,
        "num_heads": 3,
        "qkv_bias": False,
        "global_pool": "avg",
        "mlp_ratio_token_only": 2.0,
        "num_classes": 5,
    },
    "three_ca_blocks_odd_grid": {
        "depth": 1,
        "depth_token_only": 3,
        "img_size": 40,
        "patch_size": 8,
        "embed_dim": 40,
        "num_heads": 5,
        "mlp_ratio": 3.0,
        "init_values": 1e-2,
        "num_classes": 3,
    },
    "no_ca_blocks": {"depth": 2, "depth_token_only": 0, "img_size": 32, "embed_dim": 32, "num_heads": 2},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_timm_cait_is_read_exactly(case: str) -> None:
    ref = timm_model("cait_xxs24_224", seed=1, **CASES[case])
    model, diff = timm_parity(ref)
    assert diff <= 1e-5, diff
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize(("preset", "count"), [("cait_xxs24_224", 11_956_264), ("cait_s24_224", 46_916_200)])
def test_presets_have_timms_parameter_count(preset: str, count: int) -> None:
    import timm

    with torch.device("meta"):
        ref = timm.create_model(preset, pretrained=False)
    assert sum(p.numel() for p in ref.parameters()) == count
    graph = specvit.build_graph(specvit.load_spec(preset))
    assert sum(int(a["params"]) for _, a in graph.nx.nodes(data=True)) == count


@pytest.mark.parametrize("preset", ["cait_xxs24_224", "cait_s24_224"])
def test_from_timm_of_the_presets_model_is_the_preset(preset: str) -> None:
    torch.manual_seed(0)
    import timm

    ref = timm.create_model(
        preset, pretrained=False, depth=2, depth_token_only=2, img_size=64, num_classes=10
    )
    small = {
        "encoder.depth": 4,
        "encoder.prefix.at": 2,
        "encoder.schedule": [{"block": 2}, {"class": 2}],
        "encoder.input.size": 64,
        "head.classes": 10,
    }
    expected = specvit.load_spec(preset, overrides=small).model_dump()
    got = specvit.from_timm(ref).model_dump()
    for key in ("name", "description"):
        expected.pop(key), got.pop(key)
    # a variant is stored as the keys it sets: the imported one names its layers and talking_heads only
    assert got == expected


@pytest.mark.parametrize(
    ("kwargs", "path", "text"),
    [
        ({"drop_path_rate": 0.1}, "model.blocks.0.drop_path.drop_prob", "one rate for every self-attention"),
        ({"global_pool": ""}, "model.global_pool", "pools by the class token or the mean"),
        ({"act_layer": nn.Tanh}, "model.blocks.0.mlp.act", "does not read"),
    ],
)
def test_what_specvit_cannot_state_is_refused(kwargs: dict[str, Any], path: str, text: str) -> None:
    ref = timm_model("cait_xxs24_224", seed=0, depth=1, img_size=32, **kwargs)
    with pytest.raises(SpecError) as err:
        specvit.from_timm(ref)
    problem = err.value.problems[0]
    assert problem.path == path and text in problem.message, problem


@pytest.mark.parametrize(
    ("overrides", "path", "text"),
    [
        ({"encoder.prefix.at": 30}, "encoder.prefix.at", "the stack has 26"),
        ({"encoder.prefix.at": 25}, "encoder.prefix", "block 24 has class_attention, but no class token"),
        ({"encoder.position": "learned"}, "encoder.position", "after the prefix"),
        ({"encoder.blocks.class.parallel": True}, "encoder.blocks.class.parallel", "not in parallel"),
        ({"encoder.blocks.class.qk_norm": True}, "encoder.blocks.class.qk_norm", "no qk_norm"),
        ({"encoder.block.sliding_window": 8}, "encoder.block.talking_heads", "attends globally"),
        ({"encoder.block.layers": ["mlp"]}, "encoder.block.talking_heads", "the block has none"),
    ],
)
def test_bad_cait_specs_are_refused_with_a_fix(overrides: dict[str, Any], path: str, text: str) -> None:
    with pytest.raises(SpecError) as err:
        specvit.load_spec("cait_xxs24_224", overrides=overrides)
    problems = [p for p in err.value.problems if p.path == path]
    assert problems and text in problems[0].message and problems[0].hint, err.value.problems


def test_talking_heads_with_identity_maps_is_plain_attention_float64() -> None:
    torch.manual_seed(0)
    talking = TalkingHeadsAttention(32, 4, dtype=torch.float64).eval()
    plain = SelfAttention(32, 4, dtype=torch.float64).eval()
    plain.load_state_dict({k: v for k, v in talking.state_dict().items() if "proj_" not in k})
    with torch.no_grad():
        for lin in (talking.proj_l, talking.proj_w):
            lin.weight.copy_(torch.eye(4)), lin.bias.zero_()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    mask = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    assert torch.allclose(talking(x, mask=mask), plain(x, mask=mask), atol=1e-12, rtol=0)
    with torch.no_grad():  # mixing the heads changes the output
        talking.proj_l.weight.copy_(torch.eye(4).flip(0))
    assert (talking(x) - plain(x)).abs().max() > 1e-3


def test_class_attention_is_the_class_tokens_softmax_over_all_tokens_float64() -> None:
    torch.manual_seed(0)
    attn = ClassAttention(16, 2, dtype=torch.float64).eval()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    q = attn.q(x[:, :1]).view(3, 1, 2, 8).transpose(1, 2)  # (B, H, 1, hd)
    k = attn.k(x).view(3, 5, 2, 8).transpose(1, 2)  # (B, H, N, hd)
    v = attn.v(x).view(3, 5, 2, 8).transpose(1, 2)
    weights = (q @ k.transpose(-2, -1) / 8**0.5).softmax(-1)  # (B, H, 1, N)
    expected = attn.proj((weights @ v).transpose(1, 2).reshape(3, 1, 16))
    assert torch.allclose(attn(x), expected, atol=1e-12, rtol=0)


def test_only_the_class_token_changes_in_class_attention_blocks() -> None:
    spec = specvit.load_spec(
        "cait_xxs24_224",
        overrides={
            "encoder.depth": 3,
            "encoder.prefix.at": 1,
            "encoder.schedule": [{"block": 1}, {"class": 2}],
            "encoder.input.size": 32,
        },
    )
    model = specvit.build_model(spec).eval()
    seen: dict[str, torch.Tensor] = {}
    model.encoder.blocks[1].register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert seen["out"].shape == (2, 5, 192)
    assert torch.equal(seen["out"][:, 1:], seen["x"][:, 1:])  # the patch tokens pass through
    assert not torch.equal(seen["out"][:, :1], seen["x"][:, :1])


def test_diagram_shows_talking_heads_and_the_class_attention_stage_folded_apart() -> None:
    graph = specvit.build_graph(specvit.load_spec("cait_xxs24_224"))
    dot = to_dot(graph)
    assert "<b>encoder.blocks.0-23  x24</b>" in dot and "<b>encoder.blocks.24-25  x2</b>" in dot
    nodes = dict(re.findall(r'^\s*"([^"]+)" \[label=(.*)$', dot, flags=re.M))
    assert "talking heads" in nodes["encoder.blocks.0.attn"]
    assert "<b>class_attention</b>" in nodes["encoder.blocks.24.attn"]
    assert "class token queries all tokens" in nodes["encoder.blocks.24.attn"]
    assert "B x 1 x 192" in nodes["encoder.blocks.24.attn"]  # one query: the class token
    assert "B x 197 x 192" in nodes["encoder.prefix"]  # the class token enters before block 24
    edges = set(re.findall(r'^\s*"([^"]+)" -> "([^"]+)"', dot, flags=re.M))
    assert ("encoder.blocks.0.add2", "encoder.prefix") in edges
    assert ("encoder.prefix", "encoder.blocks.24.norm1") in edges
