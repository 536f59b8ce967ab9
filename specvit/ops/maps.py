"""Maps and tokens: a (B, C, *size) map as (B, positions, C) tokens and back, and a map's mean over its
positions (the stems' and map heads' joints with the transformer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specvit.ops.base import Dims, Op, Params, Shape, op

__all__ = ["MapPoolParams", "ToMapParams", "ToTokensParams", "spatial"]


def spatial(x: Shape) -> tuple[int, ...]:
    """The spatial sizes of a (B, C, *size) map's shape."""
    size = x[2:]
    assert all(isinstance(s, int) for s in size), x
    return tuple(s for s in size if isinstance(s, int))


@dataclass(frozen=True)
class ToTokensParams(Params):
    """A (B, C, *size) map as (B, positions, C) tokens, row-major."""


@op
class ToTokens(Op):
    kind = "to_tokens"
    params_type = ToTokensParams
    helpers = ("specvit.nn.functional:to_tokens",)

    def shape(self, p: ToTokensParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, c = inputs["x"][:2]
        n = 1
        for s in spatial(inputs["x"]):
            n *= s
        return (b, n, c)

    def code(self, p: ToTokensParams, args: Mapping[str, str]) -> str:
        return f"to_tokens({args['x']})"

    def label(self, p: ToTokensParams) -> tuple[str, ...]:
        return ("map → tokens",)


@dataclass(frozen=True)
class ToMapParams(Params):
    """(B, N, C) tokens of a row-major (rows, cols) grid as a (B, C, rows, cols) map."""

    grid: tuple[int, int]


@op
class ToMap(Op):
    kind = "to_map"
    params_type = ToMapParams
    helpers = ("specvit.nn.functional:to_map",)

    def shape(self, p: ToMapParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, n, c = inputs["x"]
        if n != p.grid[0] * p.grid[1]:
            raise ValueError(f"expects the {p.grid[0]}x{p.grid[1]} tokens of the grid, got {n}")
        return (b, c, *p.grid)

    def code(self, p: ToMapParams, args: Mapping[str, str]) -> str:
        return f"to_map({args['x']}, {p.grid!r})"

    def label(self, p: ToMapParams) -> tuple[str, ...]:
        return (f"tokens → {p.grid[0]}x{p.grid[1]} map",)


@dataclass(frozen=True)
class MapPoolParams(Params):
    """The mean of a (B, C, *size) map over its positions."""


@op
class MapPool(Op):
    kind = "map_pool"
    params_type = MapPoolParams
    category = "head"
    helpers = ("specvit.nn.functional:map_mean",)

    def shape(self, p: MapPoolParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return inputs["x"][:2]

    def code(self, p: MapPoolParams, args: Mapping[str, str]) -> str:
        return f"map_mean({args['x']})"

    def label(self, p: MapPoolParams) -> tuple[str, ...]:
        return ("mean over the map",)
