"""Embedding ops: image patches, token and token-type tables, prefix tokens, learned queries, and the
linear layer (projections, classifiers, tied and shared ones)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specvit.ops.base import Dims, Filler, Op, Params, Shape, linear_flops, numel, op

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "LinearParams",
    "PatchEmbedParams",
    "PrefixParams",
    "QueriesParams",
    "Ref",
    "TokenEmbedParams",
    "TypeEmbedParams",
]


@dataclass(frozen=True)
class Ref:
    """A constructor argument that is another node's module (a tied or shared weight).

    Args:
        path: the node whose module is meant.
    """

    path: str


def _pair(v: tuple[int, int]) -> str:
    return f"{v[0]}x{v[1]}"


@dataclass(frozen=True)
class PatchEmbedParams(Params):
    """Cut an image into non-overlapping patches and project each to the width.

    Args:
        size: image (height, width) in pixels.
        patch: patch (height, width) in pixels.
        channels: input channels.
        dim: output width.
        projection: ``conv`` (strided convolution) or ``linear`` (on flattened patches).
        bias: bias in the projection.
    """

    size: tuple[int, int]
    patch: tuple[int, int]
    channels: int
    dim: int
    projection: str = "conv"
    bias: bool = True

    @property
    def grid(self) -> tuple[int, int]:
        return self.size[0] // self.patch[0], self.size[1] // self.patch[1]


@op
class PatchEmbed(Op):
    kind = "patch_embed"
    params_type = PatchEmbedParams
    category = "embedding"
    module = "specvit.nn.embed:PatchEmbed"

    def shape(self, p: PatchEmbedParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, c, h, w = inputs["x"]
        if (c, h, w) != (p.channels, *p.size):
            raise ValueError(f"expects images ({p.channels}, {p.size[0]}, {p.size[1]}), got ({c}, {h}, {w})")
        return (b, p.grid[0] * p.grid[1], p.dim)

    def params(self, p: PatchEmbedParams) -> int:
        return p.channels * p.patch[0] * p.patch[1] * p.dim + p.dim * p.bias

    def flops(self, p: PatchEmbedParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        tokens = inputs["x"][0] * p.grid[0] * p.grid[1]
        return linear_flops(tokens, p.channels * p.patch[0] * p.patch[1], p.dim)

    def ctor(self, p: PatchEmbedParams) -> dict[str, Any]:
        return {
            "img_size": p.size,
            "patch": p.patch,
            "in_chans": p.channels,
            "dim": p.dim,
            "projection": p.projection,
            "bias": p.bias,
        }

    def label(self, p: PatchEmbedParams) -> tuple[str, ...]:
        return (f"patch {_pair(p.patch)} · grid {_pair(p.grid)} · {p.projection}",)


@dataclass(frozen=True)
class TokenEmbedParams(Params):
    """A token embedding table.

    Args:
        vocab: vocabulary size.
        dim: width.
        padding_idx: the id whose row stays zero and gets no gradient, or None.
        scale: multiply by sqrt(dim) ('Attention Is All You Need').
        shared_with: another stack's token embedding this one reuses (no parameters of its own).
    """

    vocab: int
    dim: int
    padding_idx: int | None = None
    scale: bool = False
    shared_with: str | None = None


@op
class TokenEmbed(Op):
    kind = "token_embed"
    params_type = TokenEmbedParams
    category = "embedding"
    module = "specvit.nn.embed:TokenEmbed"

    def shape(self, p: TokenEmbedParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return (*inputs["x"], p.dim)

    def params(self, p: TokenEmbedParams) -> int:
        return 0 if p.shared_with else p.vocab * p.dim

    def module_for(self, p: TokenEmbedParams) -> str:
        return "specvit.nn.layers:Shared" if p.shared_with else "specvit.nn.embed:TokenEmbed"

    def ctor(self, p: TokenEmbedParams) -> dict[str, Any]:
        if p.shared_with:
            return {"source": Ref(p.shared_with)}
        return {"vocab": p.vocab, "dim": p.dim, "padding_idx": p.padding_idx, "scale": p.scale}

    def label(self, p: TokenEmbedParams) -> tuple[str, ...]:
        lines = [f"vocab {p.vocab}" + (" · x sqrt(dim)" if p.scale else "")]
        if p.shared_with:
            lines.append(f"shared with {p.shared_with}")
        return tuple(lines)


@dataclass(frozen=True)
class TypeEmbedParams(Params):
    """Token-type (segment) embeddings added to the tokens (BERT); type 0 when none are given.

    Args:
        type_vocab: number of types.
        dim: width.
    """

    type_vocab: int
    dim: int


@op
class TypeEmbed(Op):
    kind = "type_embed"
    params_type = TypeEmbedParams
    category = "embedding"
    module = "specvit.nn.embed:TypeEmbed"
    ports = ("x", "types")

    def params(self, p: TypeEmbedParams) -> int:
        return p.type_vocab * p.dim

    def label(self, p: TypeEmbedParams) -> tuple[str, ...]:
        return (f"type_vocab {p.type_vocab} · added",)


@dataclass(frozen=True)
class PrefixParams(Params):
    """Learned tokens put in front of the sequence: a class token, DeiT's distillation token, then registers
    (timm's order).

    Args:
        dim: width.
        cls: a class token.
        registers: register tokens.
        distillation: a distillation token.
    """

    dim: int
    cls: bool
    registers: int = 0
    distillation: bool = False

    @property
    def count(self) -> int:
        return int(self.cls) + int(self.distillation) + self.registers


@op
class Prefix(Op):
    kind = "prefix"
    params_type = PrefixParams
    category = "embedding"
    module = "specvit.nn.embed:PrefixTokens"

    def shape(self, p: PrefixParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, n, d = inputs["x"]
        return (b, dims.plus(n, p.count), d)

    def params(self, p: PrefixParams) -> int:
        return p.count * p.dim

    def init(self, module: nn.Module, p: PrefixParams, fill: Filler) -> None:
        std = 1e-6 if fill.convention == "vit" else 0.02
        for param in module.parameters(recurse=False):
            fill(param, lambda t: t.normal_(std=std))

    def label(self, p: PrefixParams) -> tuple[str, ...]:
        tokens = ["cls"] if p.cls else []
        if p.distillation:
            tokens.append("distillation")
        if p.registers:
            tokens.append(f"{p.registers} registers")
        return (" + ".join(tokens),)


@dataclass(frozen=True)
class QueriesParams(Params):
    """DETR's learned object queries, one table row per prediction.

    Args:
        count: number of queries.
        dim: width.
    """

    count: int
    dim: int


@op
class Queries(Op):
    kind = "queries"
    params_type = QueriesParams
    category = "embedding"
    module = "specvit.nn.embed:QueryEmbed"

    def shape(self, p: QueriesParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return (inputs["x"][0], p.count, p.dim)

    def params(self, p: QueriesParams) -> int:
        return p.count * p.dim

    def init(self, module: nn.Module, p: QueriesParams, fill: Filler) -> None:
        fill(module.weight, lambda t: t.normal_())  # nn.Embedding's N(0, 1), as DETR

    def label(self, p: QueriesParams) -> tuple[str, ...]:
        return (f"{p.count} learned queries · batch from x",)


@dataclass(frozen=True)
class LinearParams(Params):
    """A linear layer on the last dim.

    Args:
        d_in: input features.
        d_out: output features.
        bias: a bias.
        tied_to: the token embedding whose weight this layer uses (a tied LM head); only a bias is owned.
        shared_with: another linear layer whose weight and bias this one applies (owns nothing).
        zero_init: weights start at zero (timm's classifier under the ViT init).
    """

    d_in: int
    d_out: int
    bias: bool = True
    tied_to: str | None = None
    shared_with: str | None = None
    zero_init: bool = False


@op
class Linear(Op):
    kind = "linear"
    params_type = LinearParams
    category = "embedding"
    module = "specvit.nn.linear:Linear"

    def shape(self, p: LinearParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        x = inputs["x"]
        if x[-1] != p.d_in:
            raise ValueError(f"expects {p.d_in} features, got {x[-1]}")
        return (*x[:-1], p.d_out)

    def params(self, p: LinearParams) -> int:
        if p.shared_with:
            return 0
        return (0 if p.tied_to else p.d_in * p.d_out) + p.d_out * p.bias

    def flops(self, p: LinearParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        return linear_flops(numel(inputs["x"]), p.d_in, p.d_out)

    def module_for(self, p: LinearParams) -> str:
        if p.shared_with:
            return "specvit.nn.layers:Shared"
        return "specvit.nn.layers:TiedLinear" if p.tied_to else "specvit.nn.linear:Linear"

    def ctor(self, p: LinearParams) -> dict[str, Any]:
        if p.shared_with:
            return {"source": Ref(p.shared_with)}
        if p.tied_to:
            return {"source": Ref(p.tied_to), "bias": p.bias}
        return {"in_features": p.d_in, "out_features": p.d_out, "bias": p.bias}

    def init(self, module: nn.Module, p: LinearParams, fill: Filler) -> None:
        if p.shared_with:
            return
        if p.zero_init:
            fill.zeros(module.weight)
        elif not p.tied_to:
            fill.matrix(module.weight)
        if module.bias is not None:
            fill.zeros(module.bias)

    def label(self, p: LinearParams) -> tuple[str, ...]:
        lines = [f"{p.d_in} → {p.d_out}"]
        if p.tied_to:
            lines.append(f"tied to {p.tied_to}")
        if p.shared_with:
            lines.append(f"shared with {p.shared_with}")
        return tuple(lines)
