"""SAGAN (Zhang et al., 2019): self-attention inside a convolutional feature pipeline.

A stack whose ``input: {kind: feature_map, channels: C, size: [H, W]}`` carries a (B, C, H, W) map
through its blocks; the ``sagan_attention`` sublayer attends among the H*W positions with 1x1-conv
queries and keys of C/8 channels and values of C, scaled by a learned scalar gamma that starts at 0. The
blocks are written as graphs, since a feature map has no per-token norm: ``x + attn(x)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import Dims, Filler, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.block import BlockCtx, Sublayer, sublayer
from specvit.ops.facts import SpecView, StackView
from specvit.ops.fields import Pair
from specvit.ops.inputs import InputFragment

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FeatureMapInput", "SaganParams"]

MAP_SUBLAYERS = ("sagan_attention",)
"""The sublayers that read and write a (B, C, H, W) map."""
MAP_GRAPH_OPS = (*MAP_SUBLAYERS, "add", "drop_path")
"""The ops a feature-map block's graph may use (norms and layer scale act on a token's last dim)."""


@dataclass(frozen=True)
class SaganParams(Params):
    """SAGAN self-attention over a feature map.

    Args:
        channels: channels C of the map (and of the values).
        qk_channels: channels of the queries and keys (SAGAN: C / 8).
        qkv_bias: biases in the query, key and value convs.
    """

    channels: int
    qk_channels: int
    qkv_bias: bool = True


@op
class SaganAttention(Op):
    kind = "sagan_attention"
    params_type = SaganParams
    category = "attention"
    module = "specvit.nn.sagan:SaganAttention"

    def shape(self, p: SaganParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        x = inputs["x"]
        if len(x) != 4 or x[1] != p.channels:
            raise ValueError(f"expects a (B, {p.channels}, H, W) feature map, got {x}")
        return x

    def params(self, p: SaganParams) -> int:
        c, qk = p.channels, p.qk_channels
        return c * (2 * qk + c) + (2 * qk + c) * p.qkv_bias + 1  # f, g, h and gamma

    def flops(self, p: SaganParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        b, c, h, w = inputs["x"]
        n, qk = h * w, p.qk_channels
        convs = 2 * b * n * c * (2 * qk + c)  # three 1x1 convs
        return convs + 2 * b * n * n * qk + 2 * b * c * n * n  # g^T f, then h beta^T

    def init(self, module: nn.Module, p: SaganParams, fill: Filler) -> None:
        fill.children(module)
        fill.zeros(module.gamma)  # the block starts as the identity

    def label(self, p: SaganParams) -> tuple[str, ...]:
        return (
            f"1x1 convs · q/k {p.channels}→{p.qk_channels} · v {p.channels}→{p.channels}",
            "softmax over positions · × gamma (init 0)",
        )


@sublayer
class SaganAttentionLayer(Sublayer):
    """Self-attention among the positions of a feature map, times a learned scalar gamma (SAGAN)."""

    kind = "sagan_attention"
    name = "attn"

    def lower(self, b: BlockCtx, x: str, name: str, source: str) -> str:
        spec = b.spec
        qk = spec.head_dim or b.dim // 8
        p = SaganParams(b.dim, qk, spec.bias_of("q"))
        return b.add(name, "sagan_attention", p, {"x": x}, source=source)


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
