"""Field types shared by spec fragments: int-or-pair sizes, probabilities, kind shortcuts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from specvit.ops.base import MAX_IMAGE

__all__ = ["Pair", "Probability", "kind_shortcut", "per_stage", "shortcut_union"]


def _pair(value: Any) -> Any:
    """``16`` -> ``(16, 16)`` and ``[14, 16]`` -> ``(14, 16)``; anything else is left for the type check."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, list):
        if len(value) != 2:
            raise PydanticCustomError(
                "pair", "expected one integer or [height, width], got a list of {n}", {"n": len(value)}
            )
        return tuple(value)
    return value


def kind_shortcut(value: Any) -> Any:
    """Lets ``position: learned`` stand for ``position: {kind: learned}``."""
    return {"kind": value} if isinstance(value, str) else value


def shortcut_union(union: Any, members: Sequence[type[BaseModel]]) -> Any:
    """``union`` that also takes a bare kind name (``position: learned``), for the kinds that need no other key.

    The JSON Schema says the same: the union, or one of those names, so editors accept the shorthand.

    Args:
        union: the discriminated union of a slot's fragments.
        members: the fragment classes of the union.
    """
    bare = [
        m.model_fields["kind"].annotation.__args__[0]  # type: ignore[union-attr]
        for m in members
        if not any(f.is_required() for name, f in m.model_fields.items() if name != "kind")
    ]
    shown = Union[union, Literal[tuple(bare)]]  # type: ignore[valid-type]  # noqa: UP007
    return Annotated[union, BeforeValidator(kind_shortcut, json_schema_input_type=shown)]


def _single_or_stages(value: Any) -> str:
    return "stages" if isinstance(value, list) else "single"


def per_stage(bound: int, what: str, low: int = 1) -> Any:
    """``int`` (at least ``low``) or a list of ints >= 1, one per stage of a hierarchical stack; errors come
    from one branch only."""
    one = Annotated[int, Field(ge=1, le=bound)]
    single = Annotated[int, Field(ge=low, le=bound)]
    return Annotated[
        Annotated[single, Tag("single")]
        | Annotated[list[one], Tag("stages"), Field(min_length=1, max_length=8)],
        Discriminator(_single_or_stages),
        Field(description=what),
    ]


_Side = Annotated[int, Field(ge=1, le=MAX_IMAGE)]
Pair = Annotated[
    tuple[_Side, _Side],
    # the schema shows what a spec may write: one int, or [height, width]
    BeforeValidator(_pair, json_schema_input_type=Union[_Side, tuple[_Side, _Side]]),  # noqa: UP007
]
Probability = Annotated[float, Field(ge=0.0, lt=1.0)]
