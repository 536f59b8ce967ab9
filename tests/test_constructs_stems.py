"""Stems and map heads written in generic layers (conv, norm, act, pool), each stated in a spec and checked in
float64 against the model that published it: Whisper's Conv1d stem over a log-mel signal (HF transformers),
the ResNet-style stem of timm's hybrid ViTs (weight-standardised conv, GroupNorm, ReLU, max pool) and timm's
ConvStem (conv, BatchNorm, ReLU). SAM's neck is the same layers under a shorthand.

Every test has a control: the same spec with only that construct switched off must fail the same
assertion.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest
import torch
from reference import float64_reference, perturbed
from test_constructs import Rename, _check, _double, renamed
from torch import nn

from specvit.compile import build_graph, build_model, eject
from specvit.errors import SpecError
from specvit.model import SpecModel
from specvit.spec.loader import parse_spec


def _load(spec: dict[str, Any], ref: nn.Module, rename: Rename) -> SpecModel:
    """The spec's model in float64 with every one of ``ref``'s weights renamed into it."""
    model = build_model(parse_spec(spec)).double().eval()
    weights, used = renamed(model, ref.state_dict(), rename)
    assert set(ref.state_dict()) == used, f"weights with no place: {set(ref.state_dict()) - used}"
    model.load_state_dict(weights)
    return model


def _max_diff(ours: nn.Module, ref: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad(), float64_reference():
        theirs = ref(x)
        theirs = getattr(theirs, "last_hidden_state", theirs)
        return (ours(x) - theirs).abs().max().item()


# ------------------------------------------------------------------------------ Whisper: a Conv1d stem

MELS, FRAMES, WIDTH = 12, 40, 48


def _whisper_spec(second_act: bool = True) -> dict[str, Any]:
    conv = {"kind": "conv", "channels": WIDTH, "kernel": 3, "padding": 1}
    stem = [conv, {"kind": "act", "fn": "gelu"}, conv | {"stride": 2}]
    return {
        "specvit": 1,
        "name": "whisper_encoder",
        "model": "encoder",
        "encoder": {
            "input": {
                "kind": "signal",
                "channels": MELS,
                "length": FRAMES,
                "stem": stem + [stem[1]] * second_act,
            },
            "position": "learned",
            "width": WIDTH,
            "depth": 2,
            "block": {
                "heads": 4,
                "qkv_bias": [True, False, True],
                "norm": {"kind": "layernorm", "eps": 1e-5},
                "mlp": {"hidden": 40, "activation": "gelu"},
            },
            "final_norm": True,
        },
        "head": "none",
    }


_WHISPER_KEYS: Rename = [
    (r"encoder\.stem\.0\.(\w+)", "conv1.{0}"),
    (r"encoder\.stem\.2\.(\w+)", "conv2.{0}"),
    (r"encoder\.pos_embed\.weight", "embed_positions.weight"),
    (r"encoder\.blocks\.(\d+)\.norm1\.(\w+)", "layers.{0}.self_attn_layer_norm.{1}"),
    (r"encoder\.blocks\.(\d+)\.norm2\.(\w+)", "layers.{0}.final_layer_norm.{1}"),
    (
        r"encoder\.blocks\.(\d+)\.attn\.qkv\.weight",
        tuple(f"layers.{{0}}.self_attn.{c}_proj.weight" for c in "qkv"),
    ),
    (r"encoder\.blocks\.(\d+)\.attn\.([qv])_bias", "layers.{0}.self_attn.{1}_proj.bias"),
    (r"encoder\.blocks\.(\d+)\.attn\.proj\.(\w+)", "layers.{0}.self_attn.out_proj.{1}"),
    (r"encoder\.blocks\.(\d+)\.mlp\.(fc\d)\.(\w+)", "layers.{0}.{1}.{2}"),
    (r"encoder\.norm\.(\w+)", "layer_norm.{0}"),
]


def test_whisper_encoder_is_a_conv1d_stem_over_a_signal() -> None:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(
        num_mel_bins=MELS,
        max_source_positions=FRAMES // 2,
        d_model=WIDTH,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=40,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    ref = _double(perturbed(WhisperEncoder(config), 0)).eval()
    x = torch.randn(2, MELS, FRAMES, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _check(lambda on: _max_diff(_load(_whisper_spec(second_act=on), ref, _WHISPER_KEYS), ref, x))


def test_a_signal_input_checks_its_shape_in_words() -> None:
    model = build_model(parse_spec(_whisper_spec()))
    with pytest.raises(ValueError, match=r"the spec's signals have 40 frames, not 30 \(input.length\)"):
        model(torch.randn(1, MELS, 30))
    with pytest.raises(ValueError, match=r"the spec's signals have 12 channels, not 80 \(input.channels\)"):
        model(torch.randn(1, 80, FRAMES))


# ------------------------------------------------------------------ timm hybrid ViTs: a ResNet-style stem

IMAGE = 36


def vit_spec(stem: list[dict[str, Any]], patch: int) -> dict[str, Any]:
    return {
        "specvit": 1,
        "name": "hybrid_vit",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "image", "size": IMAGE, "patch": patch, "stem": stem},
            "prefix": {"cls": True},
            "position": "learned",
            "width": 48,
            "depth": 2,
            "block": {
                "heads": 4,
                "norm": {"kind": "layernorm", "eps": 1e-6},
                "mlp": {"ratio": 4, "activation": "gelu"},
                "qkv_bias": True,
            },
            "final_norm": True,
        },
        "head": {"kind": "classifier", "pool": "cls", "classes": 5},
    }


VIT_KEYS: Rename = [
    (r"encoder\.patch_embed\.proj\.(\w+)", "patch_embed.proj.{0}"),
    (r"encoder\.prefix\.cls_token", "cls_token"),
    (r"encoder\.pos_embed\.weight", "pos_embed"),
    (r"encoder\.blocks\.(\d+)\.(.*)", "blocks.{0}.{1}"),
    (r"encoder\.norm\.(\w+)", "norm.{0}"),
    (r"head\.fc\.(\w+)", "head.{0}"),
]


def _hybrid(backbone: nn.Module, patch: int) -> nn.Module:
    import timm.layers.hybrid_embed
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    embed = partial(timm.layers.hybrid_embed.HybridEmbed, backbone=backbone)
    ref = VisionTransformer(
        img_size=IMAGE, patch_size=patch, embed_dim=48, depth=2, num_heads=4, num_classes=5, embed_layer=embed
    )
    return perturbed(ref, 0).double().eval()


def _image() -> torch.Tensor:
    return torch.randn(2, 3, IMAGE, IMAGE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _resnet_stem(standardize: float | None) -> list[dict[str, Any]]:
    return [
        {"kind": "conv", "channels": 24, "kernel": 7, "stride": 2, "padding": 3, "bias": False}
        | ({"standardize": standardize} if standardize else {}),
        {"kind": "norm", "type": "group", "groups": 6},
        {"kind": "act", "fn": "relu"},
        {"kind": "pool", "type": "max", "kernel": 3, "stride": 2, "padding": 1},
    ]


def test_the_resnet_stem_of_timm_hybrid_vits() -> None:
    from timm.layers import GroupNormAct, StdConv2d
    from timm.models.resnetv2 import create_resnetv2_stem

    stem = create_resnetv2_stem(
        3,
        out_chs=24,
        stem_type="",
        preact=False,
        conv_layer=partial(StdConv2d, eps=1e-8),
        norm_layer=partial(GroupNormAct, num_groups=6),
    )
    ref = _hybrid(stem, patch=3)
    keys = [
        (r"encoder\.stem\.0\.weight", "patch_embed.backbone.conv.weight"),
        (r"encoder\.stem\.1\.(\w+)", "patch_embed.backbone.norm.{0}"),
        *VIT_KEYS,
    ]
    spec = partial(vit_spec, patch=3)
    _check(lambda on: _max_diff(_load(spec(_resnet_stem(1e-8 if on else None)), ref, keys), ref, _image()))


def test_timm_convstem_with_batch_norm_in_eval() -> None:
    from timm.models.vision_transformer_hybrid import ConvStem

    torch.manual_seed(0)
    stem = ConvStem(
        in_chans=3, depth=3, channels=(8, 16, 24), kernel_size=3, stride=(2, 2, 1), act_layer=nn.ReLU
    )
    ref = _hybrid(stem, patch=3)
    layers: list[dict[str, Any]] = []
    for channels, stride in ((8, 2), (16, 2)):
        layers += [
            {"kind": "conv", "channels": channels, "kernel": 3, "stride": stride, "padding": 1, "bias": False}
        ]
        layers += [{"kind": "norm", "type": "batch"}, {"kind": "act", "fn": "relu"}]
    layers += [{"kind": "conv", "channels": 24, "kernel": 3, "padding": 1}]
    keys = [
        (r"encoder\.stem\.0\.weight", "patch_embed.backbone.0.conv.weight"),
        (r"encoder\.stem\.1\.(\w+)", "patch_embed.backbone.0.bn.{0}"),
        (r"encoder\.stem\.3\.weight", "patch_embed.backbone.1.conv.weight"),
        (r"encoder\.stem\.4\.(\w+)", "patch_embed.backbone.1.bn.{0}"),
        (r"encoder\.stem\.6\.(\w+)", "patch_embed.backbone.2.conv.{0}"),
        *VIT_KEYS,
    ]
    ours = _load(vit_spec(layers, patch=3), ref, keys)

    def diff(running_stats: bool) -> float:  # the control normalises by the batch's statistics instead
        return _max_diff(ours.eval() if running_stats else copy.deepcopy(ours).train(), ref, _image())

    _check(diff)


# ----------------------------------------------------------------------------- SAM's neck is a map head

_NECK = [
    {"kind": "conv", "channels": 16, "kernel": 1, "bias": False},
    {"kind": "norm", "type": "layer", "eps": 1e-6},
    {"kind": "conv", "channels": 16, "kernel": 3, "padding": 1, "bias": False},
    {"kind": "norm", "type": "layer", "eps": 1e-6},
]


def _sam_like(head: dict[str, Any]) -> dict[str, Any]:
    spec = vit_spec([], patch=6)
    del spec["encoder"]["prefix"]
    spec["encoder"]["position"] = "none"
    return spec | {"head": head}


def test_sams_neck_is_the_map_head_of_its_layers() -> None:
    neck = build_graph(parse_spec(_sam_like({"kind": "neck", "channels": 16, "pool": "mean", "classes": 5})))
    spelled = build_graph(parse_spec(_sam_like({"kind": "map", "ops": _NECK, "pool": "mean", "classes": 5})))
    nodes = [(n, neck[n]["op"], neck[n]["p"], neck[n]["shape"]) for n in neck.nx if n.startswith("head.")]
    ops = [
        (n.replace(".ops.", ".neck."), spelled[n]["op"], spelled[n]["p"], spelled[n]["shape"])
        for n in spelled.nx
    ]
    assert [n[1] for n in nodes] == [
        "to_map",
        "conv",
        "channel_norm",
        "conv",
        "channel_norm",
        "map_pool",
        "linear",
    ]
    assert nodes == [o for o in ops if o[0].startswith("head.")]
    assert nodes[4][3] == ("B", 16, 6, 6)


# --------------------------------------------------------------------------------- eject and the rules


@pytest.mark.parametrize(
    ("spec", "x"),
    [
        (_whisper_spec(), torch.randn(2, MELS, FRAMES)),
        (vit_spec(_resnet_stem(1e-8), patch=3), torch.randn(2, 3, IMAGE, IMAGE)),
        (
            _sam_like({"kind": "map", "ops": [*_NECK, {"kind": "act", "fn": "silu"}]}),
            torch.randn(2, 3, IMAGE, IMAGE),
        ),
    ],
    ids=["whisper", "resnet_stem", "map_head"],
)
def test_stems_and_map_heads_eject_to_the_same_model(spec: dict[str, Any], x: torch.Tensor) -> None:
    ejects_the_same(spec, x)


def ejects_the_same(spec: dict[str, Any], x: torch.Tensor) -> None:
    """The ejected file of ``spec`` loads the built model's weights and gives its outputs on ``x`` exactly."""
    graph = build_graph(parse_spec(spec), batch=2)
    torch.manual_seed(0)
    compiled = build_model(graph).eval()
    namespace: dict[str, Any] = {"__name__": "ejected"}
    exec(compile(eject(graph), "<ejected>", "exec"), namespace)
    ejected = namespace["Model"]().eval()
    ejected.load_state_dict(compiled.state_dict())
    with torch.no_grad():
        assert (ejected(x) - compiled(x)).abs().max().item() == 0.0


def problem(spec: dict[str, Any]) -> str:
    """The first problem building ``spec`` reports, without the source name."""
    with pytest.raises(SpecError) as info:
        build_graph(parse_spec(spec))
    return str(info.value.problems[0]).removeprefix("<string>: ")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda s: s["encoder"]["input"]["stem"].append({"kind": "conv", "channels": 32, "kernel": 1}),
            "encoder.input.stem: the stem leaves 32 channels and the stack is 48 wide "
            "(end the stem with a conv to 48 channels)",
        ),
        (
            lambda s: s["encoder"]["input"]["stem"][2].update(kernel=45),
            "encoder.input.stem.2.kernel: a 45-wide window does not fit a side of 40 padded by 1 "
            "(use a kernel of at most 42, or more padding)",
        ),
        (
            lambda s: s["encoder"]["input"]["stem"][0].update(groups=5),
            "encoder.input.stem.0.groups: 5 groups do not divide 12 input and 48 output channels "
            "(use a number of groups dividing both)",
        ),
        (
            lambda s: s["encoder"]["position"].update(max_len=40),
            "encoder.position.max_len: the signal gives 20 positions, not 40 "
            "(remove max_len: it is derived from the signal's length and stem)",
        ),
    ],
    ids=["channels", "kernel", "groups", "max_len"],
)
def test_stem_mistakes_name_the_layer_and_the_fix(edit: Any, expected: str) -> None:
    spec = _whisper_spec()
    spec["encoder"]["position"] = {"kind": "learned"}
    edit(spec)
    assert problem(spec) == expected


def test_image_stem_mistakes_name_the_layer_and_the_fix() -> None:
    bad_groups = vit_spec(_resnet_stem(None), patch=3)
    bad_groups["encoder"]["input"]["stem"][1]["groups"] = 5
    assert problem(bad_groups) == (
        "encoder.input.stem.1.groups: a group norm over 24 channels needs a number of groups dividing them, "
        "got 5 groups (set groups to a divisor of the channels, such as 32)"
    )
    assert problem(vit_spec(_resnet_stem(None), patch=4)) == (
        "encoder.input.patch: the stem's output map 9 is not divisible by patch 4 (use a patch size that divides "
        "9, such as 1 or 3)"
    )
    patches = vit_spec(_resnet_stem(None), patch=3) | {"head": {"kind": "patches"}}
    del patches["encoder"]["prefix"]
    assert problem(patches) == (
        "encoder.input.stem: a patches head predicts the pixels of each patch, and after a stem a token covers "
        "more (remove the stem, or use another head)"
    )
