"""Masked image modelling (MAE, He et al. 2021): random masking of patch tokens, the decoder input that
puts a learned mask token back in every removed place, and the pixel loss on the masked patches.

A spec writes ``masking: {ratio: 0.75}`` in its encoder and ``input: {kind: unmask}`` in its decoder:

- the encoder's ``masking`` lowers, after the positions are added to the patches and before the class
  token, to ``shuffle`` (the argsort of noise, the forward's optional ``noise`` argument), ``keep`` (the
  visible tokens, (B, N, D) -> (B, L, D)), ``restore`` (``ids_restore``) and ``mask`` (1 = removed);
- the decoder's ``unmask`` input lowers to ``embed`` (the encoder width -> the decoder's) and
  ``unshuffle`` (the mask token in every removed place, the shuffle undone, the class token kept in
  front: (B, 1 + L, D) -> (B, 1 + N, D));
- a ``patches`` head with ``loss: masked_mse`` adds ``head.loss``, and the model returns
  ``{loss, logits, mask, ids_restore}`` as HF's ``ViTMAEForPreTraining``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import Dims, Filler, Fragment, ModelCtx, Op, Params, Shape, StackCtx, fragment, op
from specvit.ops.embed import LinearParams
from specvit.ops.facts import SpecView, StackView
from specvit.ops.inputs import InputFragment

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MaskingSpec", "UnmaskInput", "keep_count", "lower_pixel_loss"]

_HELPERS = "specvit.nn.masking"


def keep_count(patches: int, ratio: float) -> int:
    """Visible patches out of ``patches`` at mask ``ratio``: ``int(N * (1 - ratio))``, as MAE and HF."""
    return int(patches * (1 - ratio))


# -------------------------------------------------------------------------------------------- ops


@dataclass(frozen=True)
class ShuffleParams(Params):
    """A random order of the patches: the argsort of the noise (drawn uniform when none is passed)."""


@op
class Shuffle(Op):
    kind = "shuffle"
    params_type = ShuffleParams
    ports = ("x", "noise")
    helpers = (f"{_HELPERS}:random_shuffle",)

    def shape(self, p: ShuffleParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, n, _ = inputs["x"]
        return (b, n)

    def code(self, p: ShuffleParams, args: Mapping[str, str]) -> str:
        return f"random_shuffle({args['x']}, {args.get('noise', 'None')})"

    def label(self, p: ShuffleParams) -> tuple[str, ...]:
        return ("argsort(noise) · ids_shuffle",)


@dataclass(frozen=True)
class RestoreParams(Params):
    """``ids_restore``: the argsort of the shuffle, which puts shuffled tokens back in patch order."""


@op
class Restore(Op):
    kind = "restore_ids"
    params_type = RestoreParams
    helpers = (f"{_HELPERS}:restore_ids",)

    def code(self, p: RestoreParams, args: Mapping[str, str]) -> str:
        return f"restore_ids({args['x']})"

    def label(self, p: RestoreParams) -> tuple[str, ...]:
        return ("argsort(ids_shuffle) · ids_restore",)


@dataclass(frozen=True)
class KeepParams(Params):
    """The visible tokens: the first ``keep`` of the shuffle.

    Args:
        keep: visible patches L.
        patches: all patches N.
    """

    keep: int
    patches: int


@op
class Keep(Op):
    kind = "keep_tokens"
    params_type = KeepParams
    ports = ("x", "ids")
    required = ("x", "ids")
    helpers = (f"{_HELPERS}:keep_tokens",)

    def shape(self, p: KeepParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, n, d = inputs["x"]
        if n != p.patches:
            raise ValueError(f"masks {p.patches} patches, got {n} tokens")
        return (b, p.keep, d)

    def code(self, p: KeepParams, args: Mapping[str, str]) -> str:
        return f"keep_tokens({args['x']}, {args['ids']}, {p.keep})"

    def label(self, p: KeepParams) -> tuple[str, ...]:
        return (f"visible: {p.keep} of {p.patches} patches",)


@dataclass(frozen=True)
class PatchMaskParams(Params):
    """The (B, N) mask, 1 where a patch was removed (its place in the shuffle is past the first ``keep``)."""

    keep: int


@op
class PatchMask(Op):
    kind = "patch_mask"
    params_type = PatchMaskParams
    helpers = (f"{_HELPERS}:masked_patches",)

    def code(self, p: PatchMaskParams, args: Mapping[str, str]) -> str:
        return f"masked_patches({args['x']}, {p.keep})"

    def label(self, p: PatchMaskParams) -> tuple[str, ...]:
        return ("1 = masked · 0 = visible",)


@dataclass(frozen=True)
class UnmaskParams(Params):
    """A learned mask token in every removed patch's place, the shuffle undone.

    Args:
        dim: width.
        patches: all patches N.
        prefix: leading tokens (the encoder's class token) kept in front.
    """

    dim: int
    patches: int
    prefix: int


@op
class Unmask(Op):
    kind = "unmask"
    params_type = UnmaskParams
    category = "embedding"
    module = "specvit.nn.masking:MaskTokens"
    ports = ("x", "ids_restore")
    required = ("x", "ids_restore")

    def shape(self, p: UnmaskParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, _, d = inputs["x"]
        if d != p.dim:
            raise ValueError(f"expects {p.dim} features, got {d}")
        return (b, p.prefix + p.patches, d)

    def params(self, p: UnmaskParams) -> int:
        return p.dim

    def ctor(self, p: UnmaskParams) -> dict[str, Any]:
        return {"dim": p.dim, "prefix": p.prefix}

    def init(self, module: nn.Module, p: UnmaskParams, fill: Filler) -> None:
        fill(module.mask_token, lambda t: t.normal_(std=0.02))  # MAE: normal(0.02)

    def label(self, p: UnmaskParams) -> tuple[str, ...]:
        return ("mask token in every masked place", "unshuffle by ids_restore")


@dataclass(frozen=True)
class DropPrefixParams(Params):
    """The tokens after the first ``prefix`` (the class token): the patches."""

    prefix: int


@op
class DropPrefix(Op):
    kind = "drop_prefix"
    params_type = DropPrefixParams
    helpers = (f"{_HELPERS}:drop_prefix",)

    def shape(self, p: DropPrefixParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, n, d = inputs["x"]
        assert isinstance(n, int)
        return (b, n - p.prefix, d)

    def code(self, p: DropPrefixParams, args: Mapping[str, str]) -> str:
        return f"drop_prefix({args['x']}, {p.prefix})"

    def label(self, p: DropPrefixParams) -> tuple[str, ...]:
        return (f"without the {p.prefix} prefix token{'s' * (p.prefix > 1)}",)


@dataclass(frozen=True)
class MaskedMseParams(Params):
    """MAE's loss: per-patch pixel MSE averaged over the masked patches.

    Args:
        patch: (ph, pw) patch size.
        norm_pix: the target patches normalised by their own mean and variance.
    """

    patch: tuple[int, int]
    norm_pix: bool


@op
class MaskedMse(Op):
    kind = "masked_mse"
    params_type = MaskedMseParams
    category = "head"
    ports = ("x", "images", "mask")
    required = ("x", "images", "mask")
    helpers = (f"{_HELPERS}:masked_patch_mse",)

    def shape(self, p: MaskedMseParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return ()

    def code(self, p: MaskedMseParams, args: Mapping[str, str]) -> str:
        return f"masked_patch_mse({args['x']}, {args['images']}, {args['mask']}, {p.patch!r}, {p.norm_pix!r})"

    def label(self, p: MaskedMseParams) -> tuple[str, ...]:
        return ("pixel MSE on masked patches" + (" · normalised pixels" if p.norm_pix else ""),)


# -------------------------------------------------------------------------------------- fragments


class MaskingSpec(Fragment):
    """Random masking of the patch tokens (MAE): only the visible ones (and the prefix) enter the blocks.

    Per sample, the patches are ordered by the argsort of uniform noise (the forward's optional ``noise``
    argument, (B, N), makes it reproducible) and the first ``int(N * (1 - ratio))`` stay visible. Positions
    are added before the masking; the decoder (``input: unmask``) puts the removed patches back.
    """

    ratio: float = Field(gt=0.0, lt=1.0, description="The fraction of patches removed (MAE: 0.75).")

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        role = at.split(".")[0]
        if stack.input.kind != "image" or stack.hierarchical:
            return [
                Problem(at, "masking removes image patches", "use masking in a plain stack of image input")
            ]
        out = []
        n = stack.input.num_patches
        keep = keep_count(n, self.ratio)
        if not 1 <= keep < n:
            out.append(
                Problem(
                    f"{at}.ratio",
                    f"ratio {self.ratio} keeps {keep} of {n} patches",
                    "use a ratio that keeps at least one patch and masks at least one",
                )
            )
        dec = spec.decoder
        if role != "encoder" or spec.model != "encoder_decoder" or dec is None or dec.input.kind != "unmask":
            out.append(
                Problem(
                    at,
                    "the masked patches are put back by a decoder with input: unmask",
                    "use masking in the encoder of an encoder_decoder whose decoder has input: {kind: unmask}",
                )
            )
        out += [
            Problem(
                f"{role}.position",
                f"{p.kind} positions do not follow the tokens through the masking",
                "use sincos2d (MAE) or learned with include_prefix: false",
            )
            for p in stack.positions
            if p.kind != "none" and p.phase() != "before_prefix"
        ]
        return out

    def lower(self, ctx: StackCtx) -> None:
        """The masking nodes, after the positions and before the prefix tokens; leaves the visible tokens."""
        role, n = ctx.role, ctx.n
        assert isinstance(n, int)
        keep = keep_count(n, self.ratio)
        src = f"{role}.masking"
        noise = ctx.placeholder(
            f"{role}.noise",
            "noise",
            ("B", n),
            required=False,
            what="masking noise",
            stack=role,
            group=1,
            source=src,
        )
        ids = ctx.add(f"{role}.shuffle", "shuffle", ShuffleParams(), {"x": ctx.x, "noise": noise}, source=src)
        restore = ctx.add(f"{role}.restore", "restore_ids", RestoreParams(), {"x": ids}, source=src)
        ctx.add(f"{role}.mask", "patch_mask", PatchMaskParams(keep), {"x": restore}, source=src)
        ctx.x = ctx.add(
            f"{role}.keep", "keep_tokens", KeepParams(keep, n), {"x": ctx.x, "ids": ids}, source=src
        )
        ctx.n, ctx.grid = keep, None  # the visible tokens are no grid


@fragment("input")
class UnmaskInput(InputFragment):
    """MAE's decoder input: the encoder's tokens projected to the decoder width, a learned mask token put
    in every masked patch's place and the shuffle undone, the encoder's class token kept in front.

    The decoder's tokens are the encoder's prefix tokens and all its patches, on its patch grid (a
    ``sincos2d`` position gives the prefix tokens the zero position, as MAE).
    """

    kind: Literal["unmask"] = Field(
        description="Discriminator: the masked encoder's tokens with mask tokens put back (a decoder's input)."
    )
    reads_encoder: ClassVar[bool] = True  # the decoder needs no cross-attention to read the encoder

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        enc = spec.encoder
        if (
            spec.model != "encoder_decoder"
            or at.split(".")[0] != "decoder"
            or enc is None
            or enc.masking is None
        ):
            return [
                Problem(
                    f"{at}.kind",
                    "an unmask input puts back the patches an encoder's masking removed",
                    "use input: unmask in the decoder of an encoder_decoder whose encoder has masking: {ratio: ...}",
                )
            ]
        out = []
        if spec.head.kind != "patches":
            out.append(
                Problem(
                    "head.kind",
                    "an unmask decoder's output is the pixels of every patch and the mask",
                    "use head: {kind: patches, loss: masked_mse}",
                )
            )
        if stack.num_prefix:
            out.append(
                Problem(
                    "decoder.prefix",
                    "an unmask decoder carries the encoder's prefix tokens; it has none of its own",
                    "remove decoder.prefix",
                )
            )
        out += [
            Problem(
                "decoder.position",
                f"{p.kind} positions do not apply to an unmask decoder",
                "use sincos2d (MAE) or none",
            )
            for p in stack.positions
            if p.kind not in ("sincos2d", "none")
        ]
        return out

    def lower(self, ctx: StackCtx) -> None:
        role, enc = ctx.role, ctx.spec.encoder
        assert enc is not None  # an unmask decoder reads an encoder (a rule of its own)
        memory = ctx.side["memory"]
        dm = ctx.shape(memory)[-1]
        assert isinstance(dm, int)
        src = f"{role}.input"
        x = ctx.add(f"{role}.embed", "linear", LinearParams(dm, ctx.stack.width), {"x": memory}, source=src)
        p = UnmaskParams(ctx.stack.width, enc.input.num_patches, enc.facts.num_prefix)
        ctx.x = ctx.add(
            f"{role}.unshuffle", "unmask", p, {"x": x, "ids_restore": "encoder.restore"}, source=src
        )
        ctx.n, ctx.grid = enc.facts.num_prefix + enc.input.num_patches, enc.input.grid


def lower_pixel_loss(ctx: ModelCtx, pred: str, loss: bool, norm_pix: bool) -> dict[str, str]:
    """The outputs of a patches head on a masked model: ``loss`` (if asked), ``logits``, ``mask``,
    ``ids_restore``; ``pred`` is the (B, N, P) pixel prediction."""
    enc = ctx.spec.encoder
    assert enc is not None  # a masked model has an encoder
    out = {}
    if loss:
        p = MaskedMseParams(enc.input.patch, norm_pix)
        srcs = {"x": pred, "images": "encoder.input", "mask": "encoder.mask"}
        out["loss"] = ctx.add(
            "head.loss", "masked_mse", p, srcs, source="head.loss", stack="head", scope="head"
        )
    return out | {"logits": pred, "mask": "encoder.mask", "ids_restore": "encoder.restore"}
