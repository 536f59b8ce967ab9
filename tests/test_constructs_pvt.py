"""The Pyramid Vision Transformer v2 (Wang et al. 2022) stated in the language and checked in float64 against
HF transformers' ``PvtV2Model`` and ``PvtV2ForImageClassification`` (random weights moved off their init):

- spatial-reduction attention, a part of the attention core (``block.spatial_reduction``): keys and values
  from an r x r conv of stride r over the token grid and a LayerNorm, queries from every token;
- stages of free widths (``widths``) with per-stage heads, reductions and MLP ratios (``overrides`` by
  ``stages``);
- the overlapping patch embeddings as generic map layers: the image input's ``stem`` (no patches cut) and the
  stack's ``downsample`` between stages (the stage's LayerNorm, a 3x3 conv of stride 2, a LayerNorm);
- the Mix-FFN (``mlp.dwconv``): a depthwise 3x3 conv between the MLP's first layer and its activation.

Each construct has a control: the same spec with only it switched off must fail the same assertion.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import converted, float64_reference, perturbed
from test_constructs import _check
from test_constructs_stems import ejects_the_same, problem
from torch import nn

from specvit import from_hf
from specvit.codegen.check import differences, executed_graph, meta_shapes
from specvit.compile import build_graph, build_model, eject
from specvit.errors import SpecError
from specvit.model import SpecModel
from specvit.ops import OPS
from specvit.spec.loader import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "specs" / "pvt_v2_b0.yaml"
IMAGE, TOL = 64, 1e-10
WIDTHS, DEPTHS, HEADS, SR, RATIOS = [16, 32, 48, 64], [1, 2, 1, 1], [1, 2, 3, 4], [4, 2, 2, 1], [2, 2, 3, 3]


def pvt_spec(reduction: bool = True, dwconv: bool = True, head: Any = None) -> dict[str, Any]:
    """The odd small PVT v2 of the parity tests: 4 stages of widths 16, 32, 48, 64 on 64x64 images."""
    norm = {"kind": "norm", "type": "layer", "eps": 1e-6}
    return {
        "specvit": 1,
        "name": "pvt_v2_small",
        "model": "encoder",
        "encoder": {
            "input": {
                "kind": "image",
                "size": IMAGE,
                "stem": [
                    {"kind": "conv", "channels": WIDTHS[0], "kernel": 7, "stride": 4, "padding": 3},
                    norm,
                ],
            },
            "position": "none",
            "width": WIDTHS[0],
            "widths": WIDTHS,
            "depth": DEPTHS,
            "downsample": [norm, {"kind": "conv", "kernel": 3, "stride": 2, "padding": 1}, norm],
            "block": {
                "heads": HEADS,
                "spatial_reduction": SR if reduction else 1,
                "norm": {"kind": "layernorm", "eps": 1e-6},
                "mlp": {"ratio": RATIOS[0], "dwconv": dwconv},
            },
            "overrides": [{"stages": [2, 3], "block": {"mlp": {"ratio": RATIOS[2]}}}],
        },
        "head": head or {"kind": "map"},
    }


def _hf(classes: int | None = None) -> nn.Module:
    from transformers import PvtV2Config, PvtV2ForImageClassification, PvtV2Model

    config = PvtV2Config(
        image_size=IMAGE,
        depths=DEPTHS,
        hidden_sizes=WIDTHS,
        num_attention_heads=HEADS,
        sr_ratios=SR,
        mlp_ratios=RATIOS,
        **({"num_labels": classes, "architectures": ["PvtV2ForImageClassification"]} if classes else {}),
    )
    torch.manual_seed(0)
    model = PvtV2ForImageClassification(config) if classes else PvtV2Model(config)
    return perturbed(model, 0).double().eval()


_BLOCK = [  # specvit's key in a block -> HF's keys (concatenated) in PvtV2BlockLayer
    (r"attn\.qkv\.(\w+)", ("attention.query.{0}", "attention.key.{0}", "attention.value.{0}")),
    (r"attn\.q\.(\w+)", ("attention.query.{0}",)),
    (r"attn\.kv\.(\w+)", ("attention.key.{0}", "attention.value.{0}")),
    (r"attn\.sr\.(\w+)", ("attention.spatial_reduction.{0}",)),
    (r"attn\.norm\.(\w+)", ("attention.layer_norm.{0}",)),
    (r"attn\.proj\.(\w+)", ("attention.proj.{0}",)),
    (r"norm(\d)\.(\w+)", ("layer_norm_{0}.{1}",)),
    (r"mlp\.fc(\d)\.(\w+)", ("mlp.dense{0}.{1}",)),
    (r"mlp\.dwconv\.(\w+)", ("mlp.dwconv.dwconv.{0}",)),
]


def hf_keys(key: str, stages: int = len(DEPTHS), prefix: str = "") -> tuple[str, ...]:
    """The HF keys of specvit's ``key`` (under ``prefix``: ``pvt_v2.`` in the classifier)."""
    layer = prefix + "encoder.layers.{}."
    if m := re.fullmatch(r"encoder\.stem\.([01])\.(\w+)", key):
        return (layer.format(0) + ("patch_embedding.proj.", "patch_embedding.layer_norm.")[int(m[1])] + m[2],)
    if m := re.fullmatch(r"encoder\.stages\.(\d)\.downsample\.([012])\.(\w+)", key):
        s, i = int(m[1]), int(m[2])
        part = ("layer_norm.", "patch_embedding.proj.", "patch_embedding.layer_norm.")[i]
        return (layer.format(s - 1 if i == 0 else s) + part + m[3],)  # the previous stage's closing norm
    if m := re.fullmatch(r"encoder\.norm\.(\w+)", key):
        return (layer.format(stages - 1) + "layer_norm." + m[1],)
    if m := re.fullmatch(r"head\.fc\.(\w+)", key):
        return ("classifier." + m[1],)
    m = re.fullmatch(r"encoder\.stages\.(\d)\.blocks\.(\d)\.(.+)", key)
    assert m is not None, key
    for pattern, templates in _BLOCK:
        if inner := re.fullmatch(pattern, m[3]):
            block = layer.format(m[1]) + f"blocks.{m[2]}."
            return tuple(block + t.format(*inner.groups()) for t in templates)
    raise AssertionError(f"no HF key for {key}")


def load_hf(spec: dict[str, Any], ref: nn.Module, *, strict: bool = True) -> SpecModel:
    """The spec's model in float64 with ``ref``'s weights; ``strict``: every HF weight has its place (a
    control leaves the weights of the construct it switches off unused)."""
    model = build_model(parse_spec(spec)).double().eval()
    source, prefix = ref.state_dict(), "pvt_v2." if "classifier.weight" in ref.state_dict() else ""
    weights, used = {}, set()
    for key, value in model.state_dict().items():
        names = hf_keys(key, prefix=prefix)
        weights[key] = torch.cat([source[n].reshape(-1) for n in names]).view(value.shape)
        used.update(names)
    assert not strict or used == set(source), f"HF weights with no place: {set(source) - used}"
    model.load_state_dict(weights)
    return model


def _images() -> torch.Tensor:
    return torch.randn(2, 3, IMAGE, IMAGE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _diff(ours: nn.Module, ref: nn.Module) -> float:
    with torch.no_grad(), float64_reference():
        out = ref(_images())
        theirs = out.logits if hasattr(out, "logits") else out.last_hidden_state  # (B, classes), (B, C, H, W)
        return (ours(_images()) - theirs).abs().max().item()


@pytest.mark.parametrize("construct", ["spatial_reduction", "dwconv"])
def test_pvt_v2_equals_hf_and_each_construct_matters(construct: str) -> None:
    ref = _hf()

    def diff(on: bool) -> float:
        spec = pvt_spec(reduction=on or construct != "spatial_reduction", dwconv=on or construct != "dwconv")
        return _diff(load_hf(spec, ref, strict=on), ref)

    _check(diff)


def test_pvt_v2_classifier_equals_hfs() -> None:
    ref = _hf(classes=7)
    spec = pvt_spec(head={"kind": "classifier", "pool": "mean", "classes": 7})
    assert _diff(load_hf(spec, ref), ref) <= TOL


def test_a_spatial_reduction_keeps_queries_and_reduces_keys() -> None:
    graph = build_graph(parse_spec(pvt_spec()), batch=2)
    attn = [graph[n] for n in graph.nx if n.endswith(".attn")]
    assert [a["op"] for a in attn] == ["grid_attention"] * 4 + ["self_attention"]
    assert [(a["p"].reduction, a["p"].grid) for a in attn[:4]] == [
        (4, (16, 16)),
        (2, (8, 8)),
        (2, (8, 8)),
        (2, (4, 4)),
    ]
    # the conv r² D² + D, the norm 2D beside q, kv and proj (4 D² + 4 D)
    assert attn[0]["params"] == 16 * 16 * 16 + 16 + 32 + 4 * 16 * 16 + 4 * 16
    label = OPS["grid_attention"].label(attn[0]["p"])
    assert label[-1] == "keys, values of the grid reduced · 4x4 conv, stride 4 · 4x4 · norm"
    mlp = graph["encoder.stages.2.blocks.0.mlp"]
    assert (mlp["p"].hidden, mlp["p"].dwconv) == (144, (4, 4))  # ratio 3 by the stage override, the grid


def test_pvt_is_drawn_as_built_and_ejects_the_same() -> None:
    graph = build_graph(parse_spec(pvt_spec()), batch=2)
    model = build_model(graph, device="meta")
    assert differences(graph, executed_graph(model)) == []
    shapes = meta_shapes(build_model(graph, device="meta"), (torch.empty(2, 3, IMAGE, IMAGE, device="meta"),))
    declared = {
        n: graph.concrete(a["shape"]) for n, a in graph.nx.nodes(data=True) if a["shape"] and n != "output"
    }
    assert {n: shapes.get(n) for n in declared} == declared
    assert (declared["encoder.stages.3.downsample.tokens"], declared["head.map"]) == (
        (2, 4, 64),
        (2, 64, 2, 2),
    )
    ejects_the_same(pvt_spec(), torch.randn(2, 3, IMAGE, IMAGE))
    text = eject(graph)
    assert "reduce_tokens(" in text and "self.dwconv(" in text
    vit = eject(ROOT / "specs" / "vit_tiny_patch16_224.yaml")  # the parts fold away where unused
    assert all(f"{part}(" not in vit for part in ("reduce_tokens", "spatial_reduction", "self.dwconv"))


def test_the_preset_has_hfs_parameter_count() -> None:
    from transformers import PvtV2Config, PvtV2ForImageClassification

    spec = load_spec(PRESET)
    ref = PvtV2ForImageClassification(PvtV2Config(num_labels=1000))  # pvt_v2_b0 is the default config
    theirs = sum(p.numel() for p in ref.parameters())
    assert build_graph(spec).total_params == theirs == 3_666_760


def _encoder(edit: Any) -> Any:
    return lambda s: edit(s["encoder"])


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            _encoder(lambda e: e.update(widths=[16, 32, 48])),
            "encoder.widths: 3 widths, but depth has 4 stages (give one width per stage)",
        ),
        (
            _encoder(lambda e: e.update(width=32)),
            "encoder.widths.0: the first stage is 16 wide and width is 32 (set width: 16, the first stage's width)",
        ),
        (
            _encoder(
                lambda e: e.update(
                    depth=5, block=e["block"] | {"heads": 1, "spatial_reduction": 1}, overrides=[]
                )
            ),
            "encoder.widths: widths is about the stages of a hierarchical stack, and depth is one number (give "
            "depth per stage, e.g. depth: [2, 2, 2, 2], or remove widths)",
        ),
        (
            _encoder(lambda e: e["downsample"][1].update(channels=40)),
            "encoder.downsample: the layers into stage 1 leave 40 channels, and the stage is 32 wide (leave the "
            "channels of the downsample's conv out: it leads to each stage's width)",
        ),
        (
            _encoder(lambda e: e["downsample"][1].update(kernel=9, padding=0)),
            "encoder.downsample.1.kernel: into stage 2: a 9-wide window does not fit a side of 4 padded by 0 (use "
            "a kernel of at most 4, or more padding)",
        ),
        (
            _encoder(lambda e: e.update(merge_norm="post")),
            "encoder.merge_norm: merge_norm places the norm of patch merging, and downsample replaces patch "
            "merging (remove merge_norm)",
        ),
        (
            _encoder(lambda e: e["input"]["stem"][0].update(channels=24)),
            "encoder.input.stem: the stem leaves 24 channels and the stack is 16 wide (end the stem with a conv to "
            "16 channels)",
        ),
        (
            _encoder(lambda e: e["block"].update(spatial_reduction=[4, 2, 2])),
            "encoder.block.spatial_reduction: 3 stages of spatial_reduction, but depth has 4 (give one ratio per "
            "stage, or one number for all)",
        ),
        (
            _encoder(lambda e: e["overrides"].append({"stages": [3], "block": {"spatial_reduction": 4}})),
            "encoder.overrides.1.block.spatial_reduction: a 4x4 reduction does not fit stage 3's 2x2 grid (use at "
            "most 2)",
        ),
        (
            _encoder(lambda e: e["block"].update(window={"size": 2})),
            "encoder.block.spatial_reduction: a spatial reduction attends to the whole grid reduced, and window "
            "limits it (remove window)",
        ),
        (
            _encoder(lambda e: e["block"]["mlp"].update(activation="swiglu")),
            "encoder.block.mlp.dwconv: the depthwise conv sits before the activation of a plain MLP, and swiglu is "
            "gated (use a plain activation such as gelu, or set dwconv: false)",
        ),
        (
            _encoder(lambda e: e["overrides"][0].update(stages=[2, 4])),
            "encoder.overrides.0.stages.1: stage 4 does not exist: the stack has 4 (use 0 .. 3)",
        ),
        (
            _encoder(lambda e: e["overrides"][0].pop("stages")),
            "encoder.overrides.0: an override names no layers (give layers: [0, 1] or stages: [2, 3])",
        ),
    ],
    ids=[
        "widths-count",
        "widths-first",
        "widths-plain",
        "downsample-channels",
        "downsample-kernel",
        "merge-norm",
        "stem-width",
        "reduction-count",
        "reduction-fit",
        "reduction-window",
        "dwconv-gated",
        "override-stage",
        "override-empty",
    ],
)
def test_what_pvt_specs_cannot_state_names_the_key_and_the_fix(edit: Any, expected: str) -> None:
    spec = pvt_spec()
    edit(spec)
    assert problem(spec) == expected


def test_the_constructs_need_the_token_grid() -> None:
    text = {
        "specvit": 1,
        "name": "bert_like",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "tokens", "vocab": 11},
            "position": "learned",
            "width": 16,
            "depth": 1,
            "block": {"heads": 2, "mlp": {"dwconv": True}},
        },
    }
    assert problem(text) == (
        "encoder.block.mlp.dwconv: a depthwise conv runs over the token grid of an image stack, and the encoder "
        "reads tokens (set dwconv: false)"
    )
    text["encoder"]["block"] |= {"mlp": {}, "spatial_reduction": 2}
    assert problem(text) == (
        "encoder.block.spatial_reduction: a spatial reduction reduces the token grid of an image stack, and the "
        "encoder reads tokens (use an image input, or remove spatial_reduction)"
    )


# ----------------------------------------------------------------------------------- the HF importer


@pytest.mark.parametrize("classes", [None, 7], ids=["model", "classifier"])
def test_from_hf_states_pvt_v2_and_converts_its_weights(classes: int | None) -> None:
    ref = _hf(classes)
    spec = from_hf(ref.config)
    assert spec.model_dump(exclude={"name", "description"}) == parse_spec(
        pvt_spec(head={"kind": "classifier", "pool": "mean", "classes": 7} if classes else None)
    ).model_dump(exclude={"name", "description"})
    assert _diff(converted(ref, spec, "hf").double(), ref) <= TOL


def test_from_hf_of_the_default_config_is_the_preset() -> None:
    from transformers import PvtV2Config

    config = PvtV2Config(num_labels=1000, architectures=["PvtV2ForImageClassification"])
    exclude = {"name", "description"}
    assert from_hf(config).model_dump(exclude=exclude) == load_spec(PRESET).model_dump(exclude=exclude)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"linear_attention": True},
            "config.linear_attention: pvt_v2 config has linear_attention=True: PVT v2-Li pools keys and values to "
            "7x7 with a GELU and adds a ReLU to its MLP, which no spec states (use linear_attention: false "
            "(spatial-reduction attention, pvt_v2_b0 .. b5))",
        ),
        (
            {"patch_sizes": [7, 3, 5, 3]},
            "config.patch_sizes: pvt_v2 config has patch_sizes=[7, 3, 5, 3]: the patch embeddings after the first "
            "share one kernel and stride in a spec (give every stage after the first the same value)",
        ),
        (
            {"depths": [2, 2, 2]},
            "config.depths: pvt_v2 config has depths=[2, 2, 2]: num_encoder_blocks is 4 (give 4 values, one per "
            "stage)",
        ),
    ],
    ids=["linear-attention", "patch-sizes", "stage-count"],
)
def test_from_hf_refuses_what_no_spec_states(fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(SpecError) as info:
        from_hf({"model_type": "pvt_v2", **fields})
    assert str(info.value.problems[0]) == f"<dict>: {expected}"  # a config given as a dict is named so
