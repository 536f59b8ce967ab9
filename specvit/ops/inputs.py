"""What comes into a stack: what a spec writes under ``input:`` and the nodes each kind becomes.

Each kind's ``lower`` adds the model's forward arguments it needs (placeholders) and its embedding,
and leaves ``ctx.x`` at the embedded tokens, ``ctx.n`` at their count and ``ctx.grid`` at their 2D grid.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt

from specvit.errors import Problem
from specvit.ops.base import MAX_LEN, MAX_VOCAB, MAX_WIDTH, Fragment, StackCtx, fragment
from specvit.ops.conv import MapOps, lower_map_ops, map_ops_problems, map_out
from specvit.ops.embed import LinearParams, PatchEmbedParams, QueriesParams, TokenEmbedParams, TypeEmbedParams
from specvit.ops.facts import SpecView, StackView
from specvit.ops.fields import Pair
from specvit.ops.maps import ToTokensParams
from specvit.ops.shift import lower_shifted
from specvit.ops.structure import CallParams, ZerosParams

__all__ = [
    "FeaturesInput",
    "ImageInput",
    "InputFragment",
    "QueriesInput",
    "SiameseInput",
    "SignalInput",
    "TokensInput",
]


class InputFragment(Fragment):
    """Base of the ``input:`` kinds."""

    kind: str

    @property
    def tokens(self) -> int | None:
        """How many tokens the input gives when it fixes their count (an image's patches, a feature map, a
        signal after its stem, queries), else None."""
        return None

    def lower(self, ctx: StackCtx) -> None:
        """Add this input's placeholders and embedding to the stack being lowered."""
        raise NotImplementedError


def _sequence_mask(ctx: StackCtx, seq: Any) -> None:
    """The (B, S) padding mask argument of a sequence input, read by every attention layer."""
    ctx.side["mask"] = ctx.placeholder(
        f"{ctx.role}.mask",
        ctx.arg("mask"),
        ("B", seq),
        dtype="bool",
        required=False,
        what="padding mask",
        stack=ctx.role,
        group=1,
    )


@fragment("input")
class ImageInput(InputFragment):
    """An image cut into non-overlapping patches, each projected to the stack width."""

    kind: Literal["image"] = Field(description="Discriminator: an image input.")
    size: Pair = Field(description="Image size in pixels: one int for square images, or [height, width].")
    patch: Pair | None = Field(
        None,
        description="Patch size in pixels: one int, or [height, width]; null: no patches, the positions of the "
        "stem's output map are the tokens and its channels the width (PVT's overlapping patch embedding).",
    )
    channels: int = Field(3, ge=1, le=4096, description="Input channels (3 for RGB, 1 for grey).")
    projection: Literal["conv", "linear"] = Field(
        "conv",
        description="Patch projection: a strided conv (timm, HF) or a linear layer on flattened patches.",
    )
    bias: bool = Field(True, description="Bias in the patch projection.")
    stem: MapOps = Field(
        default_factory=list,
        description="Layers over the image before the patches are cut (a convolutional stem: conv, norm, act "
        "and pool items, as in hybrid ViTs); the patches are cut from the map they leave, and size and patch "
        "are the image's and the map's.",
    )

    @property
    def stem_out(self) -> tuple[int, tuple[int, ...]]:
        """(channels, (height, width)) of the map the patches are cut from: the image after the stem."""
        return map_out(self.stem, self.channels, self.size)

    @property
    def grid(self) -> tuple[int, int]:
        """Tokens per side, (rows, cols): patches, or the positions of the stem's map without patches."""
        h, w = self.stem_out[1]
        return (h, w) if self.patch is None else (h // self.patch[0], w // self.patch[1])

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def tokens(self) -> int:
        return self.num_patches

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        stem = map_ops_problems(f"{at}.stem", self.stem, self.channels, self.size)
        if stem or self.patch is None:
            return stem or _map_width(at, self.stem_out[0], stack.width)
        what = "the stem's output map" if self.stem else "image size"
        sides = [
            (size, patch) for size, patch in zip(self.stem_out[1], self.patch, strict=True) if size % patch
        ]
        return [
            Problem(
                f"{at}.patch",
                f"{what} {size} is not divisible by patch {patch}",
                f"use a patch size that divides {size}, such as {divisors_near(size, patch)}",
            )
            for size, patch in dict.fromkeys(sides)  # a square image fails once, not per side
        ]

    def lower(self, ctx: StackCtx) -> None:
        (h, w), c = self.size, self.channels
        x = ctx.placeholder(
            f"{ctx.role}.input",
            ctx.arg("input"),
            ("B", c, h, w),
            what=f"image {h}x{w}",
            local="images",
            stack=ctx.role,
        )
        x = lower_map_ops(ctx, x, self.stem, f"{ctx.role}.stem", f"{ctx.role}.input.stem")
        c, size = self.stem_out
        assert len(size) == 2
        ctx.n, ctx.grid, source = self.num_patches, self.grid, f"{ctx.role}.input"
        if self.patch is None:  # the stem's map is the tokens
            ctx.x = ctx.add(f"{ctx.role}.tokens", "to_tokens", ToTokensParams(), {"x": x}, source=source)
            return
        p = PatchEmbedParams(size, self.patch, c, ctx.stack.width, self.projection, self.bias)
        ctx.x = ctx.add(f"{ctx.role}.patch_embed", "patch_embed", p, {"x": x}, source=source)


@fragment("input")
class TokensInput(InputFragment):
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
    shifted_source: Annotated[StrictInt, Field(ge=0, le=MAX_VOCAB)] | Literal["last"] | None = Field(
        None,
        description="A decoder's ids made of the encoder's token ids: shifted one position right behind this "
        "start id (HF's shift_tokens_right, as BART's and T5's *ForSequenceClassification given input_ids "
        "alone); last: behind each source's last token that is not padding_idx (mBART's language id). The "
        "model then takes no tgt: model(src); null: the decoder reads its own ids.",
    )

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        if self.padding_idx is not None and self.padding_idx >= self.vocab:
            return [
                Problem(
                    f"{at}.padding_idx",
                    f"padding_idx {self.padding_idx} is outside the vocabulary of {self.vocab}",
                    f"use an id below {self.vocab}",
                )
            ]
        return self._shift_problems(at, stack, spec) if self.shifted_source is not None else []

    def _shift_problems(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        """A shifted source: a decoder's, of an encoder reading token ids of its vocabulary at most, with an
        id in front (or the padding id to find the last token)."""
        key, encoder = f"{at}.shifted_source", spec.encoder
        if not at.startswith("decoder.") or spec.model != "encoder_decoder" or encoder is None:
            why = "shifted_source makes a decoder's ids of its encoder's"
            return [Problem(key, why, "use it in the decoder of an encoder_decoder model, or remove it")]
        if encoder.input.kind != "tokens":
            why = f"shifted_source shifts the encoder's token ids, and the encoder reads {encoder.input.kind}"
            return [Problem(key, why, "give the encoder a tokens input, or remove shifted_source")]
        if encoder.input.vocab > self.vocab:
            why = f"the encoder's ids (vocab {encoder.input.vocab}) index the decoder's table of {self.vocab} rows"
            return [Problem(key, why, f"give the decoder vocab {encoder.input.vocab} or more")]
        if self.shifted_source == "last" and self.padding_idx is None:
            why = "shifted_source last puts the last token that is not padding first, and there is no padding_idx"
            return [Problem(key, why, "set padding_idx, or give a start id")]
        if isinstance(self.shifted_source, int) and self.shifted_source >= self.vocab:
            why = f"start id {self.shifted_source} is outside the vocabulary of {self.vocab}"
            return [Problem(key, why, f"use an id below {self.vocab}")]
        return []

    def ids(self, role: str) -> str:
        """The node of the token ids the stack ``role`` reads as given: the source's where they are shifted.

        Args:
            role: the stack's role.
        """
        return "encoder.input" if self.shifted_source is not None else f"{role}.input"

    def lower(self, ctx: StackCtx) -> None:
        role, seq = ctx.role, ctx.n
        if self.shifted_source is not None:  # no target argument, no padding mask: HF's decoder masks none
            start = None if self.shifted_source == "last" else self.shifted_source
            ids, seq = lower_shifted(ctx, start, self.padding_idx), ctx.n
        else:
            ids = ctx.placeholder(
                f"{role}.input",
                ctx.arg("input"),
                ("B", seq),
                dtype="long",
                vocab=self.vocab,
                what="token ids",
                stack=role,
            )
            _sequence_mask(ctx, seq)
        shared = role == "decoder" and ctx.spec.shared_embeddings
        p = TokenEmbedParams(
            self.vocab,
            ctx.stack.facts.embedding_width,
            self.padding_idx,
            self.scale,
            "encoder.tok_embed" if shared else None,
        )
        ctx.x = ctx.add(f"{role}.tok_embed", "token_embed", p, {"x": ids}, source=f"{role}.input")
        if self.type_vocab:
            types = ctx.placeholder(
                f"{role}.token_types",
                ctx.arg("types"),
                ("B", seq),
                dtype="long",
                required=False,
                vocab=self.type_vocab,
                what="token types",
                stack=role,
                group=2,
            )
            tp = TypeEmbedParams(self.type_vocab, ctx.stack.facts.embedding_width)
            src = f"{role}.input.type_vocab"
            ctx.x = ctx.add(f"{role}.type_embed", "type_embed", tp, {"x": ctx.x, "types": types}, source=src)


@fragment("input")
class FeaturesInput(InputFragment):
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
    def tokens(self) -> int | None:
        return self.grid[0] * self.grid[1] if self.grid is not None else None

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        if self.project is False and self.dim != stack.width:
            return [
                Problem(
                    f"{at}.project",
                    f"features of dim {self.dim} cannot pass through to width {stack.width} without a projection",
                    "set project: true, or make dim equal to width",
                )
            ]
        return []

    def lower(self, ctx: StackCtx) -> None:
        role, seq = ctx.role, self.tokens or ctx.n
        x = ctx.placeholder(
            f"{role}.input",
            ctx.arg("input"),
            ("B", seq, self.dim),
            what="features",
            local="features",
            stack=role,
        )
        _sequence_mask(ctx, seq)
        ctx.x, ctx.n, ctx.grid = x, seq, self.grid
        if self.project if self.project is not None else self.dim != ctx.stack.width:
            p = LinearParams(self.dim, ctx.stack.width)
            ctx.x = ctx.add(f"{role}.feat_proj", "linear", p, {"x": x}, source=f"{role}.input")


@fragment("input")
class SignalInput(InputFragment):
    """A (B, channels, length) signal, such as the log-mel spectrogram of speech, through a stem of layers
    (Whisper: two Conv1d with GELU, the second of stride 2) whose output positions are the tokens."""

    kind: Literal["signal"] = Field(description="Discriminator: a (B, channels, length) signal.")
    channels: int = Field(ge=1, le=MAX_WIDTH, description="Channels of the signal (Whisper: 80 mel bins).")
    length: int = Field(ge=1, le=MAX_LEN, description="Its length in frames (Whisper: 3000).")
    stem: MapOps = Field(
        default_factory=list,
        description="Layers over the signal (conv, norm, act and pool items); the positions they leave are the "
        "tokens and their channels must be the stack's width.",
    )

    @property
    def stem_out(self) -> tuple[int, tuple[int, ...]]:
        """(channels, (length,)) after the stem."""
        return map_out(self.stem, self.channels, (self.length,))

    @property
    def tokens(self) -> int:
        return self.stem_out[1][0]

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        stem = map_ops_problems(f"{at}.stem", self.stem, self.channels, (self.length,))
        return stem or _map_width(at, self.stem_out[0], stack.width)

    def lower(self, ctx: StackCtx) -> None:
        role = ctx.role
        x = ctx.placeholder(
            f"{role}.input",
            ctx.arg("input"),
            ("B", self.channels, self.length),
            what=f"signal of {self.channels} channels x {self.length} frames",
            local="signal",
            stack=role,
        )
        x = lower_map_ops(ctx, x, self.stem, f"{role}.stem", f"{role}.input.stem")
        ctx.x = ctx.add(f"{role}.tokens", "to_tokens", ToTokensParams(), {"x": x}, source=f"{role}.input")
        ctx.n, ctx.grid = self.tokens, None


@fragment("input")
class QueriesInput(InputFragment):
    """N learned object queries (DETR): the decoder starts from zeros and the queries are its positions."""

    kind: Literal["queries"] = Field(description="Discriminator: learned queries (a decoder's input).")
    count: int = Field(ge=1, le=MAX_LEN, description="Number of queries, i.e. of predictions per image.")

    @property
    def tokens(self) -> int:
        return self.count

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        role = at.split(".")[0]
        out = []
        if not (role == "decoder" and spec.model == "encoder_decoder"):
            out.append(
                Problem(
                    f"{at}.kind",
                    "queries are the input of an encoder_decoder's decoder",
                    "use queries only in the decoder of an encoder_decoder model",
                )
            )
        if stack.position.kind != "none":
            out.append(
                Problem(
                    f"{role}.position",
                    "learned queries are their own positions",
                    "set position: none for a queries input",
                )
            )
        return out

    def lower(self, ctx: StackCtx) -> None:
        role = ctx.role
        p = QueriesParams(self.count, ctx.stack.width)
        queries = ctx.add(
            f"{role}.query_embed", "queries", p, {"x": ctx.side["memory"]}, source=f"{role}.input"
        )
        ctx.x = ctx.add(f"{role}.start", "zeros", ZerosParams(), {"x": queries}, source=f"{role}.input")
        ctx.n = self.count
        ctx.side["pos"] = queries  # added to the queries and keys of every attention


@fragment("input")
class SiameseInput(InputFragment):
    """A second image through the encoder, weights shared (CroCo): a decoder's input.

    The image has the encoder's size and channels; its encoder output and the encoder's output for the
    first image (the memory) are both projected to the decoder width by one linear layer (CroCo's
    ``decoder_embed``). The decoder's tokens are the encoder's patch tokens, on its patch grid.
    """

    kind: Literal["siamese"] = Field(
        description="Discriminator: the shared encoder's output for a second image (a decoder's input)."
    )

    def lower(self, ctx: StackCtx) -> None:
        role, enc = ctx.role, ctx.spec.encoder
        assert enc is not None  # a siamese decoder reads an encoder (a rule of its own)
        image = enc.input
        (h, w), c = image.size, image.channels
        memory = ctx.side["memory"]
        b, n, dm = ctx.shape(memory)
        assert isinstance(dm, int)
        x = ctx.placeholder(
            f"{role}.input",
            ctx.arg("input"),
            ("B", c, h, w),
            what=f"image {h}x{w}",
            local="images",
            stack=role,
        )
        flops, useful = ctx.total_flops("encoder"), ctx.total_flops("encoder", useful=True)
        again = CallParams("encoder", (b, n, dm), flops, useful_flops=useful)
        x = ctx.add(f"{role}.encoder", "call", again, {"x": x}, source=f"{role}.input", scope="")
        embed = LinearParams(dm, ctx.stack.width)
        ctx.x = ctx.add(f"{role}.embed", "linear", embed, {"x": x}, source=f"{role}.input")
        shared = LinearParams(dm, ctx.stack.width, shared_with=f"{role}.embed")
        ctx.side["memory"] = ctx.add(
            f"{role}.memory_embed", "linear", shared, {"x": memory}, source=f"{role}.input"
        )
        ctx.n, ctx.grid = n, image.grid


def _map_width(at: str, channels: int, width: int) -> list[Problem]:
    """A stem whose output positions are the tokens must leave the stack's width."""
    if channels == width:
        return []
    why = f"the stem leaves {channels} channels and the stack is {width} wide"
    return [Problem(f"{at}.stem", why, f"end the stem with a conv to {width} channels")]


def divisors_near(n: int, target: int, count: int = 2) -> str:
    """The ``count`` divisors of ``n`` closest to ``target``, for hints: ``"12 or 16"``."""
    divisors = [d for d in range(1, min(n, 4096) + 1) if n % d == 0]
    best = sorted(divisors, key=lambda d: (abs(d - target), -d))[:count]
    return " or ".join(str(d) for d in sorted(best))
