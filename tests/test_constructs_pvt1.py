"""The Pyramid Vision Transformer v1 (Wang et al. 2021) stated in the language and checked in float64 against
HF transformers' ``PvtModel`` and ``PvtForImageClassification`` (random weights moved off their init):

- a learned position table before chosen blocks (``block.absolute_position: learned``, set on each stage's first block
  by an override): one row per token entering the block (the stage's grid, and the class token once it is in),
  at the stage's width;
- the class token entering the last stage (``prefix: {cls: true, at: K}``, CaiT's late prefix) after the last
  downsample, with its row in that stage's table;
- spatial-reduction attention (``block.spatial_reduction``), plain MLPs, and non-overlapping patch embeddings as
  generic map layers: the image input's ``stem`` (a 4x4 conv of stride 4, a LayerNorm) and the ``downsample``
  between stages (a 2x2 conv of stride 2, a LayerNorm).

HF interpolates a table only when the input's size differs from the config's; a specvit image stack has one
size (its input check refuses others), so the tables are used as they are.
"""

from __future__ import annotations

import re
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
from specvit.inputs import InputError
from specvit.model import SpecModel
from specvit.spec.loader import parse_spec

IMAGE, TOL = 64, 1e-10
WIDTHS, DEPTHS, HEADS, SR, RATIOS = [16, 32, 48, 64], [1, 1, 2, 1], [1, 2, 3, 4], [4, 2, 2, 1], [2, 2, 3, 3]
STARTS = [sum(DEPTHS[:i]) for i in range(len(DEPTHS))]  # each stage's first block: 0, 1, 2, 4


def pvt1_spec(tables: bool = True, head: Any = None) -> dict[str, Any]:
    """The odd small PVT v1 of the parity tests; ``tables``: each stage's first block adds its table."""
    norm = {"kind": "norm", "type": "layer", "eps": 1e-5}
    overrides: list[dict[str, Any]] = [{"stages": [2, 3], "block": {"mlp": {"ratio": RATIOS[2]}}}]
    if tables:
        overrides.append({"layers": STARTS, "block": {"absolute_position": "learned"}})
    return {
        "specvit": 1,
        "name": "pvt_v1_small",
        "model": "encoder",
        "encoder": {
            "input": {
                "kind": "image",
                "size": IMAGE,
                "stem": [{"kind": "conv", "channels": WIDTHS[0], "kernel": 4, "stride": 4}, norm],
            },
            "position": "none",
            "prefix": {"cls": True, "at": STARTS[-1]},
            "width": WIDTHS[0],
            "widths": WIDTHS,
            "depth": DEPTHS,
            "downsample": [{"kind": "conv", "kernel": 2, "stride": 2}, norm],
            "block": {
                "heads": HEADS,
                "spatial_reduction": SR,
                "norm": {"kind": "layernorm", "eps": 1e-5},
                "mlp": {"ratio": RATIOS[0]},
            },
            "overrides": overrides,
        },
        "head": head or "none",
    }


def _hf(classes: int | None = None) -> nn.Module:
    from transformers import PvtConfig, PvtForImageClassification, PvtModel

    config = PvtConfig(
        image_size=IMAGE,
        depths=DEPTHS,
        hidden_sizes=WIDTHS,
        num_attention_heads=HEADS,
        sequence_reduction_ratios=SR,
        mlp_ratios=RATIOS,
        layer_norm_eps=1e-5,
        **({"num_labels": classes, "architectures": ["PvtForImageClassification"]} if classes else {}),
    )
    torch.manual_seed(0)
    model = PvtForImageClassification(config) if classes else PvtModel(config)
    return perturbed(model, 0).double().eval()


_BLOCK = [  # specvit's key in a block -> HF's keys (concatenated) in PvtLayer
    (r"attn\.qkv\.(\w+)", ("self.query.{0}", "self.key.{0}", "self.value.{0}")),
    (r"attn\.q\.(\w+)", ("self.query.{0}",)),
    (r"attn\.kv\.(\w+)", ("self.key.{0}", "self.value.{0}")),
    (r"attn\.sr\.(\w+)", ("self.sequence_reduction.{0}",)),
    (r"attn\.norm\.(\w+)", ("self.layer_norm.{0}",)),
    (r"attn\.proj\.(\w+)", ("output.dense.{0}",)),
]


def hf_keys(key: str, prefix: str = "") -> tuple[str, ...]:
    """The HF keys of specvit's ``key`` (under ``prefix``: ``pvt.`` in the classifier)."""
    embed = prefix + "encoder.patch_embeddings.{}."
    if m := re.fullmatch(r"encoder\.stem\.([01])\.(\w+)", key):
        return (embed.format(0) + ("projection.", "layer_norm.")[int(m[1])] + m[2],)
    if m := re.fullmatch(r"encoder\.stages\.(\d)\.downsample\.([01])\.(\w+)", key):
        return (embed.format(m[1]) + ("projection.", "layer_norm.")[int(m[2])] + m[3],)
    if m := re.fullmatch(r"encoder\.(?:stages\.(\d)\.)?blocks\.0\.pos_embed\.weight", key):
        return (embed.format(m[1] or 0) + "position_embeddings",)
    if key == "encoder.prefix.cls_token":
        return (embed.format(len(DEPTHS) - 1) + "cls_token",)
    if m := re.fullmatch(r"encoder\.norm\.(\w+)", key):
        return (prefix + "encoder.layer_norm." + m[1],)
    if m := re.fullmatch(r"head\.fc\.(\w+)", key):
        return ("classifier." + m[1],)
    m = re.fullmatch(r"encoder\.stages\.(\d)\.blocks\.(\d)\.(.+)", key)
    assert m is not None, key
    block = prefix + f"encoder.block.{m[1]}.{m[2]}."
    if inner := re.fullmatch(r"norm(\d)\.(\w+)", m[3]):
        return (block + f"layer_norm_{inner[1]}.{inner[2]}",)
    if inner := re.fullmatch(r"mlp\.fc(\d)\.(\w+)", m[3]):
        return (block + f"mlp.dense{inner[1]}.{inner[2]}",)
    for pattern, templates in _BLOCK:
        if inner := re.fullmatch(pattern, m[3]):
            return tuple(block + "attention." + t.format(*inner.groups()) for t in templates)
    raise AssertionError(f"no HF key for {key}")


def load_hf(spec: dict[str, Any], ref: nn.Module, *, strict: bool = True) -> SpecModel:
    """The spec's model in float64 with ``ref``'s weights; ``strict``: every HF weight has its place (the
    control leaves the tables it drops unused)."""
    model = build_model(parse_spec(spec)).double().eval()
    source, prefix = ref.state_dict(), "pvt." if "classifier.weight" in ref.state_dict() else ""
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
        theirs = (
            out.logits if hasattr(out, "logits") else out.last_hidden_state
        )  # (B, classes), (B, 1 + HW, C)
        mine = ours(_images())
        assert mine.shape == theirs.shape
        return (mine - theirs).abs().max().item()


def test_pvt_v1_equals_hf_and_the_tables_before_blocks_matter() -> None:
    ref = _hf()
    _check(lambda on: _diff(load_hf(pvt1_spec(tables=on), ref, strict=on), ref))


def test_pvt_v1_classifier_equals_hfs() -> None:
    ref = _hf(classes=7)
    spec = pvt1_spec(head={"kind": "classifier", "pool": "cls", "classes": 7})
    assert _diff(load_hf(spec, ref), ref) <= TOL


def test_each_table_has_a_row_per_token_entering_its_block() -> None:
    graph = build_graph(parse_spec(pvt1_spec()), batch=2)
    tables = sorted(n for n in graph.nx if n.endswith(".pos_embed"))
    assert tables == [f"encoder.stages.{s}.blocks.0.pos_embed" for s in range(4)]
    # the stages' grids 16x16, 8x8, 4x4 and 2x2; the class token's row in the last stage's
    assert [(graph[n]["p"].max_len, graph[n]["p"].dim) for n in tables] == [
        (256, 16),
        (64, 32),
        (16, 48),
        (5, 64),
    ]
    assert graph["encoder.prefix"]["p"].dim == 64  # the class token is as wide as the stage it enters
    assert [u for u, _ in graph.nx.in_edges("encoder.stages.3.blocks.0.pos_embed")] == ["encoder.prefix"]
    assert [u for u, _ in graph.nx.in_edges("encoder.prefix")] == ["encoder.stages.3.downsample.tokens"]
    assert "encoder.stages.2.blocks.1.pos_embed" not in graph.nx  # only the blocks the override chose
    dropped = build_graph(
        parse_spec(pvt1_spec() | {"encoder": pvt1_spec()["encoder"] | {"dropout": {"embedding": 0.1}}})
    )
    assert [u for u, _ in dropped.nx.in_edges("encoder.stages.1.blocks.0.norm1")] == [
        "encoder.stages.1.blocks.0.pos_drop"
    ]


def test_the_key_composes_with_every_way_of_choosing_blocks() -> None:
    """``overrides`` by stages gives every block of those stages a table of its own (a table per layer); a
    variant under ``blocks:`` with a ``schedule`` places one where the schedule puts the variant."""
    spec = pvt1_spec(tables=False)
    spec["encoder"]["overrides"].append({"stages": [2], "block": {"absolute_position": "learned"}})
    graph = build_graph(parse_spec(spec))
    assert sorted(n for n in graph.nx if n.endswith(".pos_embed")) == [
        "encoder.stages.2.blocks.0.pos_embed",
        "encoder.stages.2.blocks.1.pos_embed",
    ]
    assert graph["encoder.stages.2.blocks.0.pos_embed"]["params"] == 16 * 48  # the 4x4 grid, 48 wide
    plain = {
        "specvit": 1,
        "name": "vit_tables",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "image", "size": 32, "patch": 8},
            "position": "learned",
            "prefix": {"cls": True},
            "width": 16,
            "depth": 4,
            "block": {"heads": 2},
            "blocks": {"positioned": {"absolute_position": "learned"}},
            "schedule": ["block", "positioned"],
        },
    }
    graph = build_graph(parse_spec(plain))
    tables = {n: graph[n]["p"].max_len for n in graph.nx if n.endswith("pos_embed")}
    assert tables == {
        "encoder.pos_embed": 17,
        "encoder.blocks.1.pos_embed": 17,
        "encoder.blocks.3.pos_embed": 17,
    }


def test_pvt_v1_is_drawn_as_built_and_ejects_the_same() -> None:
    graph = build_graph(parse_spec(pvt1_spec()), batch=2)
    model = build_model(graph, device="meta")
    assert differences(graph, executed_graph(model)) == []
    shapes = meta_shapes(build_model(graph, device="meta"), (torch.empty(2, 3, IMAGE, IMAGE, device="meta"),))
    declared = {
        n: graph.concrete(a["shape"]) for n, a in graph.nx.nodes(data=True) if a["shape"] and n != "output"
    }
    assert {n: shapes.get(n) for n in declared} == declared
    ejects_the_same(pvt1_spec(), torch.randn(2, 3, IMAGE, IMAGE))
    text = eject(graph)  # each stage's first block is a class of its own, its table before the residual path
    assert text.count("pos_embed = self.pos_embed(x)") == 4 and "add1 = pos_embed + attn" in text


def test_other_image_sizes_are_refused() -> None:
    """HF interpolates the tables for another size; a spec states one size, and the model refuses others."""
    model = build_model(parse_spec(pvt1_spec())).eval()
    with pytest.raises(InputError, match="the spec's images are 64x64 pixels, not 96x96"):
        model(torch.randn(1, 3, 96, 96))


def _encoder(edit: Any) -> Any:
    return lambda s: edit(s["encoder"])


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            _encoder(
                lambda e: e.update(prefix={"cls": True, "at": 2}, block=e["block"] | {"spatial_reduction": 1})
            ),
            "encoder.prefix.at: the prefix would enter before block 2, and the layers into the stages after it read "
            "the tokens as a grid, without prefix tokens (use at: 4 (the last stage's first block) or later)",
        ),
        (
            _encoder(lambda e: e["prefix"].pop("at")),
            "encoder.prefix: a hierarchical stack (depth per stage) does not support this (remove the class and "
            "register tokens; classify with pool: mean, or let them enter in the last stage: prefix.at: 4)",
        ),
        (
            _encoder(lambda e: e["block"].update(spatial_reduction=[4, 2, 2, 2])),
            "encoder.block.spatial_reduction: block 4 sees the prefix tokens, which are off the grid the keys and "
            "values are reduced from (use a ratio of 1 in the blocks from 4 on)",
        ),
        (
            _encoder(lambda e: e["overrides"].append({"stages": [3], "block": {"window": {"size": 2}}})),
            "encoder.overrides.2.block.window: block 4 sees the prefix tokens, and its windows cut a grid without "
            "them (remove window from the blocks from 4 on)",
        ),
    ],
    ids=["prefix-before-last-stage", "prefix-first", "reduction-with-prefix", "window-with-prefix"],
)
def test_what_pvt_v1_specs_cannot_state_names_the_key_and_the_fix(edit: Any, expected: str) -> None:
    spec = pvt1_spec()
    edit(spec)
    assert problem(spec) == expected


def test_a_blocks_table_needs_a_fixed_token_count() -> None:
    text = {
        "specvit": 1,
        "name": "bert_like",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "tokens", "vocab": 11},
            "position": {"kind": "learned", "max_len": 32},
            "width": 16,
            "depth": 2,
            "block": {"heads": 2},
            "overrides": [{"layers": [1], "block": {"absolute_position": "learned"}}],
        },
    }
    assert problem(text) == (
        "encoder.overrides.0.block.absolute_position: a block's learned table has one row per token, and the encoder's "
        "tokens have no fixed count (use the stack's position: {kind: learned, max_len: ...}, or an image input)"
    )
    text["encoder"] |= {"input": {"kind": "image", "size": 32, "patch": 8}, "masking": {"ratio": 0.5}}
    text["encoder"]["position"] = "learned"
    assert problem(text) == (
        "encoder.overrides.0.block.absolute_position: masking keeps a random set of the patches, so a row of a block's "
        "table names no patch (remove absolute_position from the block)"
    )


# ----------------------------------------------------------------------------------- the HF importer


@pytest.mark.parametrize("classes", [None, 7], ids=["model", "classifier"])
def test_from_hf_states_pvt_and_converts_its_weights(classes: int | None) -> None:
    ref = _hf(classes)
    spec = from_hf(ref.config)
    head = {"kind": "classifier", "pool": "cls", "classes": 7} if classes else None
    exclude = {"name", "description"}
    assert spec.model_dump(exclude=exclude) == parse_spec(pvt1_spec(head=head)).model_dump(exclude=exclude)
    assert _diff(converted(ref, spec, "hf").double(), ref) <= TOL


def test_from_hf_of_the_default_config_has_hfs_parameter_count() -> None:
    from transformers import PvtConfig, PvtForImageClassification

    config = PvtConfig(num_labels=1000, architectures=["PvtForImageClassification"])
    theirs = sum(p.numel() for p in PvtForImageClassification(config).parameters())
    assert build_graph(from_hf(config)).total_params == theirs


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"patch_sizes": [4, 2, 3, 2]},
            "config.patch_sizes: pvt config has patch_sizes=[4, 2, 3, 2]: the patch embeddings after the first "
            "share one kernel and stride in a spec (give every stage after the first the same value)",
        ),
        (
            {"patch_sizes": [8, 2, 2, 2], "strides": [8, 2, 2, 2]},
            "config.patch_sizes: pvt config has patch_sizes=[8, 2, 2, 2]: stage 1's grid is 14x14 and HF sizes its "
            "position table for 28x28 (use PVT's patch sizes [4, 2, 2, 2])",
        ),
    ],
    ids=["patch-sizes", "table-sizes"],
)
def test_from_hf_refuses_what_no_spec_states(fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(SpecError) as info:
        from_hf({"model_type": "pvt", **fields})
    assert str(info.value.problems[0]) == f"<dict>: {expected}"  # a config given as a dict is named so
