"""Residual block patterns: the nodes of one block, from its spec's sublayers and norm placement.

- ``pre``: ``x + f(norm(x))`` per sublayer (ViT, GPT-2).
- ``post``: ``norm(x + f(x))`` per sublayer (the original Transformer, BERT).

Each branch is ``[norm] -> sublayer -> [layer scale] -> [drop path] -> add``; the sublayer's own nodes
come from its registered :class:`~specvit.ops.base.Sublayer`.
"""

from __future__ import annotations

from specvit.ops.block import SUBLAYERS, BlockCtx
from specvit.ops.structure import AddParams, DropParams, LayerScaleParams

__all__ = ["residual_block", "sublayer_names"]


def sublayer_names(layers: list[str]) -> list[str]:
    """Module names of a block's sublayers: ``attn``, ``mlp``, numbered when one occurs twice (``attn1``)."""
    names = [SUBLAYERS[layer].name for layer in layers]
    return [f"{nm}{k + 1}" if names.count(nm) > 1 else nm for k, nm in enumerate(names)]


def residual_block(b: BlockCtx, x: str, drop_path: float | None) -> str:
    """Add the nodes of block ``b`` reading ``x``; return the block's output node.

    Args:
        b: the block being lowered.
        x: the node of the block's input tokens.
        drop_path: the block's stochastic-depth rate, or None when the stack has none.
    """
    spec, role = b.spec, b.stack.role
    placement = spec.norm.placement
    for k, (layer, name) in enumerate(zip(spec.layers, sublayer_names(spec.layers), strict=True), start=1):
        source = f"{role}.block.layers.{k - 1}"
        residual = x
        h = b.norm(f"norm{k}", x, f"{role}.block.norm") if placement == "pre" else x
        h = SUBLAYERS[layer].lower(b, h, name, source)
        if spec.layer_scale is not None:
            p = LayerScaleParams(b.dim, spec.layer_scale)
            h = b.add(f"ls{k}", "layer_scale", p, {"x": h}, source=f"{role}.block.layer_scale")
        if drop_path is not None:
            h = b.add(
                f"drop_path{k}", "drop_path", DropParams(drop_path), {"x": h}, source=f"{role}.drop_path"
            )
        x = b.add(f"add{k}", "add", AddParams(), {"x": residual, "branch": h}, source=source)
        if placement == "post":
            x = b.norm(f"norm{k}", x, f"{role}.block.norm")
    return x
