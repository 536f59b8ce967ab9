"""The JSON Schema of spec files, for editors (``specvit schema``).

Pydantic's schema of :class:`~specvit.spec.schema.Spec` describes a whole spec. A file may also start
with ``extends:`` and write only what it changes (``encoder: {drop_path: 0.1}``), the rest coming from
the base it names. The schema therefore holds two versions of every definition: the whole one, and an
*overlay* one in which no key is required and a partial ``kind``-less fragment may stand for any kind.
The root picks the overlay when ``extends`` is present and the whole spec otherwise, so an editor
underlines neither a preset nor a spec that extends one, and still underlines unknown keys and wrong
types in both.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["DIALECT", "json_schema"]

DIALECT = "https://json-schema.org/draft/2020-12/schema"  # pydantic writes prefixItems, a 2020-12 keyword
_OVERLAY = "Overlay"  # prefix of the overlay definitions' names

_EXTENDS = {
    "type": "string",
    "minLength": 1,
    "title": "Extends",
    "description": "The spec this one starts from: a file relative to this one, or the name of a bundled "
    "preset (vit_small_patch16_224.yaml; `specvit presets` lists them). The keys written here are merged "
    "over it, mapping by mapping; every other key comes from the base.",
}


def _overlay(node: Any) -> Any:
    """``node`` with nothing required, ``$ref`` pointing at overlay definitions, ``oneOf`` as ``anyOf``.

    Without a required ``kind`` a partial fragment may fit several kinds, so exactly-one (``oneOf``)
    becomes at-least-one (``anyOf``), and the OpenAPI ``discriminator`` hint goes.
    """
    if isinstance(node, list):
        return [_overlay(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("required", "discriminator", "default"):
            continue
        if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
            out[key] = "#/$defs/" + _OVERLAY + value.removeprefix("#/$defs/")
        elif key == "oneOf":
            out["anyOf"] = _overlay(value)
        elif key == "properties":  # keys here are names, not keywords
            out[key] = {name: _overlay(sub) for name, sub in value.items()}
        else:
            out[key] = _overlay(value)
    return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a spec file: a whole spec, or one that ``extends`` another."""
    from specvit.spec.schema import Spec

    whole = Spec.model_json_schema()
    defs: dict[str, Any] = whole.pop("$defs")
    overlay_defs = {_OVERLAY + name: _overlay(d) for name, d in defs.items()}
    overlay = _overlay(whole)
    overlay["properties"] = {"extends": _EXTENDS, **overlay["properties"]}
    overlay["required"] = ["extends"]
    overlay["title"] = "Spec that extends another"
    return {
        "$schema": DIALECT,
        "title": whole["title"],
        "description": whole.get("description", "")
        + " With extends: only the keys that differ from the base spec.",
        "type": "object",
        "if": {"required": ["extends"]},
        "then": {"$ref": "#/$defs/SpecExtending"},
        "else": {"$ref": "#/$defs/Spec"},
        "$defs": {"Spec": copy.deepcopy(whole), "SpecExtending": overlay, **defs, **overlay_defs},
    }
