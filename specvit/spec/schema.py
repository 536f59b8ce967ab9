"""The spec language: the Pydantic model of a whole spec, assembled from the registered op fragments.

Every model is strict (``12`` is a number, ``"12"`` is not; ``true`` is not a number) and forbids
unknown keys. The kinds of ``input``, ``position`` and ``head`` are the fragments registered in
:mod:`specvit.ops`, discriminated by their ``kind`` key, so an editor can complete them from the JSON
Schema; the names allowed in ``layers``, ``norm.kind`` and ``mlp.activation`` come from the same
registries. Values that follow from others (head dim, MLP hidden size, token counts, the init
convention) are resolved here, once, so everything downstream reads concrete numbers. Cross-field rules
live in :mod:`specvit.spec.rules` and in each fragment's ``check``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, PrivateAttr, Tag, model_validator

from specvit.errors import Location
from specvit.ops import SUBLAYERS, fragments
from specvit.ops.base import MAX_DEPTH, MAX_LEN, MAX_WIDTH, Fragment
from specvit.ops.conv import MapOps
from specvit.ops.facts import StackFacts, Undetermined, resolve
from specvit.ops.fields import Probability, per_stage, shortcut_union
from specvit.ops.heads import ClassifierHead, DetectionHead, HeadFragment, LMHead, NoHead, PatchesHead
from specvit.ops.inputs import (
    FeaturesInput,
    ImageInput,
    InputFragment,
    QueriesInput,
    SiameseInput,
    TokensInput,
)
from specvit.ops.masking import MaskingSpec
from specvit.ops.position import (
    LearnedPosition,
    NoPosition,
    PositionFragment,
    SinCos2dPosition,
    SinCosPosition,
    Sine2dPosition,
)
from specvit.ops.rope import RopePosition
from specvit.ops.rope2d import Rope2dPosition
from specvit.spec.block import (
    BlockOverride,
    BlockSpec,
    LayerOverride,
    MlpSpec,
    NormSpec,
    WindowSpec,
    merge_block,
    resolve_mlp,
)
from specvit.spec.stages import Stages
from specvit.spec.yamlread import dump_yaml

__all__ = [
    "FORMAT_VERSION",
    "MAX_DEPTH",
    "MAX_LEN",
    "BlockSpec",
    "ClassifierHead",
    "DetectionHead",
    "DropoutSpec",
    "FeaturesInput",
    "ImageInput",
    "LMHead",
    "LearnedPosition",
    "MaskingSpec",
    "MlpSpec",
    "NoHead",
    "NoPosition",
    "NormSpec",
    "PatchesHead",
    "PrefixSpec",
    "QueriesInput",
    "Rope2dPosition",
    "RopePosition",
    "ShareSpec",
    "SiameseInput",
    "SinCos2dPosition",
    "SinCosPosition",
    "Sine2dPosition",
    "Spec",
    "StackSpec",
    "TokensInput",
    "WindowSpec",
]

FORMAT_VERSION = 1

Node = Fragment  # the base of every spec model


def _kinds(slot: str) -> str:
    """``none, learned, sincos, ...``: the kinds of a slot, for descriptions."""
    return ", ".join(str(c.model_fields["kind"].annotation.__args__[0]) for c in fragments(slot))  # type: ignore[union-attr]


def _union(slot: str, shortcut: bool = False) -> Any:
    """The discriminated union of a slot's registered fragments (``position: learned`` too, if ``shortcut``)."""
    union = Annotated[Union[fragments(slot)], Field(discriminator="kind")]  # type: ignore[valid-type]  # noqa: UP007
    return shortcut_union(union, fragments(slot)) if shortcut else union


if TYPE_CHECKING:  # the unions are assembled at import; type checkers see their bases
    InputSpec = InputFragment
    PositionSpec = PositionFragment
    HeadSpec = HeadFragment
else:
    InputSpec = _union("input")
    PositionSpec = _union("position", shortcut=True)
    HeadSpec = _union("head", shortcut=True)
ModelKind = Literal["encoder", "decoder", "encoder_decoder"]


def _one_or_many(value: Any) -> str:
    return "many" if isinstance(value, list) else "one"


PositionField = Annotated[
    Annotated[PositionSpec, Tag("one")]
    | Annotated[list[PositionSpec], Tag("many"), Field(min_length=1, max_length=4)],
    Discriminator(_one_or_many),
]
ScheduleItem = (
    Annotated[str, Field(max_length=64)]
    | Annotated[
        dict[Annotated[str, Field(max_length=64)], Annotated[int, Field(ge=1, le=MAX_DEPTH)]],
        Field(min_length=1, max_length=1),
    ]
)


class PrefixSpec(Node):
    """Learned tokens put in front of the sequence."""

    cls: bool = Field(False, description="A learned class token, first in the sequence.")
    distillation: bool = Field(
        False,
        description="DeiT's learned distillation token, after the class token (read by a distilled head).",
    )
    registers: int = Field(
        0, ge=0, le=1024, description="Learned register tokens after the class (and distillation) token."
    )
    at: int | None = Field(
        None,
        ge=0,
        le=MAX_DEPTH,
        description="The block index (from 0 over the stack) before which the prefix tokens enter; null = "
        "before the first block. CaiT: the depth of its self-attention stage, so only its class-attention "
        "blocks see the class token.",
    )

    @property
    def count(self) -> int:
        return int(self.cls) + int(self.distillation) + self.registers


class ShareSpec(Node):
    """Blocks that share weights: the stack holds ``blocks`` sets of block weights, each applied to
    depth / blocks of its layers."""

    blocks: int = Field(
        ge=1,
        le=MAX_DEPTH,
        description="Sets of block weights, dividing the depth; 1 = one block applied depth times (ALBERT).",
    )
    order: Literal["grouped", "cycle"] = Field(
        "grouped",
        description="grouped: runs of consecutive layers share a set (layer i uses set i // (depth / blocks), "
        "ALBERT's groups); cycle: layer i uses set i % blocks.",
    )


class DropoutSpec(Node):
    """Dropout probabilities, all 0 by default."""

    embedding: Probability = Field(0.0, description="After the embeddings and positions.")
    attention: Probability = Field(0.0, description="On the attention weights.")
    projection: Probability = Field(0.0, description="After the attention output projection.")
    mlp: Probability = Field(0.0, description="Inside and after the MLP.")


class StackSpec(Node, Stages):
    """An encoder or decoder: input embedding, positions, `depth` blocks, final norm."""

    input: InputSpec = Field(
        description="What comes in: image patches, tokens, features, learned queries or (a decoder) siamese."
    )
    prefix: PrefixSpec = Field(
        default_factory=PrefixSpec, description="Class, distillation and register tokens."
    )
    position: PositionField = Field(
        description=f"Position encoding: {_kinds('position')}; a list combines kinds (learned + rope, EVA-02)."
    )
    width: int = Field(ge=1, le=MAX_WIDTH, description="Model width (embedding dim) of every token.")
    widths: list[Annotated[int, Field(ge=1, le=MAX_WIDTH)]] | None = Field(
        None,
        min_length=2,
        max_length=8,
        description="The width of each stage of a hierarchical stack, the first equal to width (PVT: [32, 64, "
        "160, 256]); null: width doubled per stage (Swin).",
    )
    depth: per_stage(  # type: ignore[valid-type]
        MAX_DEPTH,
        "Number of blocks; a list [2, 2, 6, 2] makes a hierarchical image encoder of stages, each after the first "
        "starting with patch merging (2x2 tokens -> 1, width doubled), as Swin. 0: no blocks (an "
        "encoder_decoder's encoder that only embeds its input for the decoder to cross-attend, as Perceiver).",
        low=0,
    )
    block: BlockSpec = Field(
        description="The block, repeated depth times (the base of blocks and overrides)."
    )
    blocks: dict[str, BlockOverride] = Field(
        default_factory=dict,
        max_length=32,
        description="Named block variants, each the keys it changes in `block`; ordered by schedule.",
    )
    schedule: list[ScheduleItem] | None = Field(
        None,
        min_length=1,
        max_length=MAX_DEPTH,
        description="The order of the blocks along the depth, repeated until depth: names of blocks (or "
        "`block`), or {name: count} for a run, e.g. [local, local, global] or [{block: 24}, {class: 2}].",
    )
    overrides: list[LayerOverride] = Field(
        default_factory=list,
        max_length=MAX_DEPTH,
        description="Changes to the blocks at given layer indexes.",
    )
    dropout: DropoutSpec = Field(default_factory=DropoutSpec, description="Dropout probabilities.")
    drop_path: Probability = Field(0.0, description="Stochastic depth rate of the last block, linear from 0.")
    masking: MaskingSpec | None = Field(
        None, description="Random masking of the patch tokens (MAE): the blocks see the visible ones only."
    )
    embed_norm: bool = Field(False, description="A norm after the embeddings (BERT).")
    embed_width: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH,
        description="Width of the token embeddings when it differs from width: token, type and position "
        "tables and embed_norm are this wide, and a linear layer (embed_proj) maps them to width before the "
        "blocks (ALBERT: 128). null = width.",
    )
    merge_norm: Literal["pre", "post"] = Field(
        "pre",
        description="Where the norm of patch merging sits (hierarchical stacks): pre, norm over 4C then "
        "the linear 4C -> 2C (Swin); post, the linear then a norm over 2C (Swin-V2).",
    )
    downsample: MapOps | None = Field(
        None,
        description="Hierarchical stacks: the layers between stages in place of patch merging, over the tokens "
        "as a map (conv, norm, act and pool items; a conv without channels leads to the next stage's width), "
        "whose output map is the next stage's grid: PVT's stage norm and overlapping patch embedding.",
    )
    final_norm: bool = Field(True, description="A norm after the last block.")
    share: ShareSpec | None = Field(
        None, description="Blocks that share one set of weights (the state dict holds each set once)."
    )

    _layers: list[BlockSpec] = PrivateAttr(default_factory=list)
    _facts: StackFacts | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _resolve(self) -> StackSpec:
        # The MLP hidden size is stored resolved, so a canonical spec carries one number, not two.
        resolve_mlp(self.block, self.width)
        return self

    def pattern(self) -> list[str]:
        """The name of each layer's block along the depth (``block`` for the base), before overrides."""
        names: list[str] = []
        items = self.schedule or ["block"]
        while len(names) < self.total_depth:
            for item in items:
                for name, count in item.items() if isinstance(item, dict) else [(item, 1)]:
                    names += [name] * count
        return names[: self.total_depth]

    def layer(self, i: int) -> BlockSpec:
        """The block of layer ``i`` (from 0 over the whole stack): the base, its scheduled variant, overrides."""
        if not self._layers:
            self._layers = self._resolve_layers()
        return self._layers[i]

    def _resolve_layers(self) -> list[BlockSpec]:
        stages, out = self.stage_depths, []
        unique: dict[str, BlockSpec] = {}
        for i, name in enumerate(self.pattern()):
            changes = [self.blocks[name]] if name in self.blocks else []
            changes += [o.block for o in self.overrides if i in o.indexes(stages)]
            if not changes:
                out.append(self.block)
                continue
            key = repr([c.model_dump(exclude_unset=True) for c in changes])
            if key not in unique:  # equal layers share one object: the graph folds them as one block
                block = merge_block(self.block, *changes)
                resolve_mlp(block, self.width)
                unique[key] = block
            out.append(unique[key])
        return out

    @property
    def facts(self) -> StackFacts:
        """The stack's resolved numbers, computed once from the properties below (the one place each is
        derived); the lowering and every stage after it read these, through the graph."""
        if self._facts is None:
            self._facts = resolve(self)
        return self._facts

    @property
    def layer_blocks(self) -> list[BlockSpec]:
        """The block of every layer, in order."""
        return [self.layer(i) for i in range(self.total_depth)]

    @property
    def positions(self) -> list[PositionFragment]:
        """The stack's position kinds (a list of one, or several combined)."""
        return list(self.position) if isinstance(self.position, list) else [self.position]

    def weight_set(self, i: int) -> int:
        """The set of block weights layer ``i`` runs with: its own index unless blocks are shared."""
        if self.share is None:
            return i
        n = self.share.blocks
        return i % n if self.share.order == "cycle" else i // max(self.total_depth // n, 1)

    @property
    def total_depth(self) -> int:
        return sum(self.stage_depths)

    @property
    def out_width(self) -> int:
        """Width of the stack's output (the last stage's)."""
        return self.stage_widths[-1]

    @property
    def heads(self) -> int:
        """Heads of the first stage (of every block, for plain stacks)."""
        return self.stage_heads[0]

    @property
    def head_dim(self) -> int:
        """Width per head: ``block.head_dim``, else the width over the heads.

        Raises:
            Undetermined: heads that do not divide the width, without a head_dim (a rule reports it).
        """
        if self.block.head_dim is None and self.width % self.heads:
            raise Undetermined("head_dim")
        return self.block.head_dim or self.width // self.heads

    @property
    def embedding_width(self) -> int:
        """The width of the token embeddings and what is added to them before ``embed_proj``."""
        return self.embed_width or self.width

    @property
    def kv_heads(self) -> int:
        return self.block.kv_heads or self.heads

    @property
    def mlp_hidden(self) -> int:
        assert self.block.mlp.hidden is not None  # resolved by _resolve
        return self.block.mlp.hidden

    @property
    def num_prefix(self) -> int:
        return self.prefix.count

    @property
    def max_len(self) -> int:
        """The longest sequence the stack takes: the rows of a learned position table (whichever of the
        stack's positions it is) less the prefix tokens it covers, else :data:`MAX_LEN`. The one place this
        is derived: input checks, ``generate`` and the lowering's default length read it."""
        for position in self.positions:
            if isinstance(position, LearnedPosition) and position.max_len is not None:
                return position.max_len - (self.num_prefix if position.include_prefix else 0)
        return MAX_LEN

    @property
    def prefix_at(self) -> int:
        """The index of the first block that sees the prefix tokens (0 unless ``prefix.at`` says later)."""
        return self.prefix.at or 0

    @property
    def causal(self) -> bool:
        """Some self-attention of the stack is causal: it can decode token by token with a KV cache."""
        return any(
            getattr(SUBLAYERS[layer], "causal", False) for b in self.layer_blocks for layer in b.sublayers
        )

    @property
    def num_tokens(self) -> int | None:
        """Tokens seen by the (first) blocks when the input fixes them (images, feature maps, queries), else None."""
        tokens = self.input.tokens
        if tokens is None or isinstance(self.input, QueriesInput):
            return tokens
        return tokens + self.num_prefix * (self.prefix_at == 0)

    @property
    def grid(self) -> tuple[int, int] | None:
        """The 2D token grid of an image or feature-map input."""
        if isinstance(self.input, ImageInput):
            return self.input.grid
        if isinstance(self.input, FeaturesInput):
            return self.input.grid
        return None


# ------------------------------------------------------------------------------------------------ spec


class Spec(Node):
    """A whole model: encoder-only, decoder-only or encoder-decoder."""

    specvit: Literal[1] = Field(description="Format version of the spec language; this is version 1.")
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$", description="Model name.")
    description: str = Field(
        "", max_length=10_000, description="Free text: what this is and where numbers come from."
    )
    model: ModelKind = Field(
        description="encoder (ViT, BERT), decoder (GPT) or encoder_decoder (Transformer)."
    )
    encoder: StackSpec | None = Field(
        None, description="The encoder stack (model encoder or encoder_decoder)."
    )
    decoder: StackSpec | None = Field(
        None, description="The decoder stack (model decoder or encoder_decoder)."
    )
    head: HeadSpec = Field(
        default_factory=lambda: NoHead(kind="none"),
        description=f"Output head: {_kinds('head')}.",
    )
    shared_embeddings: bool = Field(
        False,
        description="encoder_decoder with token inputs: the decoder reuses the encoder's token embedding.",
    )
    init: Literal["vit", "xavier", "normal"] | None = Field(
        None,
        description="Weight init: vit (trunc-normal 0.02, zero head), xavier (uniform, torch.nn.Transformer), "
        "normal (N(0, 0.02), BERT/GPT-2); null picks by family.",
    )

    _source: Any = PrivateAttr(None)  # specvit.spec.loader.SourceMap, set by the loader

    def model_post_init(self, context: Any, /) -> None:
        if self.init is None:
            self.init = self._family_init()

    def _family_init(self) -> Literal["vit", "xavier", "normal"]:
        if self.model == "encoder_decoder":
            return "xavier"
        stack = self.encoder if self.model == "encoder" else self.decoder
        if stack is not None and isinstance(stack.input, ImageInput):
            return "vit"
        return "normal"

    def locate(self, path: str) -> Location | None:
        """The file:line:col a dotted key path came from (or its nearest written ancestor), if known."""
        return self._source.locate(path) if self._source is not None else None

    @property
    def stacks(self) -> dict[str, StackSpec]:
        """The stacks present, by role name (``encoder``, ``decoder``)."""
        return {
            name: s for name, s in (("encoder", self.encoder), ("decoder", self.decoder)) if s is not None
        }

    @property
    def output_stack(self) -> str:
        """The stack whose output the head reads."""
        return "encoder" if self.model == "encoder" else "decoder"

    def __eq__(self, other: object) -> bool:
        # Equality is about the model described, not about which file lines it came from.
        return isinstance(other, Spec) and self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]

    def to_yaml(self) -> str:
        """The canonical spec: every default resolved, keys in schema order."""
        return dump_yaml(self.model_dump(mode="json"))

    def summary_line(self) -> str:
        """One line for ``specvit validate``: name, model kind, depth, width, heads."""
        parts = [f"{self.name}: {self.model}"]
        for role, s in self.stacks.items():
            depth, heads = (s.depth, s.block.heads) if not s.hierarchical else (s.stage_depths, s.stage_heads)
            shared = f" ({s.share.blocks} weight set{'s' * (s.share.blocks > 1)})" if s.share else ""
            width = s.widths or s.width
            parts.append(f"{role} {s.input.kind} depth={depth}{shared} width={width} heads={heads}")
        parts.append(f"head={self.head.kind}")
        return ", ".join(parts)
