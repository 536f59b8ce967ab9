"""DeBERTa's disentangled attention (He et al., 2021; v2/v3): ``position: disentangled`` adds no positions to
the tokens; every self-attention of the stack scores content against relative position and back.

The stack keeps one table of relative embeddings (2 x ``buckets`` rows, layer-normed) and one index of the
row for each query and key (log-bucketed distances); each attention projects the table with its own query
and key weights and adds ``q_i · pos_k[r(i, j)] + k_j · pos_q[r(i, j)]`` to its scores, all three terms
scaled by 1/sqrt(3 * head_dim) (the attention core's ``disentangled`` part).

The whole definition: the spec fragment and the two nodes' ops; the modules are
:class:`specvit.nn.relative.RelativeEmbedding` and :func:`specvit.nn.relative.log_bucket_index`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import MAX_LEN, Dims, Filler, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.facts import SpecView, StackView
from specvit.ops.position import Phase, PositionFragment

if TYPE_CHECKING:
    from torch import nn

__all__ = ["DisentangledPosition", "RelativeEmbeddingParams", "RelativeIndexParams"]


@dataclass(frozen=True)
class RelativeEmbeddingParams(Params):
    """The stack's table of relative embeddings.

    Args:
        rows: 2 x buckets.
        dim: the stack's width.
        norm: a LayerNorm over each row.
        eps: its epsilon.
    """

    rows: int
    dim: int
    norm: bool
    eps: float


@op
class RelativeEmbeddingOp(Op):
    kind = "relative_embedding"
    params_type = RelativeEmbeddingParams
    category = "position"
    module = "specvit.nn.relative:RelativeEmbedding"

    def shape(self, p: RelativeEmbeddingParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return (p.rows, p.dim)

    def params(self, p: RelativeEmbeddingParams) -> int:
        return p.rows * p.dim + 2 * p.dim * p.norm

    def init(self, module: nn.Module, p: RelativeEmbeddingParams, fill: Filler) -> None:
        fill.matrix(module.weight)
        fill.children(module.get_submodule("norm"))

    def label(self, p: RelativeEmbeddingParams) -> tuple[str, ...]:
        return (f"{p.rows} relative embeddings" + (" · layernorm" if p.norm else ""),)


@dataclass(frozen=True)
class RelativeIndexParams(Params):
    """The table row of each query and key: log-bucketed distances.

    Args:
        buckets: distances in each direction (the table has 2 x buckets rows).
        max_distance: the distance the last bucket stands for.
    """

    buckets: int
    max_distance: int


@op
class RelativeIndexOp(Op):
    kind = "relative_index"
    params_type = RelativeIndexParams
    category = "position"
    helpers = ("specvit.nn.relative:log_bucket_index",)

    def shape(self, p: RelativeIndexParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        n = inputs["x"][1]
        return (n, n)

    def code(self, p: RelativeIndexParams, args: Mapping[str, str]) -> str:
        return f"log_bucket_index({args['x']}, {p.buckets}, {p.max_distance})"

    def label(self, p: RelativeIndexParams) -> tuple[str, ...]:
        return (f"row of each distance · exact to {p.buckets // 2}, log-bucketed to {p.max_distance}",)


@fragment("position")
class DisentangledPosition(PositionFragment):
    """DeBERTa's disentangled attention: content-to-position and position-to-content scores of a shared
    table of relative embeddings, through each layer's own query and key projections."""

    kind: Literal["disentangled"] = Field(
        description="Discriminator: DeBERTa's disentangled attention over relative embeddings."
    )
    buckets: int = Field(
        256, ge=2, le=MAX_LEN, description="Relative distances in each direction (the table has 2x rows)."
    )
    max_distance: int = Field(
        512,
        ge=2,
        le=MAX_LEN,
        description="The distance of the last bucket (DeBERTa: max_position_embeddings).",
    )
    norm: bool = Field(True, description="A LayerNorm over the table (norm_rel_ebd: layer_norm).")

    def phase(self) -> Phase:
        return "attention"

    def writes(self) -> str:
        return "rel_embed"

    def attention_parts(self) -> dict[str, Any]:
        return {"disentangled": True}

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        why = ""
        if stack.causal:
            why = "disentangled attention scores every key against every query: it is an encoder's"
        elif stack.kv_heads != stack.heads or stack.hierarchical:
            why = "disentangled attention projects the table with every head's query and key (no GQA, no stages)"
        elif any(b.window is not None for b in stack.layer_blocks):
            why = "disentangled attention is over all tokens, not windows"
        elif self.max_distance <= self.buckets // 2:
            return [
                Problem(
                    f"{at}.max_distance",
                    f"distances up to {self.buckets // 2} are exact; max_distance must exceed it",
                    "use a larger max_distance (DeBERTa-v3: buckets 256, max_distance 512)",
                )
            ]
        return [Problem(at, why, "use another position kind")] if why else []

    def lower(self, ctx: StackCtx) -> None:
        s, role = ctx.stack, ctx.role
        table = RelativeEmbeddingParams(2 * self.buckets, s.width, self.norm, s.block.norm.eps)
        source = f"{role}.position"
        ctx.side["rel_embed"] = ctx.add(
            f"{role}.rel_embed", "relative_embedding", table, {"x": ctx.x}, source=source
        )
        index = RelativeIndexParams(self.buckets, self.max_distance)
        ctx.side["rel_index"] = ctx.add(
            f"{role}.rel_index", "relative_index", index, {"x": ctx.x}, source=source
        )
