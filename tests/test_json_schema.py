"""The JSON Schema editors read (`specvit schema`, guide §4) agrees with `specvit validate` at the key level.

Every bundled preset and every documented shorthand is accepted by both; unknown keys and wrong types are
refused by both. Checked with the `jsonschema` package, against the schema the command line prints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from presets import PRESETS, ROOT

import specvit
from specvit.cli import main

VIT_SMALL = ROOT / "specs" / "vit_small_patch16_224.yaml"


@pytest.fixture(scope="module")
def validator(tmp_path_factory: pytest.TempPathFactory) -> jsonschema.Draft202012Validator:
    out = tmp_path_factory.mktemp("schema") / "specvit.schema.json"
    assert main(["schema", "-o", str(out)]) == 0
    schema = json.loads(out.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(validator: jsonschema.Draft202012Validator, data: Any) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(data)]


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_is_valid_under_the_schema(
    validator: jsonschema.Draft202012Validator, path: Path
) -> None:
    assert _errors(validator, yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_canonical_spec_is_valid_under_the_schema(
    validator: jsonschema.Draft202012Validator, path: Path
) -> None:
    # to_yaml() writes pairs as [h, w], every default resolved and every kind spelled out
    assert _errors(validator, yaml.safe_load(specvit.load_spec(path).to_yaml())) == []


VIT = yaml.safe_load(VIT_SMALL.read_text())


def _with(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``base`` (ViT-S) with the dotted key set (``value`` ``...`` deletes it)."""
    data = json.loads(json.dumps(base if base is not None else VIT))
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return data


SHORTHANDS = {
    "size-int": _with("encoder.input.size", 224),
    "size-pair": _with("encoder.input.size", [224, 192]),
    "patch-pair": _with("encoder.input.patch", [16, 16]),
    "position-learned": _with("encoder.position", "learned"),
    "position-mapping": _with("encoder.position", {"kind": "learned"}),
    "position-none": _with("encoder.position", "none"),
    "head-none": _with("head", "none"),
    "head-omitted": _with("head", ...),
    "depth-and-heads-per-stage": _with(
        "encoder.block.heads",
        [6, 12],
        _with("encoder.depth", [2, 2], _with("encoder.prefix", ..., _with("head.pool", "mean"))),
    ),
}


@pytest.mark.parametrize("data", SHORTHANDS.values(), ids=SHORTHANDS.keys())
def test_documented_shorthands_are_valid_under_both(
    validator: jsonschema.Draft202012Validator, data: dict[str, Any]
) -> None:
    specvit.parse_spec(data)  # the validator accepts it ...
    assert _errors(validator, data) == []  # ... and so does the schema


def test_extends_with_only_the_changed_keys(
    validator: jsonschema.Draft202012Validator, tmp_path: Path
) -> None:
    for base in (str(VIT_SMALL), "vit_small_patch16_224.yaml"):  # a file, and a bundled preset by name
        data = {"extends": base, "name": "vit_s_dp", "encoder": {"drop_path": 0.1, "input": {"size": 384}}}
        spec_file = tmp_path / "child.yaml"
        spec_file.write_text(yaml.safe_dump(data))
        spec = specvit.load_spec(spec_file)
        assert spec.encoder is not None and spec.encoder.input.size == (384, 384)  # type: ignore[union-attr]
        assert _errors(validator, data) == []


KEY_LEVEL_ERRORS = {
    "unknown-top-key": _with("encodr", {}),
    "unknown-nested-key": _with("encoder.block.haeds", 6),
    "heads-outside-block": _with("encoder.heads", 6),
    "number-quoted": _with("encoder.block.heads", "6"),
    "number-as-bool": _with("encoder.block.heads", True),
    "float-for-int": _with("encoder.width", 384.5),
    "out-of-range": _with("encoder.width", 0),
    "pair-of-one": _with("encoder.input.size", [224]),
    "pair-of-three": _with("encoder.input.patch", [16, 16, 16]),
    "size-quoted": _with("encoder.input.size", "224"),
    "kind-misspelt": _with("encoder.position", "lerned"),
    "shorthand-needs-keys": _with("head", "classifier"),  # a classifier needs its classes
    "kind-unknown": _with("head", {"kind": "clasifier", "classes": 10}),
    "missing-model": _with("model", ...),
    "missing-width": _with("encoder.width", ...),
    "placement-unknown": _with("encoder.block.norm.placement", "middle"),
}


@pytest.mark.parametrize("data", KEY_LEVEL_ERRORS.values(), ids=KEY_LEVEL_ERRORS.keys())
def test_key_level_errors_are_refused_by_both(
    validator: jsonschema.Draft202012Validator, data: dict[str, Any]
) -> None:
    with pytest.raises(specvit.SpecError):
        specvit.parse_spec(data)
    assert _errors(validator, data) != []


EXTENDING_ERRORS = {
    "unknown-key": {"extends": "vit_small_patch16_224.yaml", "encoder": {"drop_pth": 0.1}},
    "wrong-type": {"extends": "vit_small_patch16_224.yaml", "encoder": {"depth": "6"}},
    "unknown-top-key": {"extends": "vit_small_patch16_224.yaml", "encodr": {}},
    "extends-not-a-name": {"extends": 3},
    "kind-misspelt": {"extends": "vit_small_patch16_224.yaml", "head": "nne"},
}


@pytest.mark.parametrize("data", EXTENDING_ERRORS.values(), ids=EXTENDING_ERRORS.keys())
def test_extending_specs_keep_key_level_checks(
    validator: jsonschema.Draft202012Validator, data: dict[str, Any], tmp_path: Path
) -> None:
    spec_file = tmp_path / "child.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    with pytest.raises(specvit.SpecError):
        specvit.load_spec(spec_file)
    assert _errors(validator, data) != []
