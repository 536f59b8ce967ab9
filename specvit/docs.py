"""Generate docs/spec.md (the field reference) from the schema: ``python -m specvit.docs``.

A test regenerates the text and fails when the committed file is stale.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from specvit.io import atomic_write
from specvit.ops import fragments
from specvit.ops.conv import ActLayer, ConvLayer, NormLayer, PoolLayer
from specvit.ops.head_ops import FeatureNorm, LinearLayer
from specvit.spec import block, schema

__all__ = ["spec_reference", "write_docs"]

SECTIONS: list[tuple[str, list[type[BaseModel]]]] = [
    ("The spec", [schema.Spec]),
    ("Stacks: `encoder:` and `decoder:`", [schema.StackSpec]),
    ("Inputs: `input:`", list(fragments("input"))),
    ("Prefix tokens: `prefix:`", [schema.PrefixSpec]),
    ("Positions: `position:`", list(fragments("position"))),
    ("Masking: `masking:`", [schema.MaskingSpec]),
    (
        "Blocks: `block:`, and `blocks:`, `schedule:`, `overrides:` along the depth",
        [
            block.BlockSpec,
            block.NormSpec,
            block.MlpSpec,
            block.WindowSpec,
            block.GraphNodeSpec,
            block.LayerOverride,
        ],
    ),
    ("Map layers: an input's `stem:`, a map head's `ops:`", [ConvLayer, NormLayer, ActLayer, PoolLayer]),
    ("Dropout: `dropout:`", [schema.DropoutSpec]),
    ("Heads: `head:`", list(fragments("head"))),
    ("Head layers: a classifier's or lm head's `ops:`", [LinearLayer, ActLayer, FeatureNorm]),
]
"""The reference's sections; the kinds of inputs, positions and heads are every registered fragment."""

INTRO = """\
# Spec reference

Generated from the schema and the registered op fragments (`specvit/spec/schema.py`, `specvit/ops/`) by
`python -m specvit.docs`; do not edit by hand.

Every spec is strict: unknown keys are errors (with a did-you-mean), numbers are numbers (`12`, never
`"12"`, never `true`), and alternatives are chosen by a `kind` key. `position: learned` and `head: none`
are short for `{kind: learned}` and `{kind: none}`. A spec may start with `extends: other.yaml` (a path
relative to the spec, or a bundled preset's name) to deep-merge itself over another spec. See
`docs/guide.md` for a walk-through.
"""


_UNION_NAMES = {
    "Position": "position",
    "Head": "head",
    "Input": "input",
    "Linear": "head layer",
    "Layer": "map layer",
}


def _fmt(ann: Any) -> str:
    """A readable type for the reference table."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return _fmt(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) > 1:
            family = next(v for k, v in _UNION_NAMES.items() if k in models[0].__name__)
            return f"{family} (by `kind`, below)"
        return " or ".join(_fmt(a) for a in args)
    if origin is list:
        return f"list of {_fmt(args[0])}"
    if origin is tuple:
        return "int or [int, int]"
    if ann is type(None):
        return "null"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann.__name__.removesuffix("Spec").lower()
    return getattr(ann, "__name__", str(ann))


def _default_of(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return f"`{value}`" if isinstance(value, list) else "see below"
    value = field.default
    if value is None:
        return "`null`"
    if value == "":
        return '`""`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _bounds(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for name, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(meta, name, None)
            if value is not None:
                parts.append(f"{sym} {value}")
    return f" ({', '.join(parts)})" if parts else ""


def _table(model: type[BaseModel]) -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        rows.append(
            f"| `{name}` | {_fmt(field.annotation)}{_bounds(field)} | {_default_of(field)} | {desc} |"
        )
    return "\n".join(rows)


def spec_reference() -> str:
    """The Markdown text of docs/spec.md."""
    out = [INTRO]
    for title, models in SECTIONS:
        out.append(f"## {title}\n")
        for model in models:
            kind = model.model_fields.get("kind")
            tag = typing.get_args(kind.annotation)[0] if kind is not None and kind.is_required() else None
            heading = f"`kind: {tag}`" if tag is not None else f"`{model.__name__}`"
            if len(models) > 1 or tag is not None:
                out.append(f"### {heading}\n")
            out.append(f"{(model.__doc__ or '').strip()}\n")
            out.append(_table(model) + "\n")
    return "\n".join(out)


def write_docs(root: Path) -> list[Path]:
    """Regenerate the generated docs under ``root/docs``; returns the files written.

    Args:
        root: the repository root.
    """
    path = root / "docs" / "spec.md"
    atomic_write(path, spec_reference())
    return [path]


if __name__ == "__main__":
    for written in write_docs(Path(__file__).resolve().parents[1]):
        print(f"wrote {written}")
    sys.exit(0)
