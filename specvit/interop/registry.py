"""The HF model families specvit reads: each maps a config to a spec and a state dict to specvit's keys.

A family module (``specvit/interop/hf_*.py``) registers one :class:`Family` per architecture it covers.
:mod:`specvit.interop.hf` finds the family of a config by its ``model_type`` and the family of a state
dict by its keys.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specvit.errors import Location, Problem, SpecError
from specvit.interop.layout import Layout
from specvit.ops.base import MAX_DEPTH

__all__ = [
    "ACTIVATIONS",
    "FAMILIES",
    "Config",
    "Family",
    "activation",
    "family",
    "listable",
    "show_value",
    "untrace",
]


_KINDS: dict[type, str] = {
    bool: "a boolean (true or false)",
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "a mapping ({...})",
    list: "a list ([...])",
}
_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60
_SHOW.maxlist = _SHOW.maxdict = _SHOW.maxlevel = 4


def show_value(value: Any) -> str:
    """``repr(value)`` clipped: a config's value may be a huge or deeply nested JSON array."""
    return _SHOW.repr(value)


class _Int(int):
    """An int read from a config field, that remembers the field (see :func:`untrace`)."""

    field: str


class _Float(float):
    """A float read from a config field, that remembers the field."""

    field: str


class _Str(str):
    """A str read from a config field, that remembers the field."""

    field: str


_TRACED: dict[type, type] = {int: _Int, float: _Float, str: _Str}
_PLAIN: dict[type, type] = {traced: plain for plain, traced in _TRACED.items()}


def untrace(data: Any, path: tuple[str | int, ...] = ()) -> tuple[Any, dict[str, str]]:
    """``data`` with every value read from a config made plain, and the field each spec key came from.

    Args:
        data: the spec's fields a family made of a config.
        path: where ``data`` is in the spec.

    Returns:
        The plain data, and ``{"decoder.width": "hidden_size"}`` for every value taken from a field as is.
    """
    origin: dict[str, str] = {}
    if isinstance(data, dict):
        out: dict[Any, Any] = {}
        for k, v in data.items():
            out[str(k)], inner = untrace(v, (*path, str(k)))
            origin.update(inner)
        return out, origin
    if isinstance(data, list):
        items = [untrace(v, (*path, i)) for i, v in enumerate(data)]
        for _, inner in items:
            origin.update(inner)
        return [v for v, _ in items], origin
    for plain, traced in _TRACED.items():
        if type(data) is traced:
            origin[".".join(str(p) for p in path)] = data.field  # type: ignore[attr-defined]
            return plain(data), origin
    return data, origin


class Config:
    """A transformers config read as a dict, with the class defaults a config.json may leave out.

    Every field is read through :meth:`get`, which checks its type: a config is input, and a string
    where a number belongs (``"hidden_size": "64"``) would otherwise flow into arithmetic.

    Args:
        model_type: the config's ``model_type``.
        values: its fields (``config.to_dict()`` or a config.json).
        source: where it was read from (the config.json's path, ``<dict>``), for messages.
    """

    prefix = ""  # the fields' place in the config: a nested config (CLIP's text_config) names its own
    pooler = False
    """Whether the base model was built with its pooler (a model holding one, weights holding its
    ``pooler.*``): a table then reads its base class as :attr:`~specvit.interop.table.Table.pooled`."""

    def __init__(self, model_type: str, values: dict[str, Any], source: str = "<config>"):
        self.model_type, self.values, self.source = model_type, values, source

    def get(self, key: str, default: Any = None, kind: type | None = None) -> Any:
        """A field, or its default when the config leaves it out (or sets it to null).

        Args:
            key: the field.
            default: the HF class's default; its type is the field's type unless ``kind`` says otherwise.
            kind: the field's type (``int``, ``float``, ``bool``, ``str``, ``dict``, ``list``) where the
                default does not say it (a default of None).

        Raises:
            SpecError: naming ``config.<key>`` when the value is not of the field's type: ints are ints
                and not booleans, floats are finite numbers, strings are strings.
        """
        value = self.values.get(key)
        if value is None:
            return default
        expected = kind or (type(default) if default is not None else None)
        expected = _PLAIN.get(expected, expected)  # type: ignore[arg-type]
        if expected is not None and not _is(value, expected):
            raise self.refuse(
                key, value, f"expected {_KINDS.get(expected, expected.__name__)}", _fix(value, expected)
            )
        traced = _TRACED.get(type(value))
        if traced is None:
            return value
        out = traced(value)
        out.field = self.prefix + key
        return out

    def sub(self, key: str) -> Config:
        """A field that is a mapping of fields (``rope_parameters``), read as a Config of its own."""
        values = self.get(key, kind=dict) or {}
        nested = Config(self.model_type, values, self.source)
        nested.prefix = f"{self.prefix}{key}."
        return nested

    def size(self, key: str, default: int) -> int:
        """A field that is a count or a size, such as a number of heads: an integer >= 1."""
        value = self.get(key, default)
        if value < 1:
            raise self.refuse(key, value, "it must be 1 or more", "give a positive integer")
        return value  # an int, still naming its field (see untrace)

    def refuse(self, key: str, value: Any, why: str, fix: str) -> SpecError:
        """The error for a field whose value specvit cannot state exactly."""
        field = self.prefix + key
        return SpecError(
            Problem(
                f"config.{field}",
                f"{self.model_type} config has {field}={show_value(value)}: {why}",
                fix,
                Location(self.source),
            )
        )

    def only(self, key: str, default: Any, allowed: Sequence[Any], why: str) -> Any:
        """A field whose value must be one of ``allowed``; anything else is refused."""
        value = self.get(key, default)
        if value not in allowed:
            raise self.refuse(key, value, why, f"use {' or '.join(repr(a) for a in allowed)}")
        return value


def listable(depth: Any) -> bool:
    """Whether a family may make a list of one entry per layer of a stack of ``depth`` layers: a depth the
    spec allows (1 to MAX_DEPTH). A config's ``num_hidden_layers: 1e30`` is never looped over: the family
    leaves its per-layer entries out and the spec refuses the depth, at the config's field.

    Args:
        depth: the stack's depth as read from the config.
    """
    return isinstance(depth, int) and 1 <= depth <= MAX_DEPTH


def _is(value: Any, kind: type) -> bool:
    """Whether a JSON value is of the field's type (an int is a float; a bool is neither)."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float and isinstance(value, int):
        return abs(value) < 2**1023  # float() of it is finite
    if kind is float:
        return isinstance(value, float) and math.isfinite(value)
    return isinstance(value, kind)


def _fix(value: Any, kind: type) -> str:
    """How to write ``value`` as the field's type."""
    if isinstance(value, str) and kind in (int, float):
        try:
            number = kind(value.strip())
        except (ValueError, OverflowError):
            number = None
        if number is not None and (kind is int or math.isfinite(number)):
            return f"write the number without quotes: {number}"
    return f"give {_KINDS.get(kind, kind.__name__)}"


@dataclass(frozen=True)
class Family:
    """One HF architecture.

    Args:
        name: the HF model class it reads (``LlamaForCausalLM``), for messages.
        model_types: the config ``model_type`` values it covers.
        keys: a regular expression one of its state dict's keys matches (and no other family's).
        spec: config -> the spec's fields, defaults left out.
        layout: (spec, state dict keys) -> where each specvit parameter comes from.
    """

    name: str
    model_types: tuple[str, ...]
    keys: str
    spec: Callable[[Config], dict[str, Any]]
    layout: Callable[[Any, Sequence[str]], Layout]

    def reads(self, keys: Sequence[str]) -> bool:
        return any(re.match(self.keys, k) for k in keys)


FAMILIES: list[Family] = []


def family(f: Family) -> Family:
    """Register a family."""
    FAMILIES.append(f)
    return f


ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
"""transformers' activation names (its ``ACT2FN``, shared by every model class) -> specvit's MLP activation."""


def activation(
    c: Config, table: dict[str, str] = ACTIVATIONS, *, key: str = "hidden_act", default: str = "gelu"
) -> str:
    """The spec's activation for the config's ``key``; a name the table lacks is refused.

    Args:
        c: the config.
        table: HF name -> specvit activation (default :data:`ACTIVATIONS`; gated MLPs pass their own).
        key: the config field (``hidden_act``, ``activation_function``).
        default: the HF class's default for the field.
    """
    act = c.get(key, default, str)
    if act not in table:
        raise c.refuse(key, act, "specvit has no such activation", f"use one of {', '.join(table)}")
    return table[act]
