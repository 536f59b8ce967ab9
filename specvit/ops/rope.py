"""Rotary positions over a sequence (RoFormer): the tables every attention layer of a stack reads for its
queries and keys, over the whole head or its first channels, in either pairing of the channels."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import Dims, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.facts import SpecView, StackView
from specvit.ops.position import Phase, PositionFragment, _base, _needs, block_rope

__all__ = ["RopeParams", "RopePosition"]


@dataclass(frozen=True)
class RopeParams(Params):
    """Rotary tables for the queries and keys of every attention layer.

    Args:
        head_dim: the width rotated: the whole head, or its first channels (partial rotary, GPT-NeoX).
        base: theta.
        grid: None for 1D positions (from the decoding offset on); the patch grid for 2D (CroCo's
            RoPE2D: first half of each head by row, second half by column).
        prefix: leading tokens left unrotated (2D only).
        of: the whole head's width when only its first ``head_dim`` channels are rotated, else 0.
        layout: which channels pair up: 1D ``half`` or ``interleaved`` (see :class:`~specvit.nn.position.Rope`);
            2D ``sections``, ``interleaved`` or ``half`` (see :class:`~specvit.nn.rope2d.Rope2d`).
        ref: 2D only: the reference grid the positions are scaled to (EVA's ``ref_feat_shape``), or None.
        axes: 2D only: ``ij``, the first frequencies take the row; ``xy``, the column.
    """

    head_dim: int
    base: float
    grid: tuple[int, int] | None = None
    prefix: int = 0
    of: int = 0
    layout: str = "sections"
    ref: tuple[int, int] | None = None
    axes: str = "ij"


@op
class RopeOp(Op):
    kind = "rope"
    params_type = RopeParams
    category = "position"
    ports = ("x", "offset")
    value = "tuple[Tensor, Tensor]"  # (cos, sin)

    def module_for(self, p: RopeParams) -> str:
        return "specvit.nn.position:Rope" if p.grid is None else "specvit.nn.rope2d:Rope2d"

    def shape(self, p: RopeParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        n, hd = inputs["x"][1], p.head_dim
        if p.layout == "interleaved":
            return (n, hd // 2, 2)  # pairs of adjacent channels
        if p.grid is None or p.layout == "half":
            return (n, hd)
        return (n, 2, hd // 2)  # a half per axis

    def ctor(self, p: RopeParams) -> dict[str, Any]:
        if p.grid is None:
            layout = {"layout": "interleaved"} if p.layout == "interleaved" else {}
            return {"head_dim": p.head_dim, "base": p.base, **layout}
        extra: dict[str, Any] = {} if p.layout == "sections" else {"layout": p.layout}
        extra |= {} if p.ref is None else {"ref_grid": p.ref}
        extra |= {} if p.axes == "ij" else {"axes": p.axes}
        return {"head_dim": p.head_dim, "grid": p.grid, "base": p.base, "num_prefix": p.prefix, **extra}

    def label(self, p: RopeParams) -> tuple[str, ...]:
        if p.grid is None:
            part = f" · first {p.head_dim} of {p.of}" if p.of else ""
            pairs = " · interleaved pairs" if p.layout == "interleaved" else ""
            return (f"rotary · head_dim {p.of or p.head_dim}{part} · base {p.base:g}{pairs}",)
        line = f"rotary 2D · grid {p.grid[0]}x{p.grid[1]} · base {p.base:g}"
        extra = [] if p.layout == "sections" else [f"{p.layout} pairs"]
        extra += [] if p.ref is None else [f"scaled to {p.ref[0]}x{p.ref[1]}"]
        extra += [] if p.axes == "ij" else ["column first"]
        extra += [f"{p.prefix} prefix unrotated"] if p.prefix else []
        return (line, " · ".join(extra)) if extra else (line,)


@fragment("position")
class RopePosition(PositionFragment):
    """Rotary position embedding of queries and keys (RoFormer)."""

    kind: Literal["rope"] = Field(description="Discriminator: 1D rotary positions.")
    base: float = _base(10000.0)
    fraction: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Share of each head rotated, from its first channel (GPT-NeoX: 0.25).",
    )
    dims: int | None = Field(
        None,
        ge=2,
        le=4096,
        description="Channels of each head rotated, from its first (GPT-J's rotary_dim); replaces fraction.",
    )
    layout: Literal["half", "interleaved"] = Field(
        "half",
        description="Which channels rotate together: half, channel i with i + r/2 (GPT-NeoX, Llama); "
        "interleaved, channels 2i and 2i + 1 (GPT-J, RoFormer).",
    )

    def phase(self) -> Phase:
        return "attention"

    def rotated(self, head_dim: int) -> int:
        """The channels rotated: ``dims``, or ``int(head_dim * fraction)`` as GPT-NeoX's ``rotary_ndims``."""
        return self.dims if self.dims is not None else int(head_dim * self.fraction)

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        hd, rot = stack.head_dim, self.rotated(stack.head_dim)
        if self.dims is not None:
            return _needs(
                f"{at}.dims",
                rot % 2 == 0 and rot <= hd,
                f"rope over {rot} channels of head dim {hd}: the count must be even and at most the head dim",
                f"pick an even dims <= {hd}",
            )
        if self.fraction < 1.0:
            return _needs(
                f"{at}.fraction",
                rot >= 2 and rot % 2 == 0,
                f"rope over {self.fraction:g} of head dim {hd} rotates {rot} channels, which must be even and >= 2",
                "pick a fraction that gives an even number of channels",
            )
        return _needs(
            at,
            hd % 2 == 0,
            f"rope needs an even head dim, got {hd}",
            "pick heads (or head_dim) so that width/heads is even",
        )

    def lower(self, ctx: StackCtx) -> None:
        """The stack's tables (``side["rope"]``), and one more per other theta its blocks set
        (``side["rope_10000"]``): computed once, read by every block of that theta."""
        hd, rot = ctx.stack.facts.head_dim, self.rotated(ctx.stack.facts.head_dim)
        srcs = {"x": ctx.x, "offset": ctx.side.get("offset", "")}
        bases = {self.base: "rope"} | {
            b.rope.base: block_rope(b.rope.base)
            for b in ctx.stack.layer_blocks
            if b.rope and b.rope.base != self.base
        }
        for base, name in bases.items():
            p = RopeParams(rot, base, of=hd if rot < hd else 0, layout=self.layout)
            source = f"{ctx.role}.position" if name == "rope" else f"{ctx.role}.block.rope"
            ctx.side[name] = ctx.add(f"{ctx.role}.{name}", "rope", p, srcs, source=source)
