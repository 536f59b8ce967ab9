"""Mixture-of-experts MLPs (``mlp.moe``): a router node, the experts node, and the load-balancing loss.

An MoE MLP lowers to three nodes of its block: ``router`` (a linear layer, D -> E logits), ``mlp`` (the
experts, reading the tokens and the logits) and ``router_stats`` (this layer's routing added to the
running statistics, read by the next MoE layer). The model's output gains ``router_loss``, computed once
from the last statistics: a value a training loop adds to its loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specvit.ops.base import Dims, Filler, Op, Params, Shape, linear_flops, numel, op
from specvit.ops.block import BlockCtx
from specvit.ops.embed import LinearParams
from specvit.ops.mlp import GATED

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MoeParams", "RouterParams", "lower_moe"]


@dataclass(frozen=True)
class MoeParams(Params):
    """E expert MLPs, ``top_k`` per token (see :class:`specvit.nn.moe.MoeMlp`).

    Args:
        dim: input and output width.
        hidden: each expert's hidden width.
        experts: E.
        top_k: experts per token.
        activation: the experts' activation.
        normalize: the k routing weights rescaled to sum to 1.
        shared_hidden: hidden width of the shared expert, or None.
        shared_gate: the shared expert's output gated by a sigmoid per token.
    """

    dim: int
    hidden: int
    experts: int
    top_k: int
    activation: str
    normalize: bool = True
    shared_hidden: int | None = None
    shared_gate: bool = False

    def up(self, hidden: int) -> int:
        """The first layer's outputs of an expert of ``hidden`` width: gate and value when gated."""
        return 2 * hidden if self.activation in GATED else hidden

    def expert_params(self, hidden: int) -> int:
        return self.dim * self.up(hidden) + hidden * self.dim

    def expert_flops(self, tokens: int, hidden: int) -> int:
        return linear_flops(tokens, self.dim, self.up(hidden)) + linear_flops(tokens, hidden, self.dim)


@op
class Moe(Op):
    kind = "moe"
    params_type = MoeParams
    category = "mlp"
    module = "specvit.nn.moe:MoeMlp"
    ports = ("x", "logits")
    required = ("x", "logits")

    def params(self, p: MoeParams) -> int:
        shared = p.expert_params(p.shared_hidden) if p.shared_hidden else 0
        return p.experts * p.expert_params(p.hidden) + shared + p.dim * p.shared_gate

    def flops(self, p: MoeParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        """The active experts only: every token runs k of them (and the shared one)."""
        tokens = numel(inputs["x"])
        out = p.expert_flops(tokens * p.top_k, p.hidden)
        if p.shared_hidden:
            out += p.expert_flops(tokens, p.shared_hidden)
        return out + (linear_flops(tokens, p.dim, 1) if p.shared_gate else 0)

    def ctor(self, p: MoeParams) -> dict[str, Any]:
        args: dict[str, Any] = {"dim": p.dim, "hidden": p.hidden, "experts": p.experts, "top_k": p.top_k}
        args |= {"activation": p.activation, "normalize": p.normalize}
        if p.shared_hidden:
            args |= {"shared_hidden": p.shared_hidden, "shared_gate": p.shared_gate}
        return args

    def init(self, module: nn.Module, p: MoeParams, fill: Filler) -> None:
        fill.children(module)
        fill.matrices(module.fc1)
        fill.matrices(module.fc2)

    def note(self, p: MoeParams) -> str:
        shared = " and the shared expert" if p.shared_hidden else ""
        return f"mixture of experts: FLOPs count the {p.top_k} of {p.experts} experts each token runs{shared}"

    def label(self, p: MoeParams) -> tuple[str, ...]:
        lines = [
            f"{p.experts} experts · top {p.top_k}" + ("" if p.normalize else " · weights not renormalised")
        ]
        lines.append(f"hidden {p.hidden} · {p.activation} · FLOPs of {p.top_k} active")
        if p.shared_hidden:
            lines.append(f"+ shared expert {p.shared_hidden}" + (" · sigmoid gate" if p.shared_gate else ""))
        return tuple(lines)


@dataclass(frozen=True)
class RouterParams(Params):
    """The routing statistics of the load-balancing loss.

    Args:
        experts: E.
        top_k: experts per token.
    """

    experts: int
    top_k: int


@op
class RouterStats(Op):
    kind = "router_stats"
    params_type = RouterParams
    ports = ("logits", "stats", "mask")
    required = ("logits",)
    helpers = ("specvit.nn.moe:routing_stats",)

    def shape(self, p: RouterParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return (2, p.experts)

    def code(self, p: RouterParams, args: Mapping[str, str]) -> str:
        mask = f", mask={args['mask']}" if "mask" in args else ""
        return f"routing_stats({args['logits']}, {args.get('stats', 'None')}, {p.top_k}{mask})"

    def label(self, p: RouterParams) -> tuple[str, ...]:
        return (f"tokens and probability per expert · top {p.top_k} · padding left out",)


@op
class RouterLoss(Op):
    kind = "router_loss"
    params_type = RouterParams
    helpers = ("specvit.nn.moe:load_balancing_loss",)

    def shape(self, p: RouterParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return ()

    def code(self, p: RouterParams, args: Mapping[str, str]) -> str:
        return f"load_balancing_loss({args['x']}, {p.top_k})"

    def label(self, p: RouterParams) -> tuple[str, ...]:
        return ("load balancing over every MoE layer",)


def lower_moe(b: BlockCtx, x: str, name: str, hidden: int) -> str:
    """The router, experts and statistics nodes of the MoE MLP of block ``b`` reading ``x``; returns the
    experts' output. The model's ``router_loss`` output is read from the last statistics."""
    moe, mlp = b.spec.mlp.moe, b.spec.mlp
    source = f"{b.stack.role}.block.mlp.moe"
    router = b.add(
        b.beside(name, "mlp", "router"),
        "linear",
        LinearParams(b.dim, moe.experts, False),
        {"x": x},
        source=source,
    )
    p = MoeParams(
        b.dim,
        hidden,
        moe.experts,
        moe.top_k,
        mlp.activation,
        moe.normalize,
        moe.shared_hidden,
        moe.shared_gate,
    )
    out = b.add(name, "moe", p, {"x": x, "logits": router}, source=f"{b.stack.role}.block.mlp")
    outputs = b.stack.outputs
    srcs = {"logits": router} | ({"stats": outputs["router_loss"][0]} if "router_loss" in outputs else {})
    srcs |= {"mask": b.side["mask"]} if "mask" in b.side else {}  # padding tokens route nowhere
    route = RouterParams(moe.experts, moe.top_k)
    stats = b.add(b.beside(name, "mlp", "router_stats"), "router_stats", route, srcs, source=source)
    outputs["router_loss"] = (stats, "router_loss", route)
    return out
