"""Hostile input, third round: every field every HF family reads, given every wrong kind of value.

The fields come from the families themselves, not from a list here: each table's declared fields
(:meth:`Table.fields`, its ``only`` checks) and every field a family asks :class:`Config` for while it
reads a config of its defaults (which covers the families written as functions: CLIP, GPT-NeoX, BLOOM,
PVT, MAE). A family registered tomorrow is covered by these tests without a change to them.

Each value is written into a ``config.json`` beside the family's ``model_type`` and read by
``specvit.from_hf`` (``specvit import hf`` and ``from_pretrained`` read configs through it): the outcome is
a spec, or a SpecError whose every problem is located at the file and names a ``config.`` field (or says
the value came from the spec made of the config), never another exception. A value of another JSON type
than the field's (a string for an integer, a list for a string) is always refused at ``config.<field>``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import specvit
import specvit.interop.hf  # registers every family
from specvit import SpecError
from specvit.cli import main
from specvit.interop.registry import FAMILIES, Config
from specvit.interop.table import TABLES


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


WRONG: dict[str, Any] = {
    "quoted_number": "64",
    "word": "abc",
    "control_chars": "\x1b[2J\u202e",
    "list": ["silu"],
    "mapping": {"type": "linear"},
    "true": True,
    "fraction": 2.5,
    "zero": 0,
    "negative": -64,
    "huge": 10**30,
    "nan": math.nan,
    "inf": math.inf,
    "deep": _deep(500),
    "long_list": [1] * 100_000,
}
"""A value of each wrong kind: JSON types, ranges, non-finite numbers (Python's json reads NaN and
Infinity), deep nesting and size."""

_JSON_TYPE = {bool: bool, int: int, float: float, str: str, list: list, dict: dict}

NEEDS: dict[str, dict[str, Any]] = {"T5ForSequenceClassification": {"decoder_start_token_id": 0}}
"""Fields a class needs that its config class leaves unset: transformers' T5ForSequenceClassification raises
without a decoder start id, and so does from_hf (tests/test_hf_s2s_classifier.py)."""


DEFAULT_REFUSED = {"apertus": {"rope_parameters": {"rope_type": "default", "rope_theta": 12000000.0}}}
"""Families whose class defaults no spec states (Apertus's Llama 3 RoPE scaling, refused by field): their base
config gives the field a value specvit reads."""


def _base(model_type: str) -> dict[str, Any]:
    return {"model_type": model_type} | DEFAULT_REFUSED.get(model_type, {})


def _model_types() -> list[str]:
    return sorted({t for f in FAMILIES for t in f.model_types})


def _read_fields(model_type: str, architecture: str | None) -> dict[str, type | None]:
    """The top-level fields the family of ``model_type`` reads from a config of its defaults (of the class
    ``architecture``), with the type it asks for (None where it names none), recorded from :meth:`Config.get`."""
    seen: dict[str, type | None] = {}
    get = Config.get

    def recording(self: Config, key: str, default: Any = None, kind: type | None = None) -> Any:
        if not self.prefix:
            expected = kind or (type(default) if default is not None else None)
            seen.setdefault(key, _JSON_TYPE.get(expected) if expected is not None else None)  # type: ignore[arg-type]
        return get(self, key, default, kind)

    family = next(f for f in FAMILIES if model_type in f.model_types)
    values = _base(model_type) | ({"architectures": [architecture]} if architecture else {})
    values |= NEEDS.get(architecture or "", {})
    with mock.patch.object(Config, "get", recording):
        family.spec(Config(model_type, values, "<dict>"))
    return seen


def _fields(model_type: str) -> dict[str, tuple[str | None, type | None]]:
    """Every field of ``model_type``: those its table declares and those its family was seen to read, each
    with the first of its classes that reads it (None: the default class) and the type it asks for."""
    table = TABLES.get(model_type)
    classes: list[str | None] = [None]
    declared: set[str] = set()
    if table is not None:
        classes += [table.name + suffix for suffix in table.classes if suffix != table.default]
        declared = table.fields() | {o.name for o in table.only}
    found: dict[str, tuple[str | None, type | None]] = {}
    for architecture in classes:
        for name, kind in _read_fields(model_type, architecture).items():
            found.setdefault(name, (architecture, kind))
    for name in declared - set(found):
        found[name] = (None, None)
    found.pop("model_type", None)
    return dict(sorted(found.items()))


CASES = [(t, name, *read) for t in _model_types() for name, read in _fields(t).items()]


def _wrong_type(value: Any, kind: type | None) -> bool:
    """Whether a JSON ``value`` is not of the field's type (an int is a float; a bool is neither)."""
    if kind is None:
        return False
    if isinstance(value, bool):
        return kind is not bool
    if kind is float:
        return not isinstance(value, int | float)
    return not isinstance(value, kind)


def test_every_family_reads_a_config_of_its_defaults() -> None:
    """The base of the cases below: ``{"model_type": t}`` alone is each family's default model."""
    assert len(_model_types()) >= 45
    for model_type in _model_types():
        assert specvit.from_hf(_base(model_type)).name == f"{model_type}_from_hf"
    assert len(CASES) > 500  # fields found: a family that hid its reads would shrink this


@pytest.mark.parametrize(
    ("model_type", "field", "architecture", "kind"), CASES, ids=[f"{t}-{f}" for t, f, _, _ in CASES]
)
def test_every_field_of_every_family_gives_a_spec_or_names_itself(
    model_type: str, field: str, architecture: str | None, kind: type | None, tmp_path: Path
) -> None:
    path = tmp_path / "config.json"
    base: dict[str, Any] = _base(model_type)
    if architecture is not None:
        base["architectures"] = [architecture]  # a class that reads the field (a classifier's id2label)
        base |= NEEDS.get(architecture, {})
    refused = 0
    for name, value in WRONG.items():
        path.write_text(json.dumps({**base, field: value}))
        try:
            specvit.from_hf(path)
        except SpecError as exc:
            refused += 1
            lines = str(exc).splitlines()
            assert all(line.startswith(f"{path}: ") for line in lines), (name, lines)
            for problem in exc.problems:
                assert problem.location is not None and problem.location.file == str(path), (name, problem)
                assert problem.path.startswith("config.") or "(in the spec made of this" in problem.message, (
                    name,
                    problem,
                )
                assert "\x1b" not in str(problem), (name, problem)  # shown escaped
            if _wrong_type(value, kind):
                assert exc.problems[0].path in (f"config.{field}", f"config.{field}.0"), (name, lines)
        else:
            assert not _wrong_type(value, kind), f"{model_type} accepted {field}={value!r:.40} ({name})"
    assert refused or kind is None, "no value was refused: the broken control of this field's checks"


@pytest.mark.parametrize("model_type", _model_types())
def test_the_cli_refuses_a_wrong_type_in_one_line_and_writes_nothing(
    model_type: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``specvit import hf`` of each family's config with its first integer field quoted: status 2, one line
    naming the file and the field, no spec written; the config without it is the control."""
    field = next(
        f for t, f, architecture, kind in CASES if t == model_type and kind is int and not architecture
    )
    path, out = tmp_path / "config.json", tmp_path / "spec.yaml"
    path.write_text(json.dumps(_base(model_type) | {field: "64"}))
    assert main(["import", "hf", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{path}: config.{field}: "), err
    assert "write the number without quotes: 64" in err
    assert not out.exists()
    path.write_text(json.dumps(_base(model_type)))
    assert (
        main(["import", "hf", str(tmp_path), "-o", str(out)]) == 0
    )  # a model directory, as from_pretrained's
    assert out.exists()


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2", "modernbert"])
def test_a_per_layer_list_of_unhashable_items_is_refused_at_its_field(model_type: str) -> None:
    """``layer_types`` of one list per layer (the length right, the items not strings) crashed in set()."""
    with pytest.raises(
        SpecError, match=r"^<dict>: config\.layer_types: .* expected full_attention or sliding"
    ):
        specvit.from_hf({"model_type": model_type, "num_hidden_layers": 2, "layer_types": [["a"], {"b": 1}]})
    spec = specvit.from_hf(  # the control: the same config with strings
        {
            "model_type": model_type,
            "num_hidden_layers": 2,
            "layer_types": ["full_attention", "sliding_attention"],
        }
    )
    assert spec.name == f"{model_type}_from_hf"
