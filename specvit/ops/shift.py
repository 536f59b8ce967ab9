"""A decoder's token ids made of its encoder's: the source shifted one position right behind a start id (HF's
``shift_tokens_right``, what BART's, mBART's and T5's ``*ForSequenceClassification`` feed their decoder when
given ``input_ids`` alone). Written as the decoder's ``input.shifted_source``; the model then takes no target
argument: ``model(src)``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from specvit.ops.base import Dims, Op, Params, Shape, StackCtx, op

__all__ = ["ShiftParams", "lower_shifted"]


@dataclass(frozen=True)
class ShiftParams(Params):
    """The ids one position right behind ``start``.

    Args:
        start: the id in front; None: each row's last token that is not ``pad`` (mBART's language id).
        pad: the padding id, read where ``start`` is None.
    """

    start: int | None
    pad: int | None = None


@op
class ShiftRight(Op):
    kind = "shift_right"
    params_type = ShiftParams
    category = "embedding"
    helpers: ClassVar[tuple[str, ...]] = ("specvit.nn.functional:shift_right",)

    def shape(self, p: ShiftParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return inputs["x"]

    def code(self, p: ShiftParams, args: Mapping[str, str]) -> str:
        pad = "" if p.start is not None else f", {p.pad!r}"
        return f"shift_right({args['x']}, {p.start!r}{pad})"

    def label(self, p: ShiftParams) -> tuple[str, ...]:
        first = f"id {p.start}" if p.start is not None else f"the last id that is not {p.pad}"
        return ("the source ids shifted right", f"{first} first")


def lower_shifted(ctx: StackCtx, start: int | None, pad: int | None) -> str:
    """The node of the decoder's ids: the encoder's input ids shifted right; the decoder's length is the
    source's.

    Args:
        ctx: the decoder being lowered.
        start: the id in front (None: the last id that is not ``pad``).
        pad: the padding id.
    """
    src = "encoder.input"
    ctx.n = ctx.shape(src)[1]
    p = ShiftParams(start, pad if start is None else None)
    return ctx.add(
        f"{ctx.role}.shifted", "shift_right", p, {"x": src}, source=f"{ctx.role}.input.shifted_source"
    )
