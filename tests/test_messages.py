"""Messages for the slips of people who come from timm, HF transformers, x-transformers and PyTorch: their
names get specvit's key and where it goes, one mistake gives one message, and ``--set`` reaches into a
shorthand. Every message is quoted whole."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from pydantic import BaseModel
from test_spec import VIT  # the line numbers the messages quote are this spec's

import specvit
from specvit import SpecError
from specvit.spec.foreign import FOREIGN_KEYS, FOREIGN_VALUES
from specvit.spec.schema import ClassifierHead, Spec


def _problems(text: str, overrides: dict[str, Any] | None = None) -> list[str]:
    """Every problem of the spec, one line each, as ``specvit validate`` prints them."""
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(text, source="t.yaml", overrides=overrides)
    return str(info.value).splitlines()


def _edit(old: str, new: str) -> str:
    assert old in VIT
    return VIT.replace(old, new, 1)


FOREIGN = [
    (
        "  width: 64",
        "  embed_dim: 64",
        "t.yaml:8:3: encoder.embed_dim: unknown key 'embed_dim' (timm's embed_dim is encoder.width: write width: 64)",
    ),
    (
        "    heads: 4",
        "    num_heads: 4",
        "t.yaml:11:5: encoder.block.num_heads: unknown key 'num_heads' (timm's num_heads is encoder.block.heads: "
        "write heads: 4)",
    ),
    (
        "    mlp: {ratio: 4, activation: gelu}",
        "    mlp_ratio: 4",
        "t.yaml:14:5: encoder.block.mlp_ratio: unknown key 'mlp_ratio' (timm's mlp_ratio is "
        "encoder.block.mlp.ratio: write mlp: {ratio: 4})",
    ),
    (
        "    mlp: {ratio: 4, activation: gelu}",
        "    mlp: {activation: gelu}\n    mlp_ratio: 2.5",
        "t.yaml:15:5: encoder.block.mlp_ratio: unknown key 'mlp_ratio' (timm's mlp_ratio is "
        "encoder.block.mlp.ratio: write ratio: 2.5 under encoder.block.mlp)",
    ),
    (
        "    norm: {kind: layernorm, placement: pre, eps: 1.0e-6}",
        "    norm_layer: LayerNorm",
        "t.yaml:13:5: encoder.block.norm_layer: unknown key 'norm_layer' (timm's norm_layer is "
        "encoder.block.norm.kind: write norm: {kind: layernorm})",
    ),
    (
        "  depth: 2",
        "  num_layers: 2",
        "t.yaml:9:3: encoder.num_layers: unknown key 'num_layers' (HF's num_layers is encoder.depth: write depth: 2)",
    ),
    (
        "  depth: 2",
        "  num_hidden_layers: 2",
        "t.yaml:9:3: encoder.num_hidden_layers: unknown key 'num_hidden_layers' (HF's num_hidden_layers is "
        "encoder.depth: write depth: 2)",
    ),
    (
        "  width: 64",
        "  hidden_size: 64",
        "t.yaml:8:3: encoder.hidden_size: unknown key 'hidden_size' (HF's hidden_size is encoder.width: "
        "write width: 64)",
    ),
    (
        "    mlp: {ratio: 4, activation: gelu}",
        "    intermediate_size: 256",
        "t.yaml:14:5: encoder.block.intermediate_size: unknown key 'intermediate_size' (HF's intermediate_size is "
        "encoder.block.mlp.hidden: write mlp: {hidden: 256})",
    ),
    (
        "    mlp: {ratio: 4, activation: gelu}",
        "    mlp: {ratio: 4}\n    hidden_act: silu",
        "t.yaml:15:5: encoder.block.hidden_act: unknown key 'hidden_act' (HF's hidden_act is "
        "encoder.block.mlp.activation: write activation: silu under encoder.block.mlp (a gated MLP (Llama's) "
        "is swiglu))",
    ),
    (
        "  width: 64",
        "  dim: 64",
        "t.yaml:8:3: encoder.dim: unknown key 'dim' (x-transformers' dim is encoder.width: write width: 64)",
    ),
    (
        "    mlp: {ratio: 4, activation: gelu}",
        "    ff_mult: 4",
        "t.yaml:14:5: encoder.block.ff_mult: unknown key 'ff_mult' (x-transformers' ff_mult is "
        "encoder.block.mlp.ratio: write mlp: {ratio: 4})",
    ),
    (
        "    norm: {kind: layernorm, placement: pre, eps: 1.0e-6}",
        "    norm: {placement: pre}\n    use_rmsnorm: true",
        "t.yaml:14:5: encoder.block.use_rmsnorm: unknown key 'use_rmsnorm' (x-transformers' use_rmsnorm is "
        "encoder.block.norm.kind: write kind: rmsnorm under encoder.block.norm)",
    ),
    (
        "    norm: {kind: layernorm, placement: pre, eps: 1.0e-6}",
        "    norm_first: false",
        "t.yaml:13:5: encoder.block.norm_first: unknown key 'norm_first' (PyTorch's norm_first is "
        "encoder.block.norm.placement: write norm: {placement: post})",
    ),
    (
        "  position: learned",
        "  position: learned\n  rope_theta: 10000.0",
        "t.yaml:8:3: encoder.rope_theta: unknown key 'rope_theta' (HF's rope_theta is encoder.position.base: "
        "write position: {kind: rope, base: 10000.0})",
    ),
    (
        "  prefix: {cls: true}",
        "  prefix: {cls: true}\n  num_classes: 10",
        "t.yaml:7:3: encoder.num_classes: unknown key 'num_classes' (timm's num_classes is head.classes: "
        "write classes: 10 under head)",
    ),
    (
        "head: {kind: classifier, pool: cls, classes: 10}",
        "head: {kind: classifier, global_pool: avg, classes: 10}",
        "t.yaml:15:26: head.global_pool: unknown key 'global_pool' (timm's global_pool is head.pool: "
        "write pool: mean)",
    ),
    (
        "  width: 64\n",
        "",
        None,  # the top level: see below
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [case for case in FOREIGN if case[2] is not None],
    ids=[case[1].split(":")[-2].strip().split()[-1] for case in FOREIGN if case[2] is not None],
)
def test_another_librarys_key_names_specvits_and_where_it_goes(old: str, new: str, message: str) -> None:
    """One message: the key it stands for is not also reported missing (``width``, ``heads``, ``depth``)."""
    assert _problems(_edit(old, new)) == [message]


def test_a_foreign_key_at_the_top_level_goes_under_the_stack() -> None:
    text = _edit("  width: 64\n", "") + "embed_dim: 64\n"
    assert _problems(text) == [
        "t.yaml:15:1: embed_dim: unknown key 'embed_dim' (timm's embed_dim is encoder.width: write width: 64 "
        "under encoder)"
    ]


@pytest.mark.parametrize(
    ("pool", "hint"),
    [
        ("gap", "gap is global average pooling: write pool: mean"),
        ("avg", "avg is timm's global average pool: write pool: mean"),
        ("token", "token is timm's class-token pool: write pool: cls"),
        ("map", "map is timm's attention pool (SigLIP's head): write pool: attention"),
    ],
)
def test_another_librarys_pool_names_specvits(pool: str, hint: str) -> None:
    text = _edit("pool: cls", f"pool: {pool}")
    assert _problems(text) == [
        f"t.yaml:15:32: head.pool: '{pool}' is not one of cls, first, mean, cls_mean, eos, last_eos, last, attention "
        f"({hint})"
    ]


def _schema_paths() -> set[str]:
    """Every key path of the schema, through every member of every union (``encoder.block.mlp.ratio``)."""
    out: set[str] = set()

    def walk(model: type[BaseModel], prefix: str, seen: tuple[type, ...]) -> None:
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            out.add(path)
            stack = [field.annotation]
            while stack:
                a = stack.pop()
                if isinstance(a, type) and issubclass(a, BaseModel):
                    if a not in seen:
                        walk(a, f"{path}.", (*seen, a))
                else:
                    stack.extend(get_args(a))

    walk(Spec, "", (Spec,))
    return out


def test_every_foreign_key_names_a_real_key_and_is_not_one() -> None:
    paths = _schema_paths()
    wrong = {k: f.target for k, f in FOREIGN_KEYS.items() if not any(p.endswith(f.target) for p in paths)}
    assert wrong == {}
    keys = {p.rpartition(".")[2] for p in paths}
    assert set(FOREIGN_KEYS) & keys == {"dim"}  # a features input's dim: x-transformers' dim is the width


def test_every_foreign_pool_is_a_pool_of_specvit() -> None:
    pools = get_args(ClassifierHead.model_fields["pool"].annotation)
    assert {ours for ours, _ in FOREIGN_VALUES["pool"].values()} <= set(pools)


# ------------------------------------------------------------------------------ one message per cause


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (  # not also "encoder.position: missing required key 'position'"
            "  position: learned",
            "  postion: learned",
            "t.yaml:7:3: encoder.postion: unknown key 'postion' (did you mean 'position'?)",
        ),
        (  # not also "encoder.depth: missing required key 'depth'"
            "  depth: 2\n  block:\n",
            "  block:\n    depth: 2\n",
            "t.yaml:10:5: encoder.block.depth: unknown key 'depth' (depth belongs under encoder, not encoder.block)",
        ),
        (  # not also "encoder.position: rope2d needs a head dim divisible by 4, got 12"
            "heads: 4",
            "heads: 5",
            "t.yaml:11:12: encoder.block.heads: width 64 is not divisible by 5 heads (use a divisor of 64 such as "
            "4 or 8, or set block.head_dim)",
        ),
    ],
    ids=["misspelt key", "key in the wrong section", "heads that do not divide the width"],
)
def test_one_mistake_gives_one_message(old: str, new: str, message: str) -> None:
    text = _edit(old, new).replace("position: learned", "position: rope2d")
    assert _problems(text) == [message]


def test_a_rope_check_still_runs_when_the_heads_divide() -> None:
    text = _edit("heads: 4", "heads: 8").replace("position: learned", "position: rope2d")  # head dim 8
    assert specvit.parse_spec(text).encoder.head_dim == 8  # type: ignore[union-attr]
    text = _edit("heads: 4", "heads: 4\n    head_dim: 6").replace("position: learned", "position: rope2d")
    assert _problems(text) == [
        "t.yaml:7:13: encoder.position: rope2d needs a head dim divisible by 4, got 6 (pick heads (or head_dim) "
        "so that width/heads is a multiple of 4)"
    ]


def test_independent_problems_beside_the_heads_are_still_all_reported() -> None:
    text = _edit("heads: 4", "heads: 5").replace("size: 32", "size: 36")
    assert _problems(text) == [
        "t.yaml:5:41: encoder.input.patch: image size 36 is not divisible by patch 8 (use a patch size that "
        "divides 36, such as 6 or 9)",
        "t.yaml:11:12: encoder.block.heads: width 64 is not divisible by 5 heads (use a divisor of 64 such as "
        "4 or 8, or set block.head_dim)",
    ]


# ------------------------------------------------------------------------------- --set into a shorthand


def test_set_into_a_shorthand_kind_expands_it() -> None:
    text = VIT.replace("position: learned", "position: rope2d")
    spec = specvit.parse_spec(text, overrides={"encoder.position.base": 100})
    assert spec.encoder is not None
    assert spec.encoder.position.model_dump() == {
        "kind": "rope2d",
        "base": 100.0,
        "layout": "sections",
        "ref_grid": None,
        "axes": "ij",
        "frequencies": "fixed",
    }
    listed = VIT.replace("position: learned", "position: [learned, rope2d]")
    spec = specvit.parse_spec(listed, overrides={"encoder.position.1.base": 100})
    assert [p.model_dump().get("base") for p in spec.encoder.positions] == [None, 100.0]  # type: ignore[union-attr]
    head = VIT.replace("head: {kind: classifier, pool: cls, classes: 10}", "head: classifier")
    spec = specvit.parse_spec(head, overrides={"head.classes": 3, "head.pool": "mean"})
    assert (spec.head.kind, spec.head.classes) == ("classifier", 3)  # type: ignore[union-attr]


def test_set_into_a_shorthand_is_checked_like_the_file() -> None:
    text = VIT.replace("position: learned", "position: rope2d")
    assert _problems(text, {"encoder.position.bse": 100}) == [
        "<override encoder.position.bse>: encoder.position.bse: unknown key 'bse' (did you mean 'base'?)"
    ]


def test_set_past_a_plain_value_says_it_has_no_keys() -> None:
    assert _problems(VIT, {"name.x": 1}) == [
        "<override name.x>: name: the override path 'name.x' does not lead to a key of the spec: name is the "
        "value 'tiny', not a section (it has no keys to set; set name itself)"
    ]
    listed = VIT.replace("position: learned", "position: [learned, rope2d]")
    assert _problems(listed, {"encoder.position.2.base": 1}) == [
        "<override encoder.position.2.base>: encoder.position: the override path 'encoder.position.2.base' does "
        "not lead to a key of the spec: encoder.position is a list of 2 (index it from 0 to 1)"
    ]
