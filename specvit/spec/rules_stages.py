"""Cross-field rules of free stage widths, the layers between stages (``widths``, ``downsample``), PVT's
spatial reduction (``block.spatial_reduction``), the Mix-FFN's depthwise conv (``mlp.dwconv``), a block's own
position table (``block.absolute_position``) and a prefix entering a hierarchical stack's last stage."""

from __future__ import annotations

from specvit.errors import Problem
from specvit.ops.conv import map_ops_problems, map_out
from specvit.ops.grid import per_stage_value
from specvit.spec.block import BlockSpec
from specvit.spec.schema import StackSpec

__all__ = ["check_stages"]


def check_stages(role: str, s: StackSpec) -> list[Problem]:
    """What ``widths``, ``downsample``, ``spatial_reduction`` and ``mlp.dwconv`` need.

    Args:
        role: ``encoder`` or ``decoder``.
        s: the stack.
    """
    out = _widths(role, s)
    out += _downsample(role, s) if not out else []
    return out + _reduction(role, s) + _dwconv(role, s) + _late_prefix(role, s) + _block_position(role, s)


def _widths(role: str, s: StackSpec) -> list[Problem]:
    if not s.hierarchical:
        return [
            Problem(
                f"{role}.{key}",
                f"{key} is about the stages of a hierarchical stack, and depth is one number",
                f"give depth per stage, e.g. depth: [2, 2, 2, 2], or remove {key}",
            )
            for key in ("widths", "downsample")
            if getattr(s, key) is not None
        ]
    if s.widths is None:
        return []
    if len(s.widths) != len(s.stage_depths):
        why = f"{len(s.widths)} widths, but depth has {len(s.stage_depths)} stages"
        return [Problem(f"{role}.widths", why, "give one width per stage")]
    if s.widths[0] != s.width:
        why = f"the first stage is {s.widths[0]} wide and width is {s.width}"
        return [Problem(f"{role}.widths.0", why, f"set width: {s.widths[0]}, the first stage's width")]
    return []


def _downsample(role: str, s: StackSpec) -> list[Problem]:
    """The layers into each stage fit the previous stage's map and leave the stage's width."""
    at, grids = f"{role}.downsample", s.stage_grids
    if s.downsample is None or not grids:
        return []
    if s.merge_norm != "pre":  # the default, which a canonical spec writes out
        why = "merge_norm places the norm of patch merging, and downsample replaces patch merging"
        return [Problem(f"{role}.merge_norm", why, "remove merge_norm")]
    widths = s.stage_widths
    for i in range(1, len(widths)):
        problems = map_ops_problems(at, s.stage_ops(i), widths[i - 1], grids[i - 1])
        if problems:
            return [Problem(p.path, f"into stage {i}: {p.message}", p.hint) for p in problems]
        channels = map_out(s.stage_ops(i), widths[i - 1], grids[i - 1])[0]
        if channels != widths[i]:
            return [
                Problem(
                    at,
                    f"the layers into stage {i} leave {channels} channels, and the stage is {widths[i]} wide",
                    "leave the channels of the downsample's conv out: it leads to each stage's width",
                )
            ]
    return []


def _key(role: str, s: StackSpec, i: int, key: str) -> str:
    """The key path that sets block ``key`` for layer ``i``: the last override or variant writing it, else the
    base block's."""
    at = f"{role}.block.{key}"
    name = s.pattern()[i]
    if name in s.blocks and key in s.blocks[name].model_fields_set:
        at = f"{role}.blocks.{name}.{key}"
    for k, o in enumerate(s.overrides):
        if i in o.indexes(s.stage_depths) and key in o.block.model_fields_set:
            at = f"{role}.overrides.{k}.block.{key}"
    return at


def _reduction(role: str, s: StackSpec) -> list[Problem]:
    """A spatial reduction needs the whole token grid of each stage, and self-attention that is not causal."""
    stage_of = [si for si, d in enumerate(s.stage_depths) for _ in range(d)]
    grids = s.stage_grids
    for i, b in enumerate(s.layer_blocks):
        r = b.spatial_reduction
        if isinstance(r, list) and len(r) != len(s.stage_depths):
            why = f"{len(r)} stages of spatial_reduction, but depth has {len(s.stage_depths)}"
            return [
                Problem(
                    _key(role, s, i, "spatial_reduction"),
                    why,
                    "give one ratio per stage, or one number for all",
                )
            ]
        r = per_stage_value(r, stage_of[i])
        if r == 1:
            continue
        at = _key(role, s, i, "spatial_reduction")  # found only where needed: each call walks the depth
        why, fix = "", "remove spatial_reduction"
        if not grids:
            why = f"a spatial reduction reduces the token grid of an image stack, and the {role} reads {s.input.kind}"
            fix = "use an image input, or remove spatial_reduction"
        elif s.num_prefix and s.prefix_at and i >= s.prefix_at:  # entering late (PVT v1's last stage)
            why = f"block {i} sees the prefix tokens, which are off the grid the keys and values are reduced from"
            fix = f"use a ratio of 1 in the blocks from {s.prefix_at} on"
        elif (s.num_prefix and i >= s.prefix_at) or s.masking is not None:
            why = "prefix tokens and masking leave tokens off the grid the keys and values are reduced from"
            fix = "remove the class and register tokens (classify with pool: mean) and masking"
        elif r > min(grids[stage_of[i]]):
            (gh, gw), stage = grids[stage_of[i]], stage_of[i]
            why, fix = (
                f"a {r}x{r} reduction does not fit stage {stage}'s {gh}x{gw} grid",
                f"use at most {min(gh, gw)}",
            )
        else:
            why, fix = _reduction_block(b, s)
        if why:
            return [Problem(at, why, fix)]
    return []


def _reduction_block(b: BlockSpec, s: StackSpec) -> tuple[str, str]:
    """What a block with a spatial reduction does not combine with: (why, fix), or empty."""
    for key in ("window", "gated_positions", "sliding_window"):
        if getattr(b, key) not in (None, False):
            return (
                f"a spatial reduction attends to the whole grid reduced, and {key} limits it",
                f"remove {key}",
            )
    if "masked_self_attention" in b.sublayers:
        return "a causal self-attention has no grid to reduce its keys over", "use self_attention"
    for p in s.positions:
        if p.phase() == "attention":
            why = f"{p.kind} positions act on keys of the full grid, and the reduction leaves others"
            return why, "use position: none, learned or sincos2d"
    return "", ""


def _dwconv(role: str, s: StackSpec) -> list[Problem]:
    """The Mix-FFN's depthwise conv runs over the token grid, between fc1 and the activation of a plain MLP."""
    for i, b in enumerate(s.layer_blocks):
        mlp = b.mlp
        if not mlp.dwconv:
            continue
        why, fix = "", "set dwconv: false"
        if not s.stage_grids:
            why = f"a depthwise conv runs over the token grid of an image stack, and the {role} reads {s.input.kind}"
        elif (s.num_prefix and i >= s.prefix_at) or s.masking is not None:
            why = "prefix tokens and masking leave tokens off the grid the depthwise conv runs over"
            fix = "remove the class and register tokens (classify with pool: mean) and masking"
        elif mlp.moe is not None:
            why, fix = "a mixture of experts has no depthwise conv in its experts", "remove moe, or dwconv"
        elif mlp.activation in ("swiglu", "geglu", "geglu_tanh"):
            why = (
                f"the depthwise conv sits before the activation of a plain MLP, and {mlp.activation} is gated"
            )
            fix = "use a plain activation such as gelu, or set dwconv: false"
        if why:
            return [Problem(_key(role, s, i, "mlp") + ".dwconv", why, fix)]
    return []


def _late_prefix(role: str, s: StackSpec) -> list[Problem]:
    """The blocks of a hierarchical stack that see prefix tokens entering late attend over more than a grid."""
    if not (s.hierarchical and s.num_prefix and s.prefix_at):
        return []
    for i, b in enumerate(s.layer_blocks[s.prefix_at :], start=s.prefix_at):
        if b.window is not None:
            why = f"block {i} sees the prefix tokens, and its windows cut a grid without them"
            return [
                Problem(
                    _key(role, s, i, "window"), why, f"remove window from the blocks from {s.prefix_at} on"
                )
            ]
    return []


def _block_position(role: str, s: StackSpec) -> list[Problem]:
    """A block's own table has a row per token entering it: the stack's input fixes their number, unmasked."""
    for i, b in enumerate(s.layer_blocks):
        if b.absolute_position is None:
            continue
        why, fix = "", "remove absolute_position from the block"
        if s.num_tokens is None:
            why = f"a block's learned table has one row per token, and the {role}'s {s.input.kind} have no fixed count"
            fix = "use the stack's position: {kind: learned, max_len: ...}, or an image input"
        elif s.masking is not None:
            why = "masking keeps a random set of the patches, so a row of a block's table names no patch"
        if why:
            return [Problem(_key(role, s, i, "absolute_position"), why, fix)]
    return []
