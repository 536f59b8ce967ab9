"""The ``pool`` op: the tokens pooled to one vector per sequence, by a classifier head (``head.pool``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specvit.ops.base import Dims, Op, Params, Shape, op

__all__ = ["PoolParams"]


@dataclass(frozen=True)
class PoolParams(Params):
    """Pool the tokens to one vector: the class token (``cls``), the first token (``first``: BERT's [CLS]
    of the input), the mean of the rest (``mean``), the class token beside that mean (``cls_mean``, twice as
    wide: DINOv2's classifier), the end-of-text token (``eos``, CLIP's text tower; ``last_eos``, its last
    occurrence: BART's and T5's sequence classifiers) or the last token that is not padding (``last``).

    Args:
        kind: ``cls``, ``first``, ``mean``, ``cls_mean``, ``eos``, ``last_eos`` or ``last``.
        prefix: the leading class and register tokens a mean leaves out.
        eos_id: the end token's id for ``eos`` and ``last_eos`` (None: the highest id in each sequence).
    """

    kind: str
    prefix: int = 0
    eos_id: int | None = None


@op
class Pool(Op):
    kind = "pool"
    params_type = PoolParams
    category = "head"
    ports = ("x", "mask", "ids")
    helpers = (
        "specvit.nn.functional:cls_pool",
        "specvit.nn.functional:cls_mean_pool",
        "specvit.nn.functional:eos_pool",
        "specvit.nn.functional:last_pool",
        "specvit.nn.functional:mean_pool",
    )

    def shape(self, p: PoolParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, _, d = inputs["x"]
        return (b, 2 * d if p.kind == "cls_mean" else d)

    def code(self, p: PoolParams, args: Mapping[str, str]) -> str:
        if p.kind in ("cls", "first"):
            return f"cls_pool({args['x']})"
        if p.kind in ("eos", "last_eos"):
            return f"eos_pool({args['x']}, {args['ids']}, {p.eos_id!r}{', last=True' * (p.kind != 'eos')})"
        mask = f", {args['mask']}" if "mask" in args else ""
        if p.kind == "last":
            return f"last_pool({args['x']}{mask})"
        if p.kind == "cls_mean":
            return f"cls_mean_pool({args['x']}, {p.prefix}{mask})"
        return f"mean_pool({args['x']}, {p.prefix}{mask})"

    def label(self, p: PoolParams) -> tuple[str, ...]:
        if p.kind in ("cls", "first"):
            return ("the class token",) if p.kind == "cls" else ("the first token",)
        if p.kind in ("eos", "last_eos"):
            which = "the highest id" if p.eos_id is None else f"id {p.eos_id}"
            return (f"the {'last ' * (p.kind != 'eos')}end-of-text token ({which})",)
        if p.kind == "last":
            return ("the last token that is not padding",)
        skip = f" · prefix ({p.prefix}) excluded" if p.prefix else ""
        if p.kind == "cls_mean":
            return ("the class token", f"beside the mean of the tokens{skip}")
        return (f"mean of the tokens{skip}",)
