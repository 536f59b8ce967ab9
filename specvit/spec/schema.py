"""The spec language: Pydantic models of an attention architecture.

Every model is strict (``12`` is a number, ``"12"`` is not; ``true`` is not a number) and forbids
unknown keys. Kinds are ``Literal`` strings and alternatives are discriminated by a ``kind`` key,
so an editor can complete them from the JSON Schema. Values that follow from others (head dim, MLP
hidden size, token counts, the init convention) are resolved here, once, so everything downstream
reads concrete numbers. Cross-field rules live in :mod:`specvit.spec.rules`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from specvit.errors import Location

__all__ = [
    "FORMAT_VERSION",
    "BlockSpec",
    "ClassifierHead",
    "DetectionHead",
    "DropoutSpec",
    "FeaturesInput",
    "ImageInput",
    "LMHead",
    "MlpSpec",
    "NoHead",
    "NormSpec",
    "PatchesHead",
    "PrefixSpec",
    "QueriesInput",
    "SiameseInput",
    "Sine2dPosition",
    "Spec",
    "StackSpec",
    "TokensInput",
    "WindowSpec",
]

FORMAT_VERSION = 1

# Upper bounds keep shape, parameter and FLOP arithmetic far from overflow and from sizes that
# would take minutes to lower; they are well above any model trained to date.
MAX_WIDTH = 1 << 16
MAX_DEPTH = 1024
MAX_HEADS = 1024
MAX_IMAGE = 1 << 14
MAX_VOCAB = 1 << 24
MAX_LEN = 1 << 20

Sublayer = Literal["self_attention", "masked_self_attention", "cross_attention", "mlp"]
Activation = Literal["gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu"]
ModelKind = Literal["encoder", "decoder", "encoder_decoder"]


def _pair(value: Any) -> Any:
    """``16`` -> ``(16, 16)`` and ``[14, 16]`` -> ``(14, 16)``; anything else is left for the type check."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, list):
        if len(value) != 2:
            raise PydanticCustomError(
                "pair", "expected one integer or [height, width], got a list of {n}", {"n": len(value)}
            )
        return tuple(value)
    return value


def _kind_shortcut(value: Any) -> Any:
    """Lets ``position: learned`` stand for ``position: {kind: learned}``."""
    return {"kind": value} if isinstance(value, str) else value


def _single_or_stages(value: Any) -> str:
    return "stages" if isinstance(value, list) else "single"


def _per_stage(bound: int, what: str) -> Any:
    """``int`` or a list of ints, one per stage of a hierarchical stack; errors come from one branch only."""
    one = Annotated[int, Field(ge=1, le=bound)]
    return Annotated[
        Annotated[one, Tag("single")]
        | Annotated[list[one], Tag("stages"), Field(min_length=1, max_length=8)],
        Discriminator(_single_or_stages),
        Field(description=what),
    ]


Pair = Annotated[
    tuple[Annotated[int, Field(ge=1, le=MAX_IMAGE)], Annotated[int, Field(ge=1, le=MAX_IMAGE)]],
    BeforeValidator(_pair),
]
Probability = Annotated[float, Field(ge=0.0, lt=1.0)]


class Node(BaseModel):
    """Base of every spec model: strict types, unknown keys refused, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=False)


# ---------------------------------------------------------------------------------------------- inputs


class ImageInput(Node):
    """An image cut into non-overlapping patches, each projected to the stack width."""

    kind: Literal["image"] = Field(description="Discriminator: an image input.")
    size: Pair = Field(description="Image size in pixels: one int for square images, or [height, width].")
    patch: Pair = Field(description="Patch size in pixels: one int, or [height, width].")
    channels: int = Field(3, ge=1, le=4096, description="Input channels (3 for RGB, 1 for grey).")
    projection: Literal["conv", "linear"] = Field(
        "conv",
        description="Patch projection: a strided conv (timm, HF) or a linear layer on flattened patches.",
    )
    bias: bool = Field(True, description="Bias in the patch projection.")

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per side, (rows, cols)."""
        return self.size[0] // self.patch[0], self.size[1] // self.patch[1]

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]


class TokensInput(Node):
    """Integer token ids looked up in an embedding table."""

    kind: Literal["tokens"] = Field(description="Discriminator: a token input.")
    vocab: int = Field(ge=1, le=MAX_VOCAB, description="Vocabulary size.")
    padding_idx: int | None = Field(
        None, ge=0, description="Token id whose embedding stays zero and gets no gradient, or null."
    )
    scale: bool = Field(
        False, description="Multiply embeddings by sqrt(width), as in 'Attention Is All You Need'."
    )
    type_vocab: int = Field(
        0, ge=0, le=MAX_VOCAB, description="Token-type (segment) vocabulary, as BERT's 2; 0 for none."
    )


class FeaturesInput(Node):
    """Precomputed feature vectors (CNN features as in DETR, or a torch.nn.Transformer's inputs)."""

    kind: Literal["features"] = Field(description="Discriminator: a features input.")
    dim: int = Field(ge=1, le=MAX_WIDTH, description="Feature size of each input vector.")
    project: bool | None = Field(
        None,
        description="Project features to the width with a linear layer; null means 'only when dim != width'.",
    )
    grid: Pair | None = Field(
        None,
        description="The features form a [rows, cols] map (a CNN's, as in DETR), in row-major order; null: a sequence.",
    )

    @property
    def num_tokens(self) -> int | None:
        return self.grid[0] * self.grid[1] if self.grid is not None else None


class QueriesInput(Node):
    """N learned object queries (DETR): the decoder starts from zeros and the queries are its positions."""

    kind: Literal["queries"] = Field(description="Discriminator: learned queries (a decoder's input).")
    count: int = Field(ge=1, le=MAX_LEN, description="Number of queries, i.e. of predictions per image.")


class SiameseInput(Node):
    """A second image through the encoder, weights shared (CroCo): a decoder's input.

    The image has the encoder's size and channels; its encoder output and the encoder's output for the
    first image (the memory) are both projected to the decoder width by one linear layer (CroCo's
    ``decoder_embed``). The decoder's tokens are the encoder's patch tokens, on its patch grid.
    """

    kind: Literal["siamese"] = Field(
        description="Discriminator: the shared encoder's output for a second image (a decoder's input)."
    )


InputSpec = Annotated[
    ImageInput | TokensInput | FeaturesInput | QueriesInput | SiameseInput, Field(discriminator="kind")
]


class PrefixSpec(Node):
    """Learned tokens put in front of the sequence."""

    cls: bool = Field(False, description="A learned class token, first in the sequence.")
    registers: int = Field(0, ge=0, le=1024, description="Learned register tokens after the class token.")

    @property
    def count(self) -> int:
        return int(self.cls) + self.registers


# ------------------------------------------------------------------------------------------- positions


class NoPosition(Node):
    """No position information."""

    kind: Literal["none"] = Field(description="Discriminator: no positions.")


class LearnedPosition(Node):
    """A learned table of position embeddings, added to the tokens."""

    kind: Literal["learned"] = Field(description="Discriminator: learned absolute positions.")
    max_len: int | None = Field(
        None,
        ge=1,
        le=MAX_LEN,
        description="Table length; derived for images, required for tokens and features.",
    )
    include_prefix: bool = Field(
        True, description="The table covers the prefix tokens too (timm's default); false: patches only."
    )


class SinCosPosition(Node):
    """Fixed 1D sinusoids of 'Attention Is All You Need', added to the tokens."""

    kind: Literal["sincos"] = Field(description="Discriminator: fixed 1D sinusoidal positions.")
    base: float = Field(10000.0, gt=1.0, description="Wavelength base.")


class SinCos2dPosition(Node):
    """Fixed 2D sinusoids over the patch grid (MAE), added to the patch tokens."""

    kind: Literal["sincos2d"] = Field(description="Discriminator: fixed 2D sinusoidal positions (images).")
    base: float = Field(10000.0, gt=1.0, description="Wavelength base.")


class RopePosition(Node):
    """Rotary position embedding of queries and keys (RoFormer)."""

    kind: Literal["rope"] = Field(description="Discriminator: 1D rotary positions.")
    base: float = Field(10000.0, gt=1.0, description="Rotary base (theta).")


class Rope2dPosition(Node):
    """2D rotary embedding over the patch grid, as in CroCo: half the head dim per axis."""

    kind: Literal["rope2d"] = Field(description="Discriminator: 2D rotary positions (images).")
    base: float = Field(100.0, gt=1.0, description="Rotary base; CroCo uses 100.")


class Sine2dPosition(Node):
    """DETR's 2D sine positions, added to queries and keys in every attention layer (never to values).

    Coordinates are normalised to (0, 2*pi]; half the channels encode the row, half the column, each as
    interleaved sin/cos of ``base**(2i/d)`` frequencies. The decoder's cross-attention adds them to the
    memory's keys too.
    """

    kind: Literal["sine2d"] = Field(
        description="Discriminator: DETR's 2D sine positions in every attention layer."
    )
    base: float = Field(10000.0, gt=1.0, description="Temperature of the frequencies.")


PositionSpec = Annotated[
    Annotated[
        NoPosition
        | LearnedPosition
        | SinCosPosition
        | SinCos2dPosition
        | RopePosition
        | Rope2dPosition
        | Sine2dPosition,
        Field(discriminator="kind"),
    ],
    BeforeValidator(_kind_shortcut),
]

# ---------------------------------------------------------------------------------------------- blocks


class NormSpec(Node):
    """The normalisation used throughout a stack."""

    kind: Literal["layernorm", "rmsnorm"] = Field("layernorm", description="Norm layer.")
    placement: Literal["pre", "post"] = Field(
        "pre",
        description="pre: x + f(norm(x)) (ViT, GPT-2). post: norm(x + f(x)) (original Transformer, BERT).",
    )
    eps: float = Field(1e-6, gt=0.0, lt=1.0, description="Epsilon added to the variance.")
    bias: bool = Field(True, description="LayerNorm has a bias (rmsnorm never has one).")


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
        "gelu", description="gelu (exact), gelu_tanh (GPT-2), relu, silu, or the gated swiglu / geglu."
    )
    bias: bool = Field(True, description="Biases in the MLP's linear layers.")


class WindowSpec(Node):
    """Attention within M x M windows of the patch grid, with a learned relative position bias (Swin)."""

    size: int = Field(
        ge=1, le=256, description="Window side M in tokens; a stage smaller than M uses its whole grid."
    )
    shift: bool = Field(
        True, description="Every second block shifts the windows by M/2 (cyclic shift and mask)."
    )


class BlockSpec(Node):
    """One residual block, repeated `depth` times."""

    heads: _per_stage(MAX_HEADS, "Attention (query) heads; a list gives each stage's heads.")  # type: ignore[valid-type]
    kv_heads: int | None = Field(
        None,
        ge=1,
        le=MAX_HEADS,
        description="Key/value heads: fewer than heads for GQA, 1 for MQA; null = heads.",
    )
    head_dim: int | None = Field(None, ge=1, le=4096, description="Dim per head; null = width / heads.")
    layers: list[Sublayer] = Field(
        default_factory=lambda: list[Sublayer](["self_attention", "mlp"]),
        min_length=1,
        max_length=16,
        description="The residual sublayers in order.",
    )
    norm: NormSpec = Field(default_factory=NormSpec, description="Norm kind, placement and eps.")
    mlp: MlpSpec = Field(default_factory=MlpSpec, description="The feed-forward sublayer.")
    qkv_bias: bool = Field(True, description="Biases in the query/key/value projections.")
    proj_bias: bool = Field(True, description="Bias in the attention output projection.")
    qk_norm: bool = Field(False, description="Normalise queries and keys per head (same norm kind).")
    layer_scale: float | None = Field(
        None, gt=0.0, le=10.0, description="LayerScale init value (CaiT, DINOv2), or null for none."
    )
    window: WindowSpec | None = Field(
        None, description="Windowed self-attention with a relative position bias (Swin), or null for global."
    )
    memory_norm: bool = Field(
        False, description="A norm on the memory before each cross-attention (CroCo's norm_y)."
    )


class DropoutSpec(Node):
    """Dropout probabilities, all 0 by default."""

    embedding: Probability = Field(0.0, description="After the embeddings and positions.")
    attention: Probability = Field(0.0, description="On the attention weights.")
    projection: Probability = Field(0.0, description="After the attention output projection.")
    mlp: Probability = Field(0.0, description="Inside and after the MLP.")


class StackSpec(Node):
    """An encoder or decoder: input embedding, positions, `depth` blocks, final norm."""

    input: InputSpec = Field(
        description="What comes in: image patches, tokens, features, learned queries or (a decoder) siamese."
    )
    prefix: PrefixSpec = Field(default_factory=PrefixSpec, description="Class and register tokens.")
    position: PositionSpec = Field(
        description="Position encoding: none, learned, sincos, sincos2d, rope, rope2d."
    )
    width: int = Field(ge=1, le=MAX_WIDTH, description="Model width (embedding dim) of every token.")
    depth: _per_stage(  # type: ignore[valid-type]
        MAX_DEPTH,
        "Number of blocks; a list [2, 2, 6, 2] makes a hierarchical image encoder of stages, each after the first "
        "starting with patch merging (2x2 tokens -> 1, width doubled), as Swin.",
    )
    block: BlockSpec = Field(description="The repeated block.")
    dropout: DropoutSpec = Field(default_factory=DropoutSpec, description="Dropout probabilities.")
    drop_path: Probability = Field(0.0, description="Stochastic depth rate of the last block, linear from 0.")
    embed_norm: bool = Field(False, description="A norm after the embeddings (BERT).")
    final_norm: bool = Field(True, description="A norm after the last block.")

    @model_validator(mode="after")
    def _resolve(self) -> StackSpec:
        # The MLP hidden size is stored resolved, so a canonical spec carries one number, not two.
        mlp = self.block.mlp
        if mlp.hidden is None:
            mlp.hidden = int((mlp.ratio if mlp.ratio is not None else 4.0) * self.width)
            mlp.ratio = None
        return self

    @property
    def hierarchical(self) -> bool:
        """A stack of stages with patch merging between them (``depth`` is a list)."""
        return isinstance(self.depth, list)

    @property
    def stage_depths(self) -> list[int]:
        return list(self.depth) if isinstance(self.depth, list) else [self.depth]

    @property
    def stage_heads(self) -> list[int]:
        heads = self.block.heads
        return list(heads) if isinstance(heads, list) else [heads] * len(self.stage_depths)

    @property
    def stage_widths(self) -> list[int]:
        return [self.width * 2**i for i in range(len(self.stage_depths))]

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
        return self.block.head_dim or self.width // self.heads

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
    def num_tokens(self) -> int | None:
        """Tokens seen by the (first) blocks when the input fixes them (images, feature maps, queries), else None."""
        if isinstance(self.input, ImageInput):
            return self.input.num_patches + self.num_prefix
        if isinstance(self.input, FeaturesInput) and self.input.num_tokens is not None:
            return self.input.num_tokens + self.num_prefix
        if isinstance(self.input, QueriesInput):
            return self.input.count
        return None

    @property
    def grid(self) -> tuple[int, int] | None:
        """The 2D token grid of an image or feature-map input."""
        if isinstance(self.input, ImageInput):
            return self.input.grid
        if isinstance(self.input, FeaturesInput):
            return self.input.grid
        return None


# ----------------------------------------------------------------------------------------------- heads


class ClassifierHead(Node):
    """Pool the tokens, then a linear classifier."""

    kind: Literal["classifier"] = Field(description="Discriminator: a classification head.")
    classes: int = Field(ge=1, le=MAX_VOCAB, description="Number of classes.")
    pool: Literal["cls", "mean"] = Field(
        "cls", description="cls: the class token; mean: average of the other tokens."
    )
    norm: bool = Field(False, description="A norm between pooling and the classifier (timm's fc_norm).")
    bias: bool = Field(True, description="Bias in the classifier.")
    dropout: Probability = Field(0.0, description="Dropout before the classifier.")


class LMHead(Node):
    """A linear layer from every token to vocabulary logits."""

    kind: Literal["lm"] = Field(description="Discriminator: a language-model head.")
    vocab: int | None = Field(None, ge=1, le=MAX_VOCAB, description="Output vocabulary; null = the input's.")
    tied: bool = Field(False, description="Share the weight with the token embedding.")
    bias: bool = Field(False, description="Bias in the output layer.")


class DetectionHead(Node):
    """DETR's heads on every query: class logits (classes + 'no object') and a box MLP with a sigmoid."""

    kind: Literal["detection"] = Field(description="Discriminator: per-query class logits and boxes.")
    classes: int = Field(
        ge=1, le=MAX_VOCAB, description="Object classes; the logits add one 'no object' class."
    )
    box_layers: int = Field(3, ge=1, le=8, description="Layers of the box MLP (hidden width = the model's).")


class PatchesHead(Node):
    """Pixels per token (CroCo, MAE): a linear layer from every patch token to patch x patch x channels values.

    The patch size and channels are the image input's (the encoder's for a siamese decoder).
    """

    kind: Literal["patches"] = Field(description="Discriminator: per-patch pixel predictions.")
    bias: bool = Field(True, description="Bias in the prediction layer.")


class NoHead(Node):
    """No head: the model returns the final token features."""

    kind: Literal["none"] = Field(description="Discriminator: features out.")


HeadSpec = Annotated[
    Annotated[ClassifierHead | LMHead | DetectionHead | PatchesHead | NoHead, Field(discriminator="kind")],
    BeforeValidator(_kind_shortcut),
]


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
        description="Output head: classifier, lm, detection, patches or none.",
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
        from specvit.spec.loader import dump_yaml

        return dump_yaml(self.model_dump(mode="json"))

    def summary_line(self) -> str:
        """One line for ``specvit validate``: name, model kind, depth, width, heads."""
        parts = [f"{self.name}: {self.model}"]
        for role, s in self.stacks.items():
            depth, heads = (s.depth, s.block.heads) if not s.hierarchical else (s.stage_depths, s.stage_heads)
            parts.append(f"{role} {s.input.kind} depth={depth} width={s.width} heads={heads}")
        parts.append(f"head={self.head.kind}")
        return ", ".join(parts)
