"""The HF model families specvit reads: each maps a config to a spec and a state dict to specvit's keys.

A family module (``specvit/interop/hf_*.py``) registers one :class:`Family` per architecture it covers.
:mod:`specvit.interop.hf` finds the family of a config by its ``model_type`` and the family of a state
dict by its keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specvit.errors import Problem, SpecError
from specvit.interop.layout import Layout

__all__ = ["ACTIVATIONS", "FAMILIES", "Config", "Family", "activation", "family"]


class Config:
    """A transformers config read as a dict, with the class defaults a config.json may leave out.

    Args:
        model_type: the config's ``model_type``.
        values: its fields (``config.to_dict()`` or a config.json).
    """

    def __init__(self, model_type: str, values: dict[str, Any]):
        self.model_type, self.values = model_type, values

    def get(self, key: str, default: Any = None) -> Any:
        """A field, or its default when the config leaves it out (or sets it to null)."""
        value = self.values.get(key)
        return default if value is None else value

    def refuse(self, key: str, value: Any, why: str, fix: str) -> SpecError:
        """The error for a field whose value specvit cannot state exactly."""
        return SpecError(
            Problem(f"config.{key}", f"{self.model_type} config has {key}={value!r}: {why}", fix)
        )

    def only(self, key: str, default: Any, allowed: Sequence[Any], why: str) -> Any:
        """A field whose value must be one of ``allowed``; anything else is refused."""
        value = self.get(key, default)
        if value not in allowed:
            raise self.refuse(key, value, why, f"use {' or '.join(repr(a) for a in allowed)}")
        return value


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
    act = c.get(key, default)
    if act not in table:
        raise c.refuse(key, act, "specvit has no such activation", f"use one of {', '.join(table)}")
    return table[act]
