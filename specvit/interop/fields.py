"""The values of a family table: a spec value read from a config field (:class:`F`) or derived (:class:`D`),
a field whose other values are refused (:class:`Only`), weights made of HF ones by a transform
(:class:`Renamed`). :mod:`specvit.interop.table` assembles them into tables."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from specvit.interop.layout import Transform
from specvit.interop.registry import Config

__all__ = ["D", "F", "Name", "Only", "Renamed", "count"]


@dataclass(frozen=True)
class F:
    """A spec value read from one config field: ``F("hidden_size", 4096)``.

    Args:
        name: the config field.
        default: the HF config class's default; its type is the field's type unless ``kind`` says otherwise.
        kind: the field's type where the default does not say it (a default of None).
        map: the field's values -> the spec's (activation names); a value it lacks is refused.
    """

    name: str
    default: Any
    kind: type | None = None
    map: Mapping[Any, Any] | None = None

    def read(self, c: Config) -> Any:
        value = c.get(self.name, self.default, self.kind or (str if self.map else None))
        if self.map is None:
            return value
        if value not in self.map:
            raise c.refuse(
                self.name, value, "specvit has no such value here", f"use one of {', '.join(self.map)}"
            )
        return self.map[value]

    def write(self, value: Any) -> dict[str, Any]:
        """The config field that reads as ``value`` (the first of the names a map sends to it)."""
        if self.map is not None:
            value = next((k for k, v in self.map.items() if v == value), value)
        if isinstance(self.default, int) and isinstance(value, (list, tuple)) and len(set(value)) == 1:
            value = value[0]  # a square image's (size, size), read from one integer field
        return {self.name: value}

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True)
class D:
    """A spec value derived from a config and the spec keys read before it (``head_dim`` only where it is not
    width / heads); None leaves the key out.

    Args:
        fn: (config, the spec's dotted keys read so far) -> the value.
        fields: the config fields it reads.
    """

    fn: Callable[[Config, Mapping[str, Any]], Any]
    fields: tuple[str, ...] = ()
    inverse: Callable[[Any, Callable[[str], Any]], Mapping[str, Any]] | None = None
    """(the spec's value, the spec's value at another dotted key) -> config fields giving it (``to_hf``)."""

    def read(self, c: Config, spec: Mapping[str, Any]) -> Any:
        return self.fn(c, spec)


def count(name: str, default: int) -> D:
    """A field that is a count (heads): an integer >= 1."""
    return D(lambda c, spec: c.size(name, default), (name,), lambda value, get: {name: value})


@dataclass(frozen=True)
class Only:
    """A config field whose value must be one of ``allowed`` (the ones the spec states); others are refused.

    Args:
        name: the config field.
        default: the HF class's default.
        allowed: the values specvit computes exactly.
        why: what another value would change.
    """

    name: str
    default: Any
    allowed: tuple[Any, ...]
    why: str


@dataclass(frozen=True)
class Renamed:
    """Weights made of HF ones by a transform other than concatenation (a (N, D) table as (1, N, D)).

    Args:
        sources: the HF module or parameter (or several).
        transform: the source tensors -> specvit's.
    """

    sources: str | tuple[str, ...]
    transform: Transform


Name = str | tuple[str, ...] | Renamed
"""An HF module (or parameter), several concatenated in order, or :class:`Renamed`."""
