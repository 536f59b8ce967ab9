"""Cross-field rules of windowed attention's Swin-V2 options and of patch merging's norm."""

from __future__ import annotations

from specvit.errors import Problem
from specvit.spec.schema import StackSpec

__all__ = ["check_window"]


def check_window(role: str, s: StackSpec) -> list[Problem]:
    """What the base block's ``window`` options and the stack's ``merge_norm`` need.

    Args:
        role: ``encoder`` or ``decoder``.
        s: the stack.
    """
    out: list[Problem] = []
    if s.merge_norm != "pre" and not s.hierarchical:
        out.append(
            Problem(
                f"{role}.merge_norm",
                "merge_norm places the norm of patch merging, which only a hierarchical stack has",
                "remove merge_norm, or give depth per stage (depth: [2, 2, 6, 2])",
            )
        )
    w, at = s.block.window, f"{role}.block.window"
    if w is None:
        return out
    if w.bias != "cpb":
        for key in ("pretrained", "cpb_hidden"):
            if getattr(w, key) is not None:
                out.append(
                    Problem(
                        f"{at}.{key}",
                        f"{key} configures Swin-V2's continuous position bias MLP (bias: cpb), "
                        f"but bias is {str(w.bias).lower()}",
                        f"set bias: cpb, or remove {key}",
                    )
                )
    if w.cosine and (w.bias is False or w.pad):
        out.append(
            Problem(
                f"{at}.cosine",
                "cosine attention is Swin-V2's, in Swin's windows; ViTDet's windows (bias: false, pad) "
                "do not take it",
                "set cosine: false, or bias: cpb and pad: false",
            )
        )
    stages = len(s.stage_depths)
    if isinstance(w.pretrained, list) and len(w.pretrained) != stages:
        out.append(
            Problem(
                f"{at}.pretrained",
                f"{len(w.pretrained)} pretrained window sizes for {stages} stages",
                f"give one per stage ({stages}), or one number for all",
            )
        )
    if w.cosine and s.block.attention_scale is not None:
        out.append(
            Problem(
                f"{role}.block.attention_scale",
                "cosine attention scales by its learned per-head logit scale, not attention_scale",
                "remove attention_scale, or set window.cosine: false",
            )
        )
    return out
