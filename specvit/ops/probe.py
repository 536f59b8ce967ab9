"""Attention pooling with a learned probe (SigLIP's head, timm's ``global_pool='map'``).

A classifier head's ``pool: attention`` pools the tokens with one learned query that cross-attends over them
through the attention core, then a pre-norm MLP adds to it; the pooled vector is that query's output. Every
node is an existing op (``latents``, the attention core, a norm, ``mlp``, ``add``, ``token``), so the probe
is drawn, counted, ejected and imported like any block.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import MAX_HEADS, MAX_WIDTH, Fragment, ModelCtx
from specvit.ops.core import AttentionParams, configuration
from specvit.ops.facts import StackView
from specvit.ops.latents import LatentsParams
from specvit.ops.mlp import MlpParams
from specvit.ops.norm import NormParams
from specvit.ops.structure import AddParams, TokenParams

__all__ = ["Probe", "lower_probe"]


class Probe(Fragment):
    """The settings of ``pool: attention``; each defaults to the stack's last block."""

    heads: int | None = Field(
        None, ge=1, le=MAX_HEADS, description="Heads of the probe's attention; null = the last block's."
    )
    hidden: int | None = Field(
        None, ge=1, le=MAX_WIDTH, description="Hidden width of the MLP after it; null = the last block's."
    )

    def problems(self, stack: StackView) -> list[Problem]:
        """The probe's heads must split the stack's output width."""
        d, heads = stack.out_width, self.heads or stack.stage_heads[-1]
        if d % heads:
            return [
                Problem(
                    "head.probe.heads",
                    f"the probe's {heads} heads do not divide the width {d}",
                    f"set head.probe.heads to a divisor of {d}",
                )
            ]
        return []


def lower_probe(ctx: ModelCtx, x: str, stack: StackView, mask: str | None, probe: Probe) -> str:
    """Add the probe's nodes reading the output stack's tokens ``x`` (padding ``mask``: keys it ignores).

    Args:
        ctx: the model being lowered.
        x: the tokens, (B, N, D).
        stack: the stack they come from (its last block gives the defaults).
        mask: the padding mask node, or None.
        probe: the probe's settings.

    Returns:
        The pooled node, (B, D).
    """
    last = stack.layer(stack.total_depth - 1)
    d = stack.out_width
    heads = probe.heads or stack.stage_heads[-1]
    hidden = probe.hidden or int(last.mlp.hidden * d / stack.width)  # stages widen the MLP with the width

    def add(name: str, kind: str, p: Any, srcs: dict[str, str]) -> str:
        return ctx.add(f"head.pool.{name}", kind, p, srcs, source="head.pool", stack="head", scope="head")

    query = add("latent", "latents", LatentsParams(1, d), {"x": x})  # (B, 1, D)
    attn = AttentionParams(dim=d, heads=heads, kv_heads=heads, head_dim=d // heads, memory_dim=d)
    memory = {"memory": x} | ({"memory_mask": mask} if mask else {})
    y = add("attn", configuration(attn), attn, {"x": query, **memory})
    h = add("norm", last.norm.kind, NormParams.of(last.norm, d), {"x": y})
    h = add("mlp", "mlp", MlpParams(d, hidden, last.mlp.activation, last.mlp.bias), {"x": h})
    y = add("add", "add", AddParams(), {"x": y, "branch": h})
    return add("token", "token", TokenParams(0, "probe"), {"x": y})  # (B, D)
