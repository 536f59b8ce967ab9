"""The block language: one residual block, its variants along the depth, and the escape-hatch block graph.

A stack has one base ``block:``. Blocks that differ along the depth are written as named variants under
``blocks:`` (each a partial block merged over the base), ordered by a repeating ``schedule:``, and patched
per layer index by ``overrides:``; :meth:`~specvit.spec.schema.StackSpec.layer` resolves the block of
every layer once. A block is built by a residual pattern (``norm.placement`` and ``parallel``) or written
out as a small ``graph:`` of registered ops.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional

import annotated_types
from pydantic import Field, SerializerFunctionWrapHandler, create_model, model_serializer

from specvit.ops import SUBLAYERS
from specvit.ops.base import MAX_DEPTH, MAX_HEADS, MAX_LEN, MAX_WIDTH, Fragment
from specvit.ops.fields import per_stage
from specvit.ops.mlp import ACTIVATIONS
from specvit.ops.norm import NORM_KINDS

__all__ = [
    "GRAPH_OPS",
    "BlockOverride",
    "BlockSpec",
    "GlobalTokensSpec",
    "GraphNodeSpec",
    "LayerOverride",
    "MlpSpec",
    "MoeSpec",
    "NormSpec",
    "WindowSpec",
    "merge_block",
    "resolve_mlp",
]

Node = Fragment

if TYPE_CHECKING:
    SublayerKind = str
    NormKind = str
    Activation = str
    GraphOp = str
else:
    SublayerKind = Literal[tuple(SUBLAYERS)]
    NormKind = Literal[NORM_KINDS]
    Activation = Literal[ACTIVATIONS]

GRAPH_OPS = (*SUBLAYERS, "norm", "add", "layer_scale", "drop_path")
"""The ops a block ``graph:`` may use: every sublayer, the block's norm, residual adds, layer scale and
stochastic depth."""
if not TYPE_CHECKING:
    GraphOp = Literal[GRAPH_OPS]


class NormSpec(Node):
    """The normalisation of a block, and where it sits on the residual path."""

    kind: NormKind = Field("layernorm", description="Norm layer.")
    placement: Literal["pre", "post", "sandwich", "res_post"] = Field(
        "pre",
        description="pre: x + f(norm(x)) (ViT, GPT-2). post: norm(x + f(x)) (original Transformer, BERT). "
        "sandwich: x + norm(f(norm(x))) (Gemma 2, CogView). res_post: x + norm(f(x)) (Swin-V2).",
    )
    eps: float = Field(1e-6, gt=0.0, lt=1.0, description="Epsilon added to the variance.")
    bias: bool = Field(True, description="LayerNorm has a bias (rmsnorm never has one).")
    affine: bool = Field(
        True, description="A learned weight (and bias); false: the norm has no parameters (OLMo's LayerNorm)."
    )
    unit_offset: bool = Field(
        False,
        description="The learned weight w scales by 1 + w and starts at 0 (Gemma's RMSNorm, Nemotron's "
        "LayerNorm1P); the state dict holds w.",
    )


class MoeSpec(Node):
    """A mixture of experts in place of one MLP: a router picks top_k of the experts for each token."""

    experts: int = Field(
        ge=2, le=1024, description="Expert MLPs, each of the mlp's hidden size and activation."
    )
    top_k: int = Field(2, ge=1, le=64, description="Experts each token runs (Mixtral: 2).")
    normalize: bool = Field(
        True,
        description="The top_k routing weights rescaled to sum to 1 (Mixtral); false: the softmax "
        "probabilities as they are (Qwen2-MoE's norm_topk_prob: false).",
    )
    shared_hidden: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH * 64,
        description="Hidden size of a shared expert every token also runs, added to the routed ones "
        "(Qwen2-MoE); null: none.",
    )
    shared_gate: bool = Field(
        False,
        description="The shared expert's output scaled by sigmoid(a learned linear of the token) (Qwen2-MoE).",
    )


class BlockRopeSpec(Node):
    """A block's own rotary positions, where they differ from the stack's ``position: rope``."""

    base: float = Field(
        gt=1.0,
        le=1e12,
        description="Theta of this block's rotary tables (Gemma 3's local layers: 10000 beside the global "
        "layers' 1000000); the stack's rope gives the other settings.",
    )


class MlpSpec(Node):
    """The position-wise feed-forward sublayer."""

    ratio: float | None = Field(
        None,
        gt=0.0,
        le=64.0,
        description="Hidden size as a multiple of the width; default 4 when hidden is null.",
    )
    hidden: int | None = Field(None, ge=1, le=MAX_WIDTH * 64, description="Hidden size; overrides ratio.")
    activation: Activation = Field(
        "gelu",
        description="gelu (exact), gelu_tanh (GPT-2), quick_gelu (CLIP), relu, silu, or the gated "
        "swiglu / geglu / geglu_tanh (T5 v1.1).",
    )
    bias: bool = Field(True, description="Biases in the MLP's linear layers.")
    norm: bool = Field(
        False,
        description="A norm of the block's kind (and eps) on the hidden activations, before the second "
        "linear layer (NormFormer; EVA-02's scale_mlp).",
    )
    dwconv: bool = Field(
        False,
        description="A depthwise 3x3 conv (with a bias) over the hidden activations as a map of the token grid, "
        "between the first linear layer and the activation (PVT v2's and SegFormer's Mix-FFN).",
    )
    moe: MoeSpec | None = Field(
        None,
        description="A mixture of experts (Mixtral, Qwen2-MoE): the model's output gains router_loss, the "
        "load-balancing loss over every MoE layer, to add to the training loss times a coefficient; FLOPs "
        "count the active experts. null: one MLP.",
    )


_WindowSide = Annotated[int, Field(ge=0, le=256)]


class WindowSpec(Node):
    """Attention within non-overlapping M x M windows of the patch grid: Swin's (shifted, with a learned
    relative position bias table, or Swin-V2's continuous position bias MLP and cosine attention) or
    ViTDet's (padded, no bias table)."""

    size: int = Field(
        ge=1, le=256, description="Window side M in tokens; a stage smaller than M uses its whole grid."
    )
    shift: bool = Field(
        True, description="Every second block shifts the windows by M/2 (cyclic shift and mask)."
    )
    bias: bool | Literal["cpb"] = Field(
        True,
        description="The relative position bias of each block: true, a learned ((2M-1)^2, heads) table "
        "(Swin); cpb, Swin-V2's continuous position bias, an MLP 2 -> cpb_hidden -> heads over log-spaced "
        "relative coordinates, 16 * sigmoid of its output; false: none (ViTDet, SAM: their positions are "
        "position: relative_decomposed).",
    )
    pad: bool = Field(
        False,
        description="Pad the grid at the bottom and right to a multiple of M with zeros (after the norm; "
        "attended to), attend, crop (ViTDet, SAM); false: the grid divides into windows and a grid smaller "
        "than M is one window (Swin). Needs bias: false and shift: false.",
    )
    cosine: bool = Field(
        False,
        description="Cosine attention (Swin-V2): cos(q, k) times a learned per-head scale, "
        "exp(min(logit_scale, log 100)), instead of q·k / sqrt(head_dim).",
    )
    cpb_hidden: int | None = Field(
        None, ge=1, le=4096, description="Hidden width of the cpb MLP (bias: cpb); null = 512 (Swin-V2)."
    )
    pretrained: _WindowSide | list[_WindowSide] | None = Field(
        None,
        description="bias: cpb only: the window side the MLP's coordinates are normalised by (Swin-V2's "
        "pretrained_window_sizes, for a model fine-tuned at a larger window): one for all stages or one "
        "per stage, 0 = the stage's window; null = every stage's window.",
    )


class GlobalTokensSpec(Node):
    """Global tokens beside a sliding window (Longformer): every token attends to them beside its window, and
    they attend to every token."""

    first: int | None = Field(
        None,
        ge=1,
        le=MAX_LEN,
        description="The first `first` tokens of every sample are global (a class token: 1); null: the model's "
        "forward takes global_attention_mask (src_global_attention_mask in an encoder_decoder), (B, S) bool "
        "with True = global, a keyword argument that may differ per sample (Longformer's); without it no "
        "token is global.",
    )
    projections: bool = Field(
        True,
        description="The global tokens' rows are computed again with query, key and value projections of "
        "their own, over every token (Longformer's query_global, key_global, value_global; the state dict's "
        "attn.qkv_global); the other rows see the global tokens through the layer's keys and values. false: "
        "the layer's projections for every row.",
    )


class GraphNodeSpec(Node):
    """One node of a block written as a graph: a registered op reading earlier nodes by name."""

    name: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        max_length=64,
        description="The node's name, also its module's name in the block (``attn``, ``norm1``).",
    )
    op: GraphOp = Field(
        description="The op: a sublayer kind, norm (the block's), add, layer_scale (initialised to the "
        "block's layer_scale, 1 if unset) or drop_path (the stack's rate)."
    )
    inputs: list[str] = Field(
        min_length=1,
        max_length=8,
        description="Names of the nodes it reads, in order; ``x`` is the block's input. add sums them all.",
    )


class BlockSpec(Node):
    """One residual block (the base of a stack, repeated `depth` times unless a schedule varies it)."""

    heads: per_stage(MAX_HEADS, "Attention (query) heads; a list gives each stage's heads.")  # type: ignore[valid-type]
    kv_heads: int | None = Field(
        None,
        ge=1,
        le=MAX_HEADS,
        description="Key/value heads: fewer than heads for GQA, 1 for MQA; null = heads.",
    )
    head_dim: int | None = Field(None, ge=1, le=4096, description="Dim per head; null = width / heads.")
    layers: list[SublayerKind] = Field(
        default_factory=lambda: ["self_attention", "mlp"],
        min_length=1,
        max_length=16,
        description="The residual sublayers in order.",
    )
    norm: NormSpec = Field(default_factory=NormSpec, description="Norm kind, placement and eps.")
    parallel: bool = Field(
        False,
        description="The sublayers read the same input and their sum is added once: "
        "x + attn(norm1(x)) + mlp(norm2(x)) (GPT-J, GPT-NeoX, PaLM).",
    )
    mlp: MlpSpec = Field(default_factory=MlpSpec, description="The feed-forward sublayer.")
    qkv_bias: bool | list[bool] = Field(
        True,
        description="Biases in the query/key/value projections: one for all, or [q, k, v] "
        "(BEiT, Whisper: [true, false, true]).",
    )
    proj_bias: bool = Field(True, description="Bias in the attention output projection.")
    qk_norm: bool | Literal["head", "all"] = Field(
        False,
        description="Normalise queries and keys with a norm like the block's: true or head: each head over "
        "its head_dim channels (ViT-22B, Qwen3); all: a token's heads over all their channels at once "
        "(OLMo 2).",
    )
    qk_norm_after_rope: bool = Field(
        False,
        description="The QK-norm normalises the rotated queries and keys (HunYuan); false: it comes before "
        "RoPE (Qwen3, OLMo 2).",
    )
    attention_scale: float | None = Field(
        None, gt=0.0, le=100.0, description="Scale of q·k; null = 1/sqrt(head_dim). T5 uses 1."
    )
    attention_softcap: float | None = Field(
        None,
        gt=0.0,
        le=1000.0,
        description="Soft-cap the attention logits before the masks: softcap * tanh(logits / softcap) "
        "(Gemma 2: 50). Runs the math path, not fused SDPA; null = none.",
    )
    sliding_window: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="Each token attends to itself and the sliding_window - 1 tokens before it (Mistral); in "
        "a block without a causal mask (an encoder's self_attention) the window is symmetric: the tokens less "
        "than sliding_window positions away on either side.",
    )
    global_tokens: GlobalTokensSpec | None = Field(
        None,
        description="Tokens every token's self_attention sees beside its sliding_window, and that see every "
        "token (Longformer: {}; its attention_window w is sliding_window: w / 2 + 1); an encoder's, not in "
        "a causal stack. null: none.",
    )
    talking_heads: bool = Field(
        False,
        description="Self-attention scores mixed across heads by learned heads x heads maps before and after "
        "the softmax (CaiT; Shazeer et al. 2020). Runs the math path, not fused SDPA.",
    )
    gated_positions: bool = Field(
        False,
        description="ConViT's gated positional self-attention: the attention weights mixed with a softmax of "
        "each head's linear map of the query-key offset on the patch grid (dx, dy, dx² + dy²) by a learned "
        "per-head gate, then renormalised. Needs the patch grid without prefix tokens (ConViT's local "
        "blocks, before prefix.at). Runs the math path.",
    )
    spatial_reduction: per_stage(  # type: ignore[valid-type]
        64,
        "PVT's spatial reduction ratio r of the self-attention, one or one per stage: keys and values come from "
        "the token grid through an r x r conv of stride r and a LayerNorm (of the block norm's eps), queries "
        "from every token; 1 = none.",
    ) = 1
    absolute_position: Literal["learned"] | None = Field(
        None,
        description="learned: a learned absolute position table of the tokens entering the block (its grid "
        "and the prefix tokens then present, at its width), added before its first sublayer and followed by "
        "the stack's embedding dropout (PVT v1's table per stage: on each stage's first block); null: none.",
    )
    layer_scale: float | None = Field(
        None, gt=0.0, le=10.0, description="LayerScale init value (CaiT, DINOv2), or null for none."
    )
    window: WindowSpec | None = Field(
        None, description="Windowed self-attention (Swin's or ViTDet's), or null for global attention."
    )
    memory_norm: bool = Field(
        False, description="A norm on the memory before each cross-attention (CroCo's norm_y)."
    )
    rope: BlockRopeSpec | Literal[False] | None = Field(
        None,
        description="This block's rotary positions where they differ from the stack's rope: {base: theta} "
        "(Gemma 3's local layers), or false for none (NoPE layers: SmolLM3, Cohere 2); null = the stack's.",
    )
    cross_attention_heads: int | None = Field(
        None,
        ge=1,
        le=MAX_HEADS,
        description="Heads of the block's cross_attention (each width / cross_attention_heads wide unless head_dim "
        "is set); null = heads. Perceiver's cross-attend has 1.",
    )
    cross_attention_head_dim: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Width per head of the block's cross_attention (its queries, keys and values); null = "
        "head_dim, or width / cross_attention_heads when those are set. Perceiver's cross-attend uses its "
        "input's width.",
    )
    graph: list[GraphNodeSpec] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="The block written as a graph of ops; replaces layers, placement and parallel.",
    )

    def bias_of(self, which: str) -> bool:
        """Whether the ``q``, ``k`` or ``v`` projection has a bias."""
        if isinstance(self.qkv_bias, bool):
            return self.qkv_bias
        return self.qkv_bias["qkv".index(which)]

    @property
    def sublayers(self) -> list[str]:
        """The sublayer kinds the block runs, in order (from its graph when it has one)."""
        if self.graph is not None:
            return [n.op for n in self.graph if n.op in SUBLAYERS]
        return list(self.layers)


# --------------------------------------------------------------------------------- variants and overrides

_STACK_WIDE = ("heads", "kv_heads", "head_dim")  # one per stack: the KV cache and positions depend on them


class _Partial(Node):
    """A partial block: it writes back (``to_yaml``) only the keys it sets, so a canonical spec reloads
    to the same variant instead of one that sets every key to null."""

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if k in self.model_fields_set}


@cache
def _partial(model: type[Node]) -> type[Node]:
    """``model`` with every field optional and unset by default (nested blocks partial too)."""
    fields: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        if model is BlockSpec and name in _STACK_WIDE:
            continue
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, Node):
            ann = _partial(ann)
        # the field's constraints (ge, le, max_length) hold in a partial block too: a variant's
        # sliding_window: 0 is refused at its own line, not when the block is merged
        bounds = [m for m in f.metadata if isinstance(m, annotated_types.BaseMetadata)]  # not discriminators
        optional: Any = Optional[ann]  # noqa: UP045
        constrained = Annotated[(optional, *bounds)] if bounds else optional
        fields[name] = (constrained, Field(None, description=f.description))
    doc = f"Any keys of {model.__name__}; those given replace the base block's."
    return create_model(f"Partial{model.__name__}", __base__=_Partial, __doc__=doc, **fields)


if TYPE_CHECKING:  # assembled at import; type checkers see the base
    BlockOverride = Node
else:
    BlockOverride = _partial(BlockSpec)
    """A partial block: the keys a variant or override changes (heads, kv_heads and head_dim are the stack's)."""


class LayerOverride(Node):
    """Changes to the blocks at some layer indexes, or in some stages."""

    layers: list[int] | None = Field(
        None,
        min_length=1,
        max_length=MAX_DEPTH,
        description="Layer indexes from 0 over the whole stack; negative ones count from the end (-1 = last).",
    )
    stages: list[Annotated[int, Field(ge=0, le=7)]] | None = Field(
        None,
        min_length=1,
        max_length=8,
        description="Stage indexes from 0 of a hierarchical stack: every layer of those stages (PVT v2's "
        "per-stage MLP ratios); with layers, those layers too.",
    )
    block: BlockOverride = Field(description="The keys to change in those blocks.")

    def indexes(self, stage_depths: list[int]) -> set[int]:
        """The layer indexes (from 0 over the stack) it changes, given the stack's stage depths."""
        depth, starts = sum(stage_depths), [sum(stage_depths[:i]) for i in range(len(stage_depths))]
        out = {k % depth for k in self.layers or []} if depth else set()
        for st in self.stages or []:
            out |= set(range(starts[st], starts[st] + stage_depths[st])) if st < len(starts) else set()
        return out


def _deep(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in change.items():
        out[k] = _deep(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def merge_block(base: BlockSpec, *changes: Node) -> BlockSpec:
    """``base`` with the keys set in each partial block of ``changes`` replaced, in order.

    Args:
        base: the stack's base block.
        changes: partial blocks (:data:`BlockOverride`).
    """
    data = base.model_dump()
    for change in changes:
        delta = change.model_dump(exclude_unset=True)
        mlp = delta.get("mlp") or {}
        if "ratio" in mlp or "hidden" in mlp:  # a new size replaces the base's resolved one
            data["mlp"] = {**data["mlp"], "ratio": None, "hidden": None}
        if "layers" in delta and "graph" not in delta:  # new layers: the base's graph no longer applies
            data["graph"] = None
        data = _deep(data, delta)
    return BlockSpec.model_validate(data)


def resolve_mlp(block: BlockSpec, width: int) -> None:
    """Store the MLP hidden size resolved (``ratio * width``, default ratio 4), so a spec carries one number."""
    mlp = block.mlp
    if mlp.hidden is None:
        mlp.hidden = int((mlp.ratio if mlp.ratio is not None else 4.0) * width)
        mlp.ratio = None
