"""ViTDet and SAM's image encoder (Li et al. 2022; Kirillov et al. 2023): attention over the token grid in
padded windows without shift or globally, MViTv2's decomposed relative positions, and the conv neck.

- ``block.window: {size: 14, shift: false, bias: false, pad: true}``: ViTDet's windows; the global blocks
  are written with ``overrides:`` (``window: null``) or a schedule.
- ``position: relative_decomposed``: every self-attention of the stack adds ``q · Rh[i - k] + q · Rw[j - l]``
  to its logits, from two tables of its own sized to its window (or the grid).
- ``head: {kind: neck, channels: 256}``: the tokens as a (B, C, H, W) map through SAM's neck, a shorthand
  of a ``map`` head of generic layers (:mod:`specvit.ops.conv`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import MAX_WIDTH, fragment
from specvit.ops.conv import ConvLayer, NormLayer
from specvit.ops.facts import SpecView, StackView
from specvit.ops.heads import MapHeadBase
from specvit.ops.position import Phase, PositionFragment

__all__ = ["NeckHead", "window_problems"]


def window_problems(at: str, block: Any) -> list[Problem]:
    """What a block's ``window`` cannot combine: ViTDet's windows with Swin's shift or bias table, or with
    separate q/k/v biases."""
    window = block.window
    if window is None or (not window.pad and window.bias):
        return []
    out = []
    if isinstance(block.qkv_bias, list):
        out.append(
            Problem(f"{at}.qkv_bias", "ViTDet's windows have one packed qkv projection", "use true or false")
        )
    if window.shift:
        what = "padded windows (pad: true)" if window.pad else "windows without a bias table (bias: false)"
        out.append(Problem(f"{at}.window.shift", f"{what} are ViTDet's, never shifted", "set shift: false"))
    if window.pad and window.bias:
        out.append(
            Problem(
                f"{at}.window.bias",
                "padded windows are ViTDet's, without Swin's bias table",
                "set bias: false (positions: relative_decomposed), or pad: false for Swin's windows",
            )
        )
    return out


# ------------------------------------------------------------------------- decomposed relative positions


@fragment("position")
class DecomposedPosition(PositionFragment):
    """MViTv2's decomposed relative positions (ViTDet, SAM): every self-attention adds, for a query at
    (i, j) and a key at (k, l), ``q · Rh[i - k] + q · Rw[j - l]`` to its logits, from two learned tables of
    its own sized to what it attends over (its window, or the grid)."""

    kind: Literal["relative_decomposed"] = Field(
        description="Discriminator: decomposed 2D relative positions computed in each attention."
    )

    def phase(self) -> Phase:
        return "attention"

    def writes(self) -> str:
        return "rel_pos"

    def attention_parts(self) -> dict[str, Any]:
        return {"relative": "decomposed"}

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        from specvit.ops.inputs import ImageInput

        if not isinstance(stack.input, ImageInput) or stack.hierarchical or stack.num_prefix:
            return [
                Problem(
                    at,
                    "relative_decomposed positions are over the patch grid of a plain image stack "
                    "without prefix tokens",
                    "use an image input, one number for depth, and no class or register tokens",
                )
            ]
        out = []
        for i, block in enumerate(stack.layer_blocks):
            bad = [
                key
                for key, value in (
                    ("window.bias", block.window is not None and block.window.bias),
                    ("qk_norm", block.qk_norm),
                    ("kv_heads", block.kv_heads),
                    ("head_dim", block.head_dim),
                    ("qkv_bias", isinstance(block.qkv_bias, list)),
                    ("layers", tuple(block.sublayers) != ("self_attention", "mlp")),
                )
                if value
            ]
            if bad:
                out.append(
                    Problem(
                        at,
                        f"layer {i}'s {bad[0]} does not go with relative_decomposed positions (ViTDet's "
                        "attention: self_attention and mlp, all heads of width / heads, no Swin table)",
                        f"remove {bad[0]} (window: set bias: false)",
                    )
                )
                break
        return out


# ---------------------------------------------------------------------------------------------- neck


@fragment("head")
class NeckHead(MapHeadBase):
    """SAM's image-encoder output, a shorthand of a ``map`` head: the tokens as a (B, C, H, W) map of the
    patch grid through a 1x1 conv, LayerNorm2d, a 3x3 conv and LayerNorm2d (convs without bias);
    optionally averaged and classified."""

    kind: Literal["neck"] = Field(description="Discriminator: a (B, C, H, W) feature map (SAM, ViTDet).")
    channels: int | None = Field(
        256,
        ge=1,
        le=MAX_WIDTH,
        description="The convs' output channels; null: no convs, a LayerNorm2d over the width alone "
        "(timm's neck_chans=None).",
    )
    eps: float = Field(1e-6, gt=0.0, lt=1.0, description="Epsilon of the LayerNorm2d layers.")

    path: ClassVar[str] = "neck"
    source: ClassVar[str] = "head"

    def layers(self) -> list[Any]:
        norm = NormLayer(kind="norm", type="layer", eps=self.eps)
        if self.channels is None:
            return [norm]
        return [
            ConvLayer(kind="conv", channels=self.channels, kernel=1, bias=False),
            norm,
            ConvLayer(kind="conv", channels=self.channels, kernel=3, padding=1, bias=False),
            norm,
        ]
