"""SAGAN (Zhang et al., 2019): self-attention inside a convolutional feature pipeline.

A stack whose ``input: {kind: feature_map, channels: C, size: [H, W]}`` carries a (B, C, H, W) map
through its blocks; the ``sagan_attention`` sublayer attends among the H*W positions with 1x1-conv
queries and keys of C/8 channels and values of C, scaled by a learned scalar gamma that starts at 0. The
blocks are written as graphs, since a feature map has no per-token norm: ``x + attn(x)``.

The sublayer is a configuration of the one attention op (:mod:`specvit.ops.core`): 1x1-conv projections
over the map (``projection="conv"``, SAGAN's ``query``, ``key``, ``value`` with their (out, C, 1, 1)
weights), values of their own width, no output projection and the output gate ``gamma``. The core takes
the map itself rather than lowering to ``to_tokens`` -> attention -> ``to_map``: the 1x1 convs read the
map, the node keeps the map's shape, and the block stays the two nodes SAGAN draws (``attn``, ``add``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import StackCtx, fragment
from specvit.ops.block import BlockCtx, Sublayer, sublayer
from specvit.ops.core import AttentionParams, configuration
from specvit.ops.facts import SpecView, StackView
from specvit.ops.fields import Pair
from specvit.ops.inputs import InputFragment

__all__ = ["FeatureMapInput", "SaganAttentionLayer"]

MAP_SUBLAYERS = ("sagan_attention",)
"""The sublayers that read and write a (B, C, H, W) map."""
MAP_GRAPH_OPS = (*MAP_SUBLAYERS, "add", "drop_path")
"""The ops a feature-map block's graph may use (norms and layer scale act on a token's last dim)."""


@sublayer
class SaganAttentionLayer(Sublayer):
    """Self-attention among the positions of a feature map, times a learned scalar gamma (SAGAN): the
    attention core reading the map with 1x1 convs (f, g of C/8 channels, h keeping C), one head, q·k
    unscaled, no output projection, and its output gate."""

    kind = "sagan_attention"
    name = "attn"

    def lower(self, b: BlockCtx, x: str, name: str, source: str) -> str:
        spec = b.spec
        bias = spec.bias_of("q")
        p = AttentionParams(
            dim=b.dim,
            heads=1,
            kv_heads=1,
            head_dim=spec.head_dim or b.dim // 8,
            v_head_dim=b.dim,
            qkv_bias=(bias, bias, bias),
            proj=False,
            proj_bias=False,
            output_gate=True,
            projection="conv",
            scale=1.0,
        )
        return b.add(name, configuration(p), p, {"x": x}, source=source)


@fragment("input")
class FeatureMapInput(InputFragment):
    """A (B, C, H, W) feature map of a CNN, kept 2D through the blocks (SAGAN's attention layers)."""

    kind: Literal["feature_map"] = Field(description="Discriminator: a convolutional feature map.")
    channels: int = Field(ge=1, le=65536, description="Channels C of the map; the stack's width.")
    size: Pair = Field(description="Spatial size of the map: one int for square maps, or [height, width].")

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        role, out = at.split(".")[0], []
        if self.channels != stack.width:
            out.append(
                Problem(
                    f"{role}.width",
                    f"a feature map of {self.channels} channels is {self.channels} wide",
                    f"set width: {self.channels}",
                )
            )
        flat = {
            f"{role}.position": (any(p.kind != "none" for p in stack.positions), "set position: none"),
            f"{role}.prefix": (stack.num_prefix > 0, "remove prefix"),
            f"{role}.final_norm": (stack.final_norm, "set final_norm: false"),
            f"{role}.embed_norm": (stack.embed_norm, "set embed_norm: false"),
        }
        for key, (bad, fix) in flat.items():
            if bad:
                out.append(
                    Problem(key, "a feature map has no token positions, prefix tokens or token norms", fix)
                )
        return out + _map_blocks(role, stack)

    def lower(self, ctx: StackCtx) -> None:
        (h, w), c = self.size, self.channels
        ctx.x = ctx.placeholder(
            f"{ctx.role}.input",
            ctx.arg("input"),
            ("B", c, h, w),
            what=f"feature map {c}x{h}x{w}",
            local="features",
            stack=ctx.role,
        )
        ctx.n, ctx.grid = h * w, (h, w)


def _map_blocks(role: str, stack: StackView) -> list[Problem]:
    """Every block of a feature-map stack is a graph of map ops; SAGAN's attention has one head."""
    out: list[Problem] = []
    if stack.heads != 1:
        out.append(Problem(f"{role}.block.heads", "SAGAN's attention has one head", "set heads: 1"))
    if stack.block.head_dim is None and stack.width < 8:
        out.append(
            Problem(
                f"{role}.block.head_dim",
                f"queries and keys of width / 8 need a width of 8 or more, got {stack.width}",
                "set head_dim (the query and key channels)",
            )
        )
    for i, block in enumerate(stack.layer_blocks):
        if block.graph is None:
            out.append(
                Problem(
                    f"{role}.block.layers",
                    "a feature map's block is written as a graph (no norms): x + attn(x)",
                    "write graph: [{name: attn, op: sagan_attention, inputs: [x]}, {name: out, op: add, inputs: [x, attn]}]",
                )
            )
            break
        for k, node in enumerate(block.graph):
            if node.op not in MAP_GRAPH_OPS:
                out.append(
                    Problem(
                        f"{role}.block.graph.{k}.op",
                        f"{node.op} acts on tokens, not on a feature map (layer {i})",
                        f"use {', '.join(MAP_GRAPH_OPS)}",
                    )
                )
        if out:
            break
    return out
