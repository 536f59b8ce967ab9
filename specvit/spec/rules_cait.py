"""Cross-field rules of CaiT's parts: a prefix that enters late (``prefix.at``), class-attention blocks and
talking-heads attention (parts of the attention op, :mod:`specvit.ops.core`)."""

from __future__ import annotations

from specvit.errors import Problem
from specvit.spec.block import BlockSpec
from specvit.spec.rules_block import _origins
from specvit.spec.schema import Spec, StackSpec

__all__ = ["check_cait"]


def check_cait(role: str, s: StackSpec, spec: Spec) -> list[Problem]:
    """Problems of ``prefix.at``, ``class_attention`` and ``talking_heads`` in stack ``role``."""
    out = _prefix_at(role, s)
    for block, at in _origins(role, s).values():
        out += _talking(role, at, block, s)
        out += _class_attention(at, block, s)
    first = next((i for i, b in enumerate(s.layer_blocks) if "class_attention" in b.sublayers), None)
    if first is not None and (not s.prefix.cls or s.prefix_at > first):
        out.append(
            Problem(
                f"{role}.prefix",
                f"block {first} has class_attention, but no class token is in front of it"
                + (f" (the prefix enters before block {s.prefix_at})" if s.prefix.cls else ""),
                f"write prefix: {{cls: true, at: {first}}}",
            )
        )
    return out


def _prefix_at(role: str, s: StackSpec) -> list[Problem]:
    if not s.prefix_at:
        return []
    out: list[Problem] = []
    if s.prefix_at > s.total_depth:
        out.append(
            Problem(
                f"{role}.prefix.at",
                f"the prefix would enter before block {s.prefix_at}, but the stack has {s.total_depth}",
                f"use 0 .. {s.total_depth} ({s.total_depth}: after the last block)",
            )
        )
    if not s.num_prefix:
        out.append(
            Problem(f"{role}.prefix.at", "there are no prefix tokens to enter", "remove at, or set cls: true")
        )
    last = s.total_depth - s.stage_depths[-1]
    if s.hierarchical and s.prefix_at < last:
        out.append(
            Problem(
                f"{role}.prefix.at",
                f"the prefix would enter before block {s.prefix_at}, and the layers into the stages after it "
                "read the tokens as a grid, without prefix tokens",
                f"use at: {last} (the last stage's first block) or later",
            )
        )
    for position in s.positions:
        if position.phase() == "tokens" and position.writes():  # position: none adds nothing
            out.append(
                Problem(
                    f"{role}.position",
                    f"position {position.kind} is added to the tokens after the prefix, which enters only "
                    f"before block {s.prefix_at}",
                    "use a position table over the patches only: {kind: learned, include_prefix: false}",
                )
            )
    return out


def _talking(role: str, at: str, b: BlockSpec, s: StackSpec) -> list[Problem]:
    if not b.talking_heads:
        return []
    why = ""
    if "masked_self_attention" in b.sublayers or s.causal:
        why = "talking-heads attention has no causal, KV-cached decoding path (it cannot use fused SDPA)"
    elif "self_attention" not in b.sublayers:
        why = "talking_heads changes self_attention, and the block has none"
    elif b.window is not None or b.sliding_window is not None:
        why = "talking-heads attention attends globally, not within windows"
    elif s.kv_heads != s.heads:
        why = "talking-heads attention has as many key/value heads as heads"
    elif isinstance(b.qkv_bias, list) and len(set(b.qkv_bias)) > 1:
        why = "talking-heads attention has one bias flag for q, k and v"
    elif any(p.kind == "sine2d" for p in s.positions):
        why = "talking-heads attention reads no DETR positions"
    if not why:
        return []
    return [Problem(f"{at}.talking_heads", why, "remove talking_heads, or use a plain self_attention block")]


def _class_attention(at: str, b: BlockSpec, s: StackSpec) -> list[Problem]:
    if "class_attention" not in b.sublayers:
        return []
    why, key = "", "layers"
    if b.graph is not None:
        why, key = "class_attention narrows the block's adds to the class token: write it in layers:", "graph"
    elif b.parallel:
        why, key = (
            "the sublayers after class_attention read the class token alone, not in parallel",
            "parallel",
        )
    elif b.qk_norm or b.talking_heads or b.window is not None or b.sliding_window is not None:
        why = "class attention has no qk_norm, talking heads or windows"
        key = next(k for k in ("qk_norm", "talking_heads", "window", "sliding_window") if getattr(b, k))
    elif s.kv_heads != s.heads:
        why, key = "class attention has as many key/value heads as heads", "layers"
    if not why:
        return []
    return [Problem(f"{at}.{key}", why, "write CaiT's class-attention block: layers: [class_attention, mlp]")]
