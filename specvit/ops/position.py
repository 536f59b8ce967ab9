"""Position encodings: what a spec writes under ``position:`` and the graph nodes each becomes.

A position either changes the tokens (learned and sinusoidal tables, added before or after the prefix
tokens) or is a table the attention layers read (rotary tables, DETR's sine positions): its ``phase``
says which, and ``lower`` emits the node and wires it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from specvit.errors import Problem, SpecError
from specvit.ops.base import MAX_LEN, Dims, Filler, Fragment, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.block import BlockCtx, block_input
from specvit.ops.facts import SpecView, StackView
from specvit.ops.resampled import ResampledParams, TableGrid
from specvit.ops.structure import DropParams

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Phase", "PositionFragment", "block_position", "block_rope"]

Phase = Literal["before_prefix", "tokens", "attention"]


class PositionFragment(Fragment):
    """Base of the ``position:`` kinds."""

    kind: str

    def phase(self) -> Phase:
        """``before_prefix``/``tokens``: added to the tokens before/after the prefix; ``attention``: read there."""
        return "tokens"

    def writes(self) -> str:
        """What it gives the stack: ``tokens`` (added to them), or the side value attention reads
        (``rope``, ``bias``, ``pos``); two kinds in one stack must not give the same."""
        return "tokens" if self.phase() != "attention" else "rope"

    def lower(self, ctx: StackCtx) -> None:
        """Emit this position's nodes for the stack being lowered."""

    def attention_parts(self) -> dict[str, Any]:
        """Parts it turns on in every self-attention of the stack, computed there (the attention op's
        :class:`~specvit.ops.core.AttentionParams` fields): MViTv2's decomposed tables."""
        return {}

    def lower_layer(self, b: BlockCtx, x: str, name: str) -> str | None:
        """A node of one self-attention layer's own (BEiT's per-layer bias table), read as its ``bias``;
        None for kinds that give the stack one value."""
        return None


def _base(default: float) -> Any:
    return Field(default, gt=1.0, description="Wavelength base (rotary: theta).")


def block_rope(base: float) -> str:
    """The name of the rotary tables of theta ``base`` that some blocks read instead of the stack's
    (``rope_10000``): the stack's side value, node and the blocks' forward parameter."""
    return "rope_" + (str(int(base)) if base.is_integer() else str(base).replace(".", "_"))


def _needs(at: str, ok: bool, what: str, fix: str) -> list[Problem]:
    return [] if ok else [Problem(at, what, fix)]


def _grid_only(kind: str, at: str, stack: StackView) -> list[Problem]:
    from specvit.ops.inputs import ImageInput

    return _needs(
        at,
        isinstance(stack.input, ImageInput) or stack.input.kind in ("siamese", "unmask"),
        f"{kind} positions need an image input (a 2D grid of patches)",
        f"use {'sincos' if kind == 'sincos2d' else 'rope'} for {stack.input.kind} inputs",
    )


@fragment("position")
class NoPosition(PositionFragment):
    """No position information."""

    kind: Literal["none"] = Field(description="Discriminator: no positions.")

    def writes(self) -> str:
        return ""


# ---------------------------------------------------------------------------------- additive tables


@dataclass(frozen=True)
class LearnedParams(Params):
    """A learned table of ``max_len`` rows; with a KV cache, rows from the decoding offset on.

    Args:
        max_len: table rows.
        dim: width.
        start: the row of position 0 (BART and OPT keep 2 unused rows first).
    """

    max_len: int
    dim: int
    start: int = 0


@op
class LearnedOp(Op):
    kind = "pos_learned"
    params_type = LearnedParams
    category = "position"
    module = "specvit.nn.position:LearnedPosition"
    ports = ("x", "offset")

    def params(self, p: LearnedParams) -> int:
        return p.max_len * p.dim

    def ctor(self, p: LearnedParams) -> dict[str, Any]:
        return {"num_positions": p.max_len, "dim": p.dim, "start": p.start}

    def init(self, module: nn.Module, p: LearnedParams, fill: Filler) -> None:
        if fill.convention == "vit":
            fill(module.weight, lambda t: _trunc_normal(t, 0.02))
        else:
            fill(module.weight, lambda t: t.normal_(std=0.02))

    def label(self, p: LearnedParams) -> tuple[str, ...]:
        start = f" · from row {p.start}" if p.start else ""
        return (f"max_len {p.max_len - p.start}{start} · added",)


def _trunc_normal(t: Any, std: float) -> Any:
    import torch.nn as nn

    return nn.init.trunc_normal_(t, std=std)


@fragment("position")
class LearnedPosition(PositionFragment):
    """A learned table of position embeddings, added to the tokens."""

    kind: Literal["learned"] = Field(description="Discriminator: learned absolute positions.")
    max_len: int | None = Field(
        None,
        ge=1,
        le=MAX_LEN,
        description="Table length; derived for images, required for tokens and features.",
    )
    include_prefix: bool = Field(
        True, description="The table covers the prefix tokens too (timm's default); false: patches only."
    )
    offset: int = Field(
        0,
        ge=0,
        le=1024,
        description="Rows before position 0 (BART and OPT: 2); the table has max_len + offset.",
    )
    grid: TableGrid | None = Field(
        None,
        description="Images: the table's own patch grid, resampled to the image's on every forward (timm's "
        "NaFlexVit keeps one 16 x 16 table for every image size); needs include_prefix: false. null: the "
        "table is the image's grid.",
    )

    def phase(self) -> Phase:
        return "tokens" if self.include_prefix else "before_prefix"

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        from specvit.ops.inputs import ImageInput, SignalInput

        if self.grid is not None:
            image = isinstance(stack.input, ImageInput)
            return _needs(
                f"{at}.grid",
                image,
                "a resampled table needs an image input (a grid of patches)",
                "remove grid",
            ) + _needs(
                f"{at}.include_prefix",
                not self.include_prefix and self.max_len is None,
                "a resampled table covers the patches only, without max_len",
                "set include_prefix: false and remove max_len",
            )
        if isinstance(stack.input, ImageInput | SignalInput):
            needed = stack.input.tokens + (stack.num_prefix if self.include_prefix else 0)
            if self.max_len is not None and self.max_len != needed:
                sizes = "image and patch sizes" if stack.input.kind == "image" else "signal's length and stem"
                return [
                    Problem(
                        f"{at}.max_len",
                        f"the {stack.input.kind} gives {needed} positions, not {self.max_len}",
                        f"remove max_len: it is derived from the {sizes}",
                    )
                ]
        elif self.max_len is None and stack.input.kind != "siamese":
            return [
                Problem(
                    f"{at}.max_len",
                    f"learned positions of a {stack.input.kind} input need a max_len",
                    "set the longest sequence, e.g. max_len: 512",
                )
            ]
        return []

    def lower(self, ctx: StackCtx) -> None:
        if self.grid is not None:
            assert ctx.grid is not None  # an image input (the check)
            g, width = self.grid, ctx.stack.facts.embedding_width
            resampled = ResampledParams(g.size, ctx.grid, width, g.mode, g.antialias)
            ctx.x = ctx.add(
                f"{ctx.role}.pos_embed",
                "pos_resampled",
                resampled,
                {"x": ctx.x},
                source=f"{ctx.role}.position",
            )
            return
        needed = ctx.dims.size(ctx.n)
        if self.max_len is not None and needed > self.max_len:
            symbol = str(ctx.n).split("+")[0]
            extra = needed - ctx.dims.size(symbol)  # prefix tokens the table covers
            raise SpecError(
                Problem(
                    f"{ctx.role}.position.max_len",
                    f"{symbol}={ctx.dims.size(symbol)} is longer than the {self.max_len} learned positions",
                    f"use {symbol} <= {self.max_len - extra}, or raise max_len",
                    ctx.spec.locate(f"{ctx.role}.position.max_len"),
                )
            )
        rows = self.max_len if self.max_len is not None else needed
        p = LearnedParams(rows + self.offset, ctx.stack.facts.embedding_width, self.offset)
        srcs = {"x": ctx.x, "offset": ctx.side.get("offset", "")}
        ctx.x = ctx.add(f"{ctx.role}.pos_embed", "pos_learned", p, srcs, source=f"{ctx.role}.position")


@block_input
def block_position(b: BlockCtx, x: str) -> str:
    """A block's own learned table (``block.absolute_position: learned``), added to the tokens entering it: one row
    per token there (the stage's grid and the prefix tokens in front), at the block's width; then the stack's
    embedding dropout, as after the stack's table (PVT v1's per-stage tables).

    Args:
        b: the block.
        x: its input tokens, (B, N, D) with N fixed (the rules keep the key to inputs of a fixed size).
    """
    if b.spec.absolute_position != "learned":
        return x
    rows = b.stack.shape(x)[1]
    assert isinstance(rows, int)
    source = f"{b.stack.role}.block.absolute_position"
    x = b.add("pos_embed", "pos_learned", LearnedParams(rows, b.dim), {"x": x}, source=source)
    if rate := b.stack.stack.dropout.embedding:
        x = b.add(
            "pos_drop", "dropout", DropParams(rate), {"x": x}, source=f"{b.stack.role}.dropout.embedding"
        )
    return x


@dataclass(frozen=True)
class SinCosParams(Params):
    """Fixed 1D sinusoids ('Attention Is All You Need'), from the decoding offset on.

    Args:
        dim: width.
        base: wavelength base.
        layout: ``interleaved`` (sin, cos per frequency) or ``concat`` (all sines, then all cosines).
        frequencies: ``paper`` (``base^(-2i/dim)``) or ``tensor2tensor`` (``base^(-i/(dim/2 - 1))``).
        start: the position of the first token.
    """

    dim: int
    base: float
    layout: str = "interleaved"
    frequencies: str = "paper"
    start: int = 0


@op
class SinCosOp(Op):
    kind = "pos_sincos"
    params_type = SinCosParams
    category = "position"
    module = "specvit.nn.position:SinCosPosition"
    ports = ("x", "offset")

    def ctor(self, p: SinCosParams) -> dict[str, Any]:
        given = {
            "layout": (p.layout, "interleaved"),
            "frequencies": (p.frequencies, "paper"),
            "start": (p.start, 0),
        }
        return {"dim": p.dim, "base": p.base} | {k: v for k, (v, default) in given.items() if v != default}

    def label(self, p: SinCosParams) -> tuple[str, ...]:
        layout = " · sin | cos" if p.layout == "concat" else ""
        frequencies = " · tensor2tensor" if p.frequencies == "tensor2tensor" else ""
        start = f" · from {p.start}" if p.start else ""
        return (f"fixed · base {p.base:g}{layout}{frequencies}{start} · added",)


@fragment("position")
class SinCosPosition(PositionFragment):
    """Fixed 1D sinusoids of 'Attention Is All You Need', added to the tokens."""

    kind: Literal["sincos"] = Field(description="Discriminator: fixed 1D sinusoidal positions.")
    base: float = _base(10000.0)
    layout: Literal["interleaved", "concat"] = Field(
        "interleaved",
        description="interleaved: sin and cos of each frequency side by side (the paper, PyTorch's "
        "tutorial); concat: all sines, then all cosines (Marian).",
    )
    frequencies: Literal["paper", "tensor2tensor"] = Field(
        "paper",
        description="paper: wavelengths base^(2i/width); tensor2tensor: base^(i/(width/2 - 1)), the last "
        "exactly base (tensor2tensor, fairseq, M2M100).",
    )
    offset: int = Field(
        0,
        ge=0,
        le=MAX_LEN,
        description="The position of the first token: tokens are numbered from it (M2M100: pad_token_id + 1).",
    )

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        width = stack.embedding_width
        return _needs(
            at, width % 2 == 0, f"sincos positions need an even width, got {width}", "use an even width"
        ) + _needs(
            f"{at}.frequencies",
            self.frequencies != "tensor2tensor" or width >= 4,
            f"tensor2tensor frequencies need a width of 4 or more, got {width}",
            "use a wider stack, or frequencies: paper",
        )

    def lower(self, ctx: StackCtx) -> None:
        p = SinCosParams(
            ctx.stack.facts.embedding_width, self.base, self.layout, self.frequencies, self.offset
        )
        srcs = {"x": ctx.x, "offset": ctx.side.get("offset", "")}
        ctx.x = ctx.add(f"{ctx.role}.pos_embed", "pos_sincos", p, srcs, source=f"{ctx.role}.position")


@dataclass(frozen=True)
class GridTableParams(Params):
    """A fixed table over a (rows, cols) token grid.

    Args:
        dim: width.
        grid: the token grid, row-major.
        base: wavelength base (DETR: temperature).
    """

    dim: int
    grid: tuple[int, int]
    base: float


@dataclass(frozen=True)
class SinCos2dParams(GridTableParams):
    """A fixed 2D table; ``prefix`` tokens in front of the grid (MAE's decoder gets the encoder's class
    token) get the zero position."""

    prefix: int = 0


@op
class SinCos2dOp(Op):
    kind = "pos_sincos2d"
    params_type = SinCos2dParams
    category = "position"
    module = "specvit.nn.position:SinCos2dPosition"

    def label(self, p: SinCos2dParams) -> tuple[str, ...]:
        zero = f" · {p.prefix} prefix at 0" if p.prefix else ""
        return (f"fixed · grid {p.grid[0]}x{p.grid[1]} · base {p.base:g} · added{zero}",)


@fragment("position")
class SinCos2dPosition(PositionFragment):
    """Fixed 2D sinusoids over the patch grid (MAE), added to the patch tokens."""

    kind: Literal["sincos2d"] = Field(description="Discriminator: fixed 2D sinusoidal positions (images).")
    base: float = _base(10000.0)

    def phase(self) -> Phase:
        return "before_prefix"

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        return _grid_only("sincos2d", at, stack) + _needs(
            at,
            stack.width % 4 == 0,
            f"sincos2d positions need a width divisible by 4, got {stack.width}",
            "use a width that is a multiple of 4",
        )

    def lower(self, ctx: StackCtx) -> None:
        assert ctx.grid is not None
        cells = ctx.grid[0] * ctx.grid[1]  # tokens the input put in front of the grid have no position
        prefix = ctx.n - cells if isinstance(ctx.n, int) else 0
        p = SinCos2dParams(ctx.stack.width, ctx.grid, self.base, prefix)
        ctx.x = ctx.add(
            f"{ctx.role}.pos_embed", "pos_sincos2d", p, {"x": ctx.x}, source=f"{ctx.role}.position"
        )


# --------------------------------------------------------------------------- tables attention reads


@op
class Sine2dOp(Op):
    kind = "pos_sine2d"
    params_type = GridTableParams
    category = "position"
    module = "specvit.nn.position:Sine2dPosition"

    def shape(self, p: GridTableParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return (1, p.grid[0] * p.grid[1], p.dim)

    def label(self, p: GridTableParams) -> tuple[str, ...]:
        return (f"2D sine · grid {p.grid[0]}x{p.grid[1]} · to q, k of every attention",)


@fragment("position")
class Sine2dPosition(PositionFragment):
    """DETR's 2D sine positions, added to queries and keys in every attention layer (never to values).

    Coordinates are normalised to (0, 2*pi]; half the channels encode the row, half the column, each as
    interleaved sin/cos of ``base**(2i/d)`` frequencies. The decoder's cross-attention adds them to the
    memory's keys too.
    """

    kind: Literal["sine2d"] = Field(
        description="Discriminator: DETR's 2D sine positions in every attention layer."
    )
    base: float = Field(10000.0, gt=1.0, description="Temperature of the frequencies.")

    def phase(self) -> Phase:
        return "attention"

    def writes(self) -> str:
        return "pos"

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        out: list[Problem] = []
        if stack.grid is None:
            out.append(
                Problem(
                    at,
                    "sine2d positions need a 2D grid of tokens",
                    "use an image input, or give the features input a grid: [rows, cols]",
                )
            )
        elif stack.num_prefix:
            out.append(
                Problem(
                    f"{at.rsplit('.', 1)[0]}.prefix",
                    "sine2d positions cover the grid only, not prefix tokens",
                    "remove the prefix tokens",
                )
            )
        return out + _needs(
            at,
            stack.width % 4 == 0,
            f"sine2d positions need a width divisible by 4, got {stack.width}",
            "use a width that is a multiple of 4",
        )

    def lower(self, ctx: StackCtx) -> None:
        assert ctx.grid is not None
        p = GridTableParams(ctx.stack.width, ctx.grid, self.base)
        pos = ctx.add(f"{ctx.role}.pos_embed", "pos_sine2d", p, {"x": ctx.x}, source=f"{ctx.role}.position")
        ctx.side["pos"] = pos
        ctx.memory["pos"] = pos  # a decoder reading this stack adds them to the memory's keys (DETR)
