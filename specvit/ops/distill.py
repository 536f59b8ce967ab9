"""DeiT's distilled head (Touvron et al., 2021, "Training data-efficient image transformers & distillation
through attention"): ``head: {kind: distilled}`` puts one classifier on the class token and one on the
distillation token (``prefix: {distillation: true}``) and outputs their average, or, in training with
``distilled_training`` set on the output module (``model.head.merge``), both logits.

The whole definition: the spec fragment and the merge's op; the module is
:class:`specvit.nn.distill.DistilledLogits`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import MAX_VOCAB, Dims, ModelCtx, Op, Params, Shape, fragment, op
from specvit.ops.embed import LinearParams
from specvit.ops.facts import SpecView, StackView
from specvit.ops.fields import Probability
from specvit.ops.heads import HeadFragment
from specvit.ops.structure import DropParams, OutputParams, TokenParams

__all__ = ["DistilledHead", "MergeParams"]


@dataclass(frozen=True)
class MergeParams(Params):
    """The two classifiers' logits merged: averaged, or (training with ``distilled_training``) both."""


@op
class DistilledMerge(Op):
    kind = "distilled_merge"
    params_type = MergeParams
    category = "head"
    module = "specvit.nn.distill:DistilledLogits"
    ports = ("x", "dist")
    required = ("x", "dist")

    def shape(self, p: MergeParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        if inputs["x"] != inputs["dist"]:
            raise ValueError(f"the two heads' logits differ in shape: {inputs['x']} and {inputs['dist']}")
        return inputs["x"]

    def label(self, p: MergeParams) -> tuple[str, ...]:
        return ("(cls + distillation) / 2", "training with distilled_training: both")


@fragment("head")
class DistilledHead(HeadFragment):
    """DeiT's distilled head: a classifier on the class token and one on the distillation token, averaged."""

    kind: Literal["distilled"] = Field(
        description="Discriminator: DeiT's two classifiers, on the class and the distillation token."
    )
    classes: int = Field(ge=1, le=MAX_VOCAB, description="Number of classes (of both classifiers).")
    bias: bool = Field(True, description="Bias in both classifiers.")
    dropout: Probability = Field(0.0, description="Dropout before each classifier.")

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        if not (stack.prefix.cls and stack.prefix.distillation):
            return [
                Problem(
                    "head.kind",
                    "a distilled head reads the class token and the distillation token",
                    f"set {spec.output_stack}.prefix: {{cls: true, distillation: true}}, "
                    "or use a classifier head",
                )
            ]
        return []

    def lower(self, ctx: ModelCtx, x: str, stack: StackView, mask: str | None) -> None:
        def add(path: str, kind: str, p: Params, srcs: Mapping[str, str], source: str = "head") -> str:
            return ctx.add(path, kind, p, srcs, source=source, stack="head", scope="head")

        logits = {}
        for suffix, index, name in (("", 0, "class"), ("_dist", 1, "distillation")):
            t = add(f"head.pool{suffix}", "token", TokenParams(index, name), {"x": x})
            if self.dropout:
                t = add(f"head.drop{suffix}", "dropout", DropParams(self.dropout), {"x": t}, "head.dropout")
            fc = LinearParams(stack.out_width, self.classes, self.bias, zero_init=ctx.spec.init == "vit")
            logits[suffix] = add(f"head.fc{suffix}", "linear", fc, {"x": t})
        merged = add(
            "head.merge", "distilled_merge", MergeParams(), {"x": logits[""], "dist": logits["_dist"]}
        )
        ctx.add("output", "output", OutputParams(), {"x": merged}, stack="head", scope="")
