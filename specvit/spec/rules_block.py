"""Cross-field rules of the blocks along a stack's depth (schedule, variants, overrides, block graphs) and
of its position kinds."""

from __future__ import annotations

import keyword
from functools import partial

from specvit.errors import Problem
from specvit.ops.facts import unless_undetermined
from specvit.ops.inputs import divisors_near
from specvit.ops.vitdet import window_problems
from specvit.spec.block import BlockSpec, LayerOverride
from specvit.spec.schema import Spec, StackSpec

BLOCK_ATTRIBUTES = frozenset({"checkpointing"})
"""specvit's Block's own attributes, beside those of every nn.Module."""


def reserved(name: str) -> bool:
    """Whether a block-graph node may not be called ``name``: each node is an attribute of the generated block
    (an nn.Module) and a name in its generated forward. Read from nn.Module when asked, since libraries add
    methods to it (transformers' ``smart_apply``); torch is imported only for a spec with a block graph.

    Args:
        name: the node's name.
    """
    from torch import nn

    return keyword.iskeyword(name) or name in BLOCK_ATTRIBUTES or hasattr(nn.Module(), name)


__all__ = ["check_layers", "check_positions"]


def _schedule(role: str, s: StackSpec) -> list[Problem]:
    out: list[Problem] = []
    known = ["block", *s.blocks]
    used: set[str] = set()
    for i, item in enumerate(s.schedule or []):
        for name in item if isinstance(item, dict) else [item]:
            used.add(name)
            if name not in known:
                out.append(
                    Problem(
                        f"{role}.schedule.{i}",
                        f"there is no block named {name!r}",
                        f"use one of {', '.join(known)}, or add {name}: under {role}.blocks",
                    )
                )
    for name in s.blocks:
        if name == "block":
            out.append(Problem(f"{role}.blocks.block", "'block' names the base block", "rename the variant"))
        elif name not in used:
            out.append(
                Problem(
                    f"{role}.blocks.{name}",
                    f"block {name!r} is never used",
                    f"name it in {role}.schedule, e.g. schedule: [block, {name}]",
                )
            )
    depth = s.total_depth
    for k, o in enumerate(s.overrides):
        out += _override_stages(f"{role}.overrides.{k}", o, s)
        for j, index in enumerate(o.layers or []):
            if not -depth <= index < depth:
                out.append(
                    Problem(
                        f"{role}.overrides.{k}.layers.{j}",
                        f"layer {index} does not exist: the stack has {depth}",
                        f"use 0 .. {depth - 1}, or -{depth} .. -1 from the end",
                    )
                )
    return out


def _override_stages(at: str, o: LayerOverride, s: StackSpec) -> list[Problem]:
    """An override names layers or stages, and stages that exist."""
    if o.layers is None and o.stages is None:
        return [Problem(at, "an override names no layers", "give layers: [0, 1] or stages: [2, 3]")]
    n = len(s.stage_depths)
    return [
        Problem(
            f"{at}.stages.{j}",
            f"stage {st} does not exist: the stack has {n}"
            + ("" if s.hierarchical else " (depth is one number)"),
            f"use 0 .. {n - 1}" if n > 1 else "give depth per stage, or use layers",
        )
        for j, st in enumerate(o.stages or [])
        if st >= n
    ]


def _origins(role: str, s: StackSpec) -> dict[int, tuple[BlockSpec, str]]:
    """Each distinct block of the stack, with the key path it was written at (for messages)."""
    out: dict[int, tuple[BlockSpec, str]] = {id(s.block): (s.block, f"{role}.block")}
    pattern, depth = s.pattern(), s.total_depth
    for i in range(depth):
        block = s.layer(i)
        if id(block) in out:
            continue
        at = f"{role}.blocks.{pattern[i]}"
        for k, o in enumerate(s.overrides):
            if i in o.indexes(s.stage_depths):
                at = f"{role}.overrides.{k}.block"
        out[id(block)] = (block, at)
    return out


def check_layers(role: str, s: StackSpec, spec: Spec) -> list[Problem]:
    """Problems of the blocks along the stack: the schedule, and every distinct block once."""
    out = _schedule(role, s)
    if out:
        return out
    for block, at in _origins(role, s).values():
        out += _block(role, at, block, spec) + _moe(at, block, s)
    out += _one_routing(role, s, spec) + _gated(role, s)
    reads = any("cross_attention" in b.sublayers for b in s.layer_blocks)
    reads = reads or getattr(s.input, "reads_encoder", False)  # an input made of the encoder's tokens (MAE)
    if spec.model == "encoder_decoder" and role == "decoder" and not reads:
        out.append(
            Problem(
                f"{role}.block.layers",
                "the decoder never reads the encoder",
                "add cross_attention to the decoder's layers",
            )
        )
    return out


def _gated(role: str, s: StackSpec) -> list[Problem]:
    """ConViT's gated positions read the patch grid: a plain image stack's, in blocks without prefix tokens
    or windows."""
    origins = _origins(role, s)
    for i in range(s.total_depth):
        b = s.layer(i)
        if not b.gated_positions:
            continue
        at = f"{origins[id(b)][1]}.gated_positions"
        if s.input.kind != "image" or s.hierarchical:
            return [
                Problem(at, "gated positions are over the patch grid of a plain image stack", "remove it")
            ]
        if s.num_prefix and i >= s.prefix_at:
            return [
                Problem(
                    at,
                    f"layer {i} sees the prefix tokens, and gated positions are over the patch grid alone",
                    f"set prefix.at above {i} (ConViT adds its class token after the gated blocks)",
                )
            ]
        if b.window is not None or "self_attention" not in b.sublayers:
            return [Problem(at, "gated positions change a global self_attention", "remove window, or it")]
    return []


def _block(role: str, at: str, b: BlockSpec, spec: Spec) -> list[Problem]:
    out: list[Problem] = []
    if b.graph is not None:
        out += _graph(at, b)
    for i, layer in enumerate(b.sublayers):
        path = f"{at}.graph.{i}.op" if b.graph is not None else f"{at}.layers.{i}"
        if layer == "cross_attention" and not (role == "decoder" and spec.model == "encoder_decoder"):
            out.append(
                Problem(
                    path,
                    "cross_attention needs an encoder to attend to",
                    "cross_attention belongs in the decoder of an encoder_decoder model",
                )
            )
        if layer == "sagan_attention" and spec.stacks[role].input.kind != "feature_map":
            out.append(
                Problem(
                    path,
                    "sagan_attention attends among the positions of a (B, C, H, W) feature map",
                    "use it in a stack with input: {kind: feature_map, channels: C, size: [H, W]}",
                )
            )
        if layer == "sagan_attention" and b.attention_softcap is not None:
            out.append(
                Problem(
                    f"{at}.attention_softcap",
                    "sagan_attention has no soft-capping (SAGAN's configuration of the attention core: q·k as it is)",
                    "remove attention_softcap, or use self_attention",
                )
            )
        if layer == "self_attention" and spec.model == "decoder":
            out.append(
                Problem(
                    path,
                    "a decoder-only model with self_attention sees future tokens",
                    "use masked_self_attention",
                )
            )
    out += window_problems(at, b)
    if b.memory_norm and "cross_attention" not in b.sublayers:
        out.append(
            Problem(
                f"{at}.memory_norm",
                "memory_norm normalises the memory of a cross_attention, and the block has none",
                "remove memory_norm, or add cross_attention to the layers",
            )
        )
    out += _qk_order(at, b) + _cross_attention_heads(role, at, b, spec)
    out += _global_tokens(role, at, b, spec)
    out += _parameters(at, b)
    if b.parallel and (b.norm.placement != "pre" or b.graph is not None):
        out.append(
            Problem(
                f"{at}.parallel",
                f"parallel sublayers are pre-norm: x + attn(norm1(x)) + mlp(norm2(x)), not {b.norm.placement}"
                if b.graph is None
                else "a block graph states the data flow itself",
                "set norm.placement: pre" if b.graph is None else "remove parallel",
            )
        )
    if b.rope is not None and not any(p.kind == "rope" for p in spec.stacks[role].positions):
        out.append(
            Problem(
                f"{at}.rope",
                "rope changes the stack's rotary positions for this block, and the stack has none",
                f"add rope to {role}.position, or remove rope",
            )
        )
    if b.sliding_window is not None and b.window is not None:
        out.append(
            Problem(
                f"{at}.sliding_window",
                "a block has 1D sliding-window attention or 2D windows (window), not both",
                "remove one of sliding_window and window",
            )
        )
    return out


def _global_tokens(role: str, at: str, b: BlockSpec, spec: Spec) -> list[Problem]:
    """Longformer's global tokens: beside a sliding window, in an encoder's self_attention, marked among the
    tokens the blocks see."""
    g, s, key = b.global_tokens, spec.stacks[role], f"{at}.global_tokens"
    if g is None:
        return []
    if s.causal:
        what = "global tokens attend to every token, later ones too, and this stack is causal (a KV cache)"
        return [Problem(key, what, "use global_tokens in an encoder's self_attention")]
    if "self_attention" not in b.sublayers:
        what = "global_tokens change a self_attention, and the block has none"
        return [Problem(key, what, "add self_attention to the layers, or remove global_tokens")]
    if b.sliding_window is None:
        what = "global tokens are seen beside a sliding window, and the block has none"
        fix = "set sliding_window (Longformer's attention_window w: sliding_window w / 2 + 1), or remove global_tokens"
        return [Problem(key, what, fix)]
    if g.first is None and (s.num_prefix or s.masking is not None):
        what = (
            f"{'prefix tokens join' if s.num_prefix else 'masking drops some of'} the tokens the mask marks"
        )
        return [Problem(f"{key}.first", what, "make the first K tokens global with first: K")]
    if g.projections and (b.gated_positions or any(p.kind == "disentangled" for p in s.positions)):
        what = "the global rows' own projections take no gated positions or disentangled scores"
        return [Problem(f"{key}.projections", what, "set projections: false")]
    return []


def _parameters(at: str, b: BlockSpec) -> list[Problem]:
    """The q/k/v biases and the norm's weight."""
    out: list[Problem] = []
    if isinstance(b.qkv_bias, list) and len(b.qkv_bias) != 3:
        out.append(
            Problem(
                f"{at}.qkv_bias",
                f"qkv_bias lists the biases of q, k and v: 3 values, got {len(b.qkv_bias)}",
                "write [true, false, true] for q and v biases without a k bias",
            )
        )
    if b.norm.unit_offset and not b.norm.affine:
        out.append(
            Problem(
                f"{at}.norm.unit_offset",
                "unit_offset scales by 1 + w, and with affine: false the norm has no weight w",
                "remove unit_offset, or set affine: true",
            )
        )
    return out


def _qk_order(at: str, b: BlockSpec) -> list[Problem]:
    """qk_norm_after_rope places a QK-norm, which the block must have."""
    if b.qk_norm_after_rope and not b.qk_norm:
        return [
            Problem(
                f"{at}.qk_norm_after_rope", "the block has no qk_norm to place", "set qk_norm, or remove this"
            )
        ]
    return []


def _moe(at: str, b: BlockSpec, s: StackSpec) -> list[Problem]:
    """A mixture of experts: what its experts have and lack."""
    moe, mlp, key = b.mlp.moe, b.mlp, f"{at}.mlp"
    if moe is None or "mlp" not in b.sublayers:
        return []
    checks = [
        (
            moe.top_k <= moe.experts,
            f"{key}.moe.top_k",
            f"top_k {moe.top_k} is more than the {moe.experts} experts",
            f"use top_k <= {moe.experts}",
        ),
        (
            not moe.shared_gate or moe.shared_hidden is not None,
            f"{key}.moe.shared_gate",
            "shared_gate gates the shared expert, and there is none",
            "set shared_hidden, or remove shared_gate",
        ),
        (
            not mlp.bias,
            f"{key}.bias",
            "the experts have no biases (Mixtral, Qwen2-MoE)",
            "set mlp.bias: false",
        ),
        (not mlp.norm, f"{key}.norm", "the experts have no inner norm", "remove mlp.norm"),
        (
            mlp.activation != "xielu",
            f"{key}.activation",
            "xielu is learned per MLP, not per expert",
            "use silu",
        ),
        (s.dropout.mlp == 0, "dropout.mlp", "the experts have no dropout", "set dropout.mlp: 0"),
    ]
    return [Problem(where, what, fix) for ok, where, what, fix in checks if not ok]


def _one_routing(role: str, s: StackSpec, spec: Spec) -> list[Problem]:
    """Every MoE layer of the model routes among as many experts, as many per token: the load-balancing
    loss pools their statistics."""
    seen: dict[tuple[int, int], str] = {}
    for r, stack in spec.stacks.items():
        for block, at in _origins(r, stack).values():
            if block.mlp.moe is not None and "mlp" in block.sublayers:
                seen.setdefault((block.mlp.moe.experts, block.mlp.moe.top_k), f"{at}.mlp.moe")
        if r == role:
            break
    if len(seen) < 2:
        return []
    (first, where), (other, at) = list(seen.items())[:2]
    if not at.startswith(f"{role}."):  # reported with the stack it is in
        return []
    return [
        Problem(
            at,
            f"{other[0]} experts, top {other[1]} here, {first[0]}, top {first[1]} at {where}: the load-balancing "
            "loss pools every MoE layer's routing",
            "give every MoE layer the same experts and top_k",
        )
    ]


def _cross_attention_heads(role: str, at: str, b: BlockSpec, spec: Spec) -> list[Problem]:
    """The cross-attention's own heads need a cross_attention to shape, a width they divide, and a stack
    without a KV cache."""
    given = [k for k in ("cross_attention_heads", "cross_attention_head_dim") if getattr(b, k) is not None]
    if not given:
        return []
    s, key = spec.stacks[role], f"{at}.{given[0]}"
    if "cross_attention" not in b.sublayers:
        return [
            Problem(
                key,
                f"{given[0]} shapes the heads of a cross_attention, and the block has none",
                f"remove {given[0]}",
            )
        ]
    if s.causal:
        return [Problem(key, "a causal stack's KV cache needs one head layout", f"remove {given[0]}")]
    h = b.cross_attention_heads
    if h is not None and b.head_dim is None and b.cross_attention_head_dim is None and s.width % h:
        return [
            Problem(
                f"{at}.cross_attention_heads",
                f"width {s.width} is not divisible by {h} cross-attention heads",
                f"use a divisor of {s.width} such as {divisors_near(s.width, h)}, or set cross_attention_head_dim",
            )
        ]
    return []


def _graph(at: str, b: BlockSpec) -> list[Problem]:
    """A block graph reads only earlier nodes (or ``x``), uses every node, and ends in its output."""
    assert b.graph is not None
    out: list[Problem] = []
    seen: dict[str, int] = {"x": -1}
    read: set[str] = set()
    for i, node in enumerate(b.graph):
        if node.name in seen:
            out.append(Problem(f"{at}.graph.{i}.name", f"{node.name!r} is defined twice", "rename one"))
        elif reserved(node.name):  # the node is an attribute of the block's module, in generated code
            what = (
                "a Python keyword" if keyword.iskeyword(node.name) else "an attribute of every torch module"
            )
            out.append(
                Problem(f"{at}.graph.{i}.name", f"{node.name!r} is {what}", f"rename it, e.g. {node.name}_")
            )
        if (node.op == "add") != (len(node.inputs) > 1):
            out.append(
                Problem(
                    f"{at}.graph.{i}.inputs",
                    f"{node.op} reads {'two or more inputs' if node.op == 'add' else 'one input'}, "
                    f"got {len(node.inputs)}",
                    "list the inputs it sums" if node.op == "add" else "sum several inputs with an add node",
                )
            )
        for j, src in enumerate(node.inputs):
            read.add(src)
            if src not in seen:
                later = any(n.name == src for n in b.graph[i:])
                out.append(
                    Problem(
                        f"{at}.graph.{i}.inputs.{j}",
                        f"{src!r} is {'defined after this node' if later else 'not a node of the block'}",
                        "read x (the block's input) or a node above this one",
                    )
                )
        seen[node.name] = i
    for node in b.graph[:-1]:
        if node.name not in read:
            out.append(
                Problem(
                    f"{at}.graph.{seen[node.name]}.name",
                    f"{node.name!r} is computed but never read",
                    "read it in a later node, or remove it (the last node is the block's output)",
                )
            )
    return out


def check_positions(role: str, s: StackSpec, spec: Spec) -> list[Problem]:
    """Each position kind's own rules, and that combined kinds do not write the same thing twice."""
    out: list[Problem] = []
    many = isinstance(s.position, list)
    writes: dict[str, str] = {}
    for k, p in enumerate(s.positions):
        at = f"{role}.position.{k}" if many else f"{role}.position"
        out += unless_undetermined(partial(p.check, at, s, spec))
        what = p.writes()
        if not what:  # none
            if many:
                out.append(Problem(at, "none in a list of positions", "remove it"))
            continue
        if what in writes:
            out.append(
                Problem(
                    at,
                    f"{p.kind} and {writes[what]} both give the {_WHAT[what]}",
                    f"keep one of {writes[what]} and {p.kind}",
                )
            )
        writes[what] = p.kind
    return out


_WHAT = {
    "tokens": "positions added to the tokens",
    "rope": "rotary tables",
    "bias": "attention bias",
    "pos": "positions of the attention's queries and keys",
}
