"""Output heads: what a spec writes under ``head:`` and the nodes each kind becomes, ending at the output."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import (
    MAX_VOCAB,
    Dims,
    Fragment,
    ModelCtx,
    Op,
    Params,
    Shape,
    fragment,
    linear_flops,
    numel,
    op,
)
from specvit.ops.conv import MapOps, lower_map_ops, map_ops_problems
from specvit.ops.embed import LinearParams
from specvit.ops.facts import SpecView, StackView
from specvit.ops.fields import Probability
from specvit.ops.head_ops import HeadOps, head_ops_width, lower_head_ops
from specvit.ops.maps import MapPoolParams, ToMapParams
from specvit.ops.masking import DropPrefixParams, lower_pixel_loss
from specvit.ops.norm import NormParams
from specvit.ops.pool import PoolParams
from specvit.ops.probe import Probe, lower_probe
from specvit.ops.structure import DropParams, OutputParams, ScaleParams, SoftcapParams

__all__ = ["BASE_OUTPUTS", "BoxMlpParams", "HeadFragment", "MapHead", "MapHeadBase", "PoolParams"]

BASE_OUTPUTS = ("last_hidden_state", "pooler_output")
"""The outputs of a classifier head with ``tokens: true``, named as transformers' base models name them."""


class HeadFragment(Fragment):
    """Base of the ``head:`` kinds."""

    kind: str

    def lower(self, ctx: ModelCtx, x: str, stack: StackView, mask: str | None) -> None:
        """Add the head's nodes reading the output stack's tokens ``x`` (and padding ``mask``), and the output."""
        raise NotImplementedError


def _add(
    ctx: ModelCtx, path: str, kind: str, p: Params, srcs: Mapping[str, str], source: str = "head"
) -> str:
    return ctx.add(path, kind, p, srcs, source=source, stack="head", scope="head")


def _output(ctx: ModelCtx, srcs: Mapping[str, str], keys: tuple[str, ...] = ()) -> None:
    """The model's output node: the head's value (or dict), with the outputs the stacks add beside it
    (``router_loss``) turning a single value into ``logits``."""
    extra = {
        name: _add(ctx, f"head.{name}", kind, p, {"x": src}) for name, (src, kind, p) in ctx.outputs.items()
    }
    if extra and not keys:
        srcs, keys = {"logits": srcs["x"]}, ("logits",)
    ctx.add("output", "output", OutputParams((*keys, *extra)), {**srcs, **extra}, stack="head", scope="")


def _fc(ctx: ModelCtx, x: str, d_out: int, bias: bool, **extra: Any) -> str:
    d_in = ctx.shape(x)[-1]
    assert isinstance(d_in, int)
    p = LinearParams(d_in, d_out, bias, zero_init=ctx.spec.init == "vit", **extra)
    return _add(ctx, "head.fc", "linear", p, {"x": x})


@fragment("head")
class ClassifierHead(HeadFragment):
    """Pool the tokens, then a linear classifier."""

    kind: Literal["classifier"] = Field(description="Discriminator: a classification head.")
    classes: int | None = Field(
        ge=1,
        le=MAX_VOCAB,
        description="Number of classes; null = no classifier, the pooled features out (timm's num_classes=0, "
        "a SigLIP tower's pooler_output).",
    )
    pool: Literal["cls", "first", "mean", "cls_mean", "eos", "last_eos", "last", "attention"] = Field(
        "cls",
        description="cls: the class token; first: the first token of the input (BERT's [CLS], RoBERTa's <s>: "
        "a token, not a prefix); mean: average of the other tokens; cls_mean: the class token and that "
        "average side by side, twice the width (DINOv2's classifier); eos: the end-of-text token "
        "(CLIP's text tower; with bias: false the head is CLIP's text projection); last_eos: its last "
        "occurrence (BART's, T5's *ForSequenceClassification: the decoder's token at the source's last eos); "
        "last: the last token that is not padding (a decoder's sequence classifier); attention: a learned "
        "probe attends over the tokens, then a pre-norm MLP (SigLIP's head, timm's global_pool='map').",
    )
    probe: Probe | None = Field(
        None, description="pool attention: the probe's heads and MLP width; null = the last block's."
    )
    eos_id: int | None = Field(
        None, ge=0, le=MAX_VOCAB, description="pool eos, last_eos: the end id; null = the highest id (CLIP)."
    )
    norm: bool = Field(False, description="A norm between pooling and the classifier (timm's fc_norm).")
    ops: HeadOps = Field(
        default_factory=list,
        description="Layers between pooling (and its norm) and the classifier, in order: linear, act and norm "
        "items (BERT's pooler: [{kind: linear}, {kind: act, fn: tanh}]).",
    )
    bias: bool = Field(True, description="Bias in the classifier.")
    dropout: Probability = Field(0.0, description="Dropout before the classifier.")
    tokens: bool = Field(
        False,
        description="Return the final token features beside the pooled ones, as transformers' base models do "
        "(BertModel, ViTModel, CLIPVisionModel): the output is {last_hidden_state: (B, N, D), pooler_output: "
        "(B, D')}; needs classes: null.",
    )

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        if self.tokens and self.classes is not None:
            why = f"tokens returns the token features beside the pooled ones, and classes: {self.classes} adds logits"
            return [Problem("head.tokens", why, "set classes: null, or remove tokens")]
        if self.probe is not None and self.pool != "attention":
            why = f"probe sets the attention pool, and this head pools by {self.pool}"
            return [Problem("head.probe", why, "set pool: attention, or remove probe")]
        if self.pool == "attention":
            return (self.probe or Probe()).problems(stack)
        if self.pool in ("eos", "last_eos") and (stack.input.kind != "tokens" or stack.num_prefix):
            return [
                Problem(
                    "head.pool",
                    f"pool {self.pool} picks the end-of-text token of a token input without prefix tokens",
                    "use pool: cls or mean",
                )
            ]
        if self.pool == "cls_mean" and (self.norm or self.ops):
            where = "head.norm" if self.norm else "head.ops"
            why = "pool cls_mean is twice the width the head's norm and layers take"
            return [Problem(where, why, f"remove {where}, or use pool: cls or mean")]
        if self.pool in ("cls", "cls_mean") and not stack.prefix.cls:
            return [
                Problem(
                    "head.pool",
                    f"pool {self.pool} needs a class token",
                    f"set {spec.output_stack}.prefix.cls: true, or use pool: mean",
                )
            ]
        return []

    def lower(self, ctx: ModelCtx, x: str, stack: StackView, mask: str | None) -> None:
        tokens = x
        if self.pool == "attention":
            x = lower_probe(ctx, x, stack, mask, self.probe or Probe())
        else:
            srcs = {"x": x} | ({"mask": mask} if mask and self.pool in ("mean", "cls_mean", "last") else {})
            if self.pool in ("eos", "last_eos"):  # the ids given: an encoder's, where a decoder shifts them
                srcs["ids"] = stack.input.ids(ctx.spec.output_stack)
            p = PoolParams(self.pool, stack.num_prefix, self.eos_id)
            x = _add(ctx, "head.pool", "pool", p, srcs, "head.pool")
        if self.norm:
            n, d = stack.block.norm, stack.out_width
            x = _add(ctx, "head.norm", n.kind, NormParams.of(n, d), {"x": x}, "head.norm")
        x = lower_head_ops(ctx, x, self.ops, stack)
        if self.dropout:
            x = _add(ctx, "head.drop", "dropout", DropParams(self.dropout), {"x": x}, "head.dropout")
        if self.tokens:  # a rule: no classifier
            _output(ctx, {"last_hidden_state": tokens, "pooler_output": x}, BASE_OUTPUTS)
            return
        _output(ctx, {"x": x if self.classes is None else _fc(ctx, x, self.classes, self.bias)})


@fragment("head")
class LMHead(HeadFragment):
    """A linear layer from every token to vocabulary logits."""

    kind: Literal["lm"] = Field(description="Discriminator: a language-model head.")
    vocab: int | None = Field(None, ge=1, le=MAX_VOCAB, description="Output vocabulary; null = the input's.")
    tied: bool = Field(False, description="Share the weight with the token embedding.")
    bias: bool = Field(False, description="Bias in the output layer.")
    ops: HeadOps = Field(
        default_factory=list,
        description="Layers on every token before the output layer, in order: linear, act and norm items "
        "(BERT's masked-LM transform: [{kind: linear}, {kind: act, fn: gelu}, {kind: norm}]).",
    )
    scale: float | None = Field(
        None,
        gt=0.0,
        le=100.0,
        description="Multiply the tokens by this before the head (T5 tied: width**-0.5).",
    )
    softcap: float | None = Field(
        None,
        gt=0.0,
        le=1000.0,
        description="Soft-cap the logits: softcap * tanh(logits / softcap) (Gemma 2: 30); null = none.",
    )

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        if stack.input.kind != "tokens":
            return [
                Problem(
                    "head.kind",
                    f"an lm head needs a token input, and the {spec.output_stack} reads {stack.input.kind}",
                    "use a classifier or none head, or a tokens input",
                )
            ]
        if self.tied and self.vocab is not None and self.vocab != stack.input.vocab:
            return [
                Problem(
                    "head.vocab",
                    f"a tied lm head has the embedding's vocab {stack.input.vocab}, not {self.vocab}",
                    "remove head.vocab, or set tied: false",
                )
            ]
        width = head_ops_width(self.ops, stack.out_width)  # without ops, a rule of embed_width says it
        if self.tied and self.ops and width != stack.embedding_width:
            return [
                Problem(
                    "head.ops",
                    f"a tied lm head reads features as wide as the embedding ({stack.embedding_width}), and "
                    f"gets {width}",
                    f"end head.ops with a linear layer of width {stack.embedding_width}, or set tied: false",
                )
            ]
        return []

    def lower(self, ctx: ModelCtx, x: str, stack: StackView, mask: str | None) -> None:
        spec = ctx.spec
        owner = "encoder" if spec.shared_embeddings else spec.output_stack
        tied = f"{owner}.tok_embed" if self.tied else None
        if self.scale is not None:
            x = _add(ctx, "head.scale", "scale", ScaleParams(self.scale), {"x": x}, "head.scale")
        x = lower_head_ops(ctx, x, self.ops, stack)
        logits = _fc(ctx, x, self.vocab or stack.input.vocab, self.bias, tied_to=tied)
        if self.softcap is not None:
            p = SoftcapParams(self.softcap)
            logits = _add(ctx, "head.softcap", "softcap", p, {"x": logits}, "head.softcap")
        _output(ctx, {"x": logits})


@dataclass(frozen=True)
class BoxMlpParams(Params):
    """DETR's box regressor: ``layers`` linear layers of the width with ReLUs between, to 4, then a sigmoid."""

    dim: int
    layers: int


@op
class BoxMlp(Op):
    kind = "box_mlp"
    params_type = BoxMlpParams
    category = "head"
    module = "specvit.nn.heads:BoxMlp"

    def shape(self, p: BoxMlpParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return (*inputs["x"][:-1], 4)

    def params(self, p: BoxMlpParams) -> int:
        return (p.layers - 1) * (p.dim * p.dim + p.dim) + 4 * p.dim + 4

    def flops(self, p: BoxMlpParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        tokens = numel(inputs["x"])
        return (p.layers - 1) * linear_flops(tokens, p.dim, p.dim) + linear_flops(tokens, p.dim, 4)

    def label(self, p: BoxMlpParams) -> tuple[str, ...]:
        return (f"{p.layers} layers · sigmoid · (cx, cy, w, h)",)


@fragment("head")
class DetectionHead(HeadFragment):
    """DETR's heads on every query: class logits (classes + 'no object') and a box MLP with a sigmoid."""

    kind: Literal["detection"] = Field(description="Discriminator: per-query class logits and boxes.")
    classes: int = Field(
        ge=1, le=MAX_VOCAB, description="Object classes; the logits add one 'no object' class."
    )
    box_layers: int = Field(3, ge=1, le=8, description="Layers of the box MLP (hidden width = the model's).")

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        if spec.model == "encoder":
            return [
                Problem(
                    "head.kind",
                    "a detection head predicts per query of a decoder",
                    "use model: encoder_decoder with a queries decoder (DETR)",
                )
            ]
        return []

    def lower(self, ctx: ModelCtx, x: str, stack: StackView, mask: str | None) -> None:
        d = stack.out_width
        logits = _add(
            ctx, "head.class_embed", "linear", LinearParams(d, self.classes + 1), {"x": x}, "head.classes"
        )
        boxes = _add(
            ctx, "head.bbox_embed", "box_mlp", BoxMlpParams(d, self.box_layers), {"x": x}, "head.box_layers"
        )
        _output(ctx, {"logits": logits, "boxes": boxes}, ("logits", "boxes"))


@fragment("head")
class PatchesHead(HeadFragment):
    """Pixels per token (CroCo, MAE): a linear layer from every patch token to patch x patch x channels values.

    The patch size and channels are the image input's (the encoder's for a siamese or unmask decoder).
    After an unmask decoder (MAE) the class token is left out, and the model returns ``logits`` (B, N, P),
    ``mask`` and ``ids_restore``, and with ``loss: masked_mse`` the ``loss``.
    """

    kind: Literal["patches"] = Field(description="Discriminator: per-patch pixel predictions.")
    bias: bool = Field(True, description="Bias in the prediction layer.")
    loss: Literal["none", "masked_mse"] = Field(
        "none",
        description="masked_mse (MAE): the mean squared pixel error of the masked patches, returned as `loss`; "
        "needs an unmask decoder.",
    )
    norm_pix: bool = Field(
        False,
        description="masked_mse against each patch normalised by its mean and variance (MAE's norm_pix_loss).",
    )

    @staticmethod
    def _image(stack: StackView, spec: SpecView) -> Any:
        return spec.encoder if stack.input.kind in ("siamese", "unmask") else stack

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        image = self._image(stack, spec)
        if image is None or image.input.kind != "image" or image.hierarchical:
            reads = stack.input.kind if not stack.hierarchical else "merged patches"
            return [
                Problem(
                    "head.kind",
                    f"a patches head predicts pixels per image patch, and the {spec.output_stack} reads {reads}",
                    "use a plain image stack, or a siamese decoder, or another head",
                )
            ]
        if image.input.stem or image.input.patch is None:
            return [
                Problem(
                    f"{spec.output_stack if image is stack else 'encoder'}.input.stem",
                    "a patches head predicts the pixels of each patch, and after a stem a token covers more",
                    "remove the stem, or use another head",
                )
            ]
        if stack.num_prefix and image is stack:  # a siamese decoder's prefix is refused by its own rule
            return [
                Problem(
                    f"{spec.output_stack}.prefix",
                    "a patches head predicts every token, and prefix tokens are no patches",
                    "remove the class and register tokens",
                )
            ]
        if (self.loss != "none" or self.norm_pix) and stack.input.kind != "unmask":
            key = "head.loss" if self.loss != "none" else "head.norm_pix"
            return [Problem(key, "the masked loss needs the masked patches", "use an unmask decoder (MAE)")]
        return []

    def lower(self, ctx: ModelCtx, x: str, stack: StackView, mask: str | None) -> None:
        image = self._image(stack, ctx.spec).input
        (ph, pw), c = image.patch, image.channels
        if stack.input.kind != "unmask":
            _output(ctx, {"x": _fc(ctx, x, ph * pw * c, self.bias)})
            return
        encoder = ctx.spec.encoder
        assert encoder is not None  # an unmask decoder reads an encoder (a rule of its own)
        prefix = encoder.facts.num_prefix
        if prefix:
            x = _add(ctx, "head.patches", "drop_prefix", DropPrefixParams(prefix), {"x": x})
        pred = _fc(ctx, x, ph * pw * c, self.bias)
        outs = lower_pixel_loss(ctx, pred, self.loss == "masked_mse", self.norm_pix)
        _output(ctx, outs, tuple(outs))


@fragment("head")
class NoHead(HeadFragment):
    """No head: the model returns the final token features."""

    kind: Literal["none"] = Field(description="Discriminator: features out.")

    def lower(self, ctx: ModelCtx, x: str, stack: StackView, mask: str | None) -> None:
        _output(ctx, {"x": x})


class MapHeadBase(HeadFragment):
    """The tokens of the patch grid as a (B, C, rows, cols) map through :meth:`layers`, optionally averaged
    and classified: the base of the ``map`` head and its shorthands (SAM's ``neck``)."""

    pool: Literal["none", "mean"] = Field(
        "none",
        description="none: the map (B, C, H, W); mean: its average over positions (B, C), as timm's "
        "global_pool='avg'.",
    )
    classes: int | None = Field(
        None, ge=1, le=MAX_VOCAB, description="A linear classifier after pool: mean; null: none."
    )

    path: ClassVar[str] = "ops"
    """The layers' nodes are ``head.{path}.{i}``, written at spec key ``source``."""
    source: ClassVar[str] = "head.ops"

    def layers(self) -> list[Any]:
        """The layers over the map."""
        raise NotImplementedError

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        from specvit.ops.inputs import ImageInput

        if not isinstance(stack.input, ImageInput) or stack.num_prefix:
            return [
                Problem(
                    "head.kind",
                    f"a {self.kind} head maps the patch grid of an image stack without prefix tokens",
                    "use an image input, no class or register tokens; or another head",
                )
            ]
        if self.classes is not None and self.pool != "mean":
            return [Problem("head.classes", "a classifier reads one vector per image", "set pool: mean")]
        grid = stack.out_grid
        assert grid is not None  # an image input, checked above
        return map_ops_problems(self.source, self.layers(), stack.out_width, grid)

    def lower(self, ctx: ModelCtx, x: str, stack: StackView, mask: str | None) -> None:
        grid = stack.facts.out_grid
        assert grid is not None  # a map head reads an image stack (its rule)
        x = _add(ctx, "head.map", "to_map", ToMapParams(grid), {"x": x})
        x = lower_map_ops(ctx, x, self.layers(), f"head.{self.path}", self.source, "head")
        if self.pool == "mean":
            x = _add(ctx, "head.pool", "map_pool", MapPoolParams(), {"x": x}, "head.pool")
        if self.classes is not None:
            x = _fc(ctx, x, self.classes, True)
        _output(ctx, {"x": x})


@fragment("head")
class MapHead(MapHeadBase):
    """The tokens of the patch grid as a (B, C, rows, cols) map through layers of their own (convs, norms,
    activations, pooling), optionally averaged and classified."""

    kind: Literal["map"] = Field(
        description="Discriminator: the tokens as a (B, C, H, W) map through layers."
    )
    ops: MapOps = Field(
        default_factory=list,
        description="The layers over the map, in order: conv, norm, act and pool items, as an input's stem.",
    )

    def layers(self) -> list[Any]:
        return list(self.ops)
