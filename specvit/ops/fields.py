"""Field types shared by spec fragments: int-or-pair sizes, probabilities, kind shortcuts."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from specvit.ops.base import MAX_IMAGE

__all__ = ["Pair", "Probability", "kind_shortcut", "per_stage"]


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


def _single_or_stages(value: Any) -> str:
    return "stages" if isinstance(value, list) else "single"


def per_stage(bound: int, what: str) -> Any:
    """``int`` or a list of ints, one per stage of a hierarchical stack; errors come from one branch only."""
    one = Annotated[int, Field(ge=1, le=bound)]
    return Annotated[
        Annotated[one, Tag("single")]
        | Annotated[list[one], Tag("stages"), Field(min_length=1, max_length=8)],
        Discriminator(_single_or_stages),
        Field(description=what),
    ]


Pair = Annotated[
    tuple[Annotated[int, Field(ge=1, le=MAX_IMAGE)], Annotated[int, Field(ge=1, le=MAX_IMAGE)]],
    BeforeValidator(_pair),
]
Probability = Annotated[float, Field(ge=0.0, lt=1.0)]
