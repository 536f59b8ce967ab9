"""Mixture-of-experts MLP: a router picks ``top_k`` of E expert MLPs per token (Mixtral, Qwen2-MoE), and
the load-balancing loss that keeps the router from favouring a few experts.

Dim legend: B batch, N tokens, D width, E experts, k experts per token, F expert hidden width, T = B * N.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import flop_registry, register_flop_formula

from specvit.nn.linear import Linear, tracked
from specvit.nn.mlp import GluActivation, MlpActivation, _activation, activate, build_mlp
from specvit.nn.regions import enter_region, leave_region, local

__all__ = ["MoeMlp", "expert_products", "load_balancing_loss", "route", "routing_stats"]


def route(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The router's choice for each token: softmax over the experts, then the ``top_k`` most likely.

    Args:
        logits: (T, E) router logits.
        top_k: experts per token.
        normalize: rescale the chosen probabilities to sum to 1 (Mixtral); else keep them (Qwen2-MoE's
            ``norm_topk_prob: false``).

    Returns:
        The (T, E) probabilities, the (T, k) weights of the chosen experts and their (T, k) indexes.
    """
    probs = logits.softmax(dim=-1)  # (T, E)
    weights, index = probs.topk(top_k, dim=-1)  # (T, k) each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, index


def routing_stats(logits: Tensor, stats: Tensor | None, top_k: int, mask: Tensor | None = None) -> Tensor:
    """Add one layer's routing to the running statistics of the load-balancing loss.

    Args:
        logits: (B, N, E) router logits of one layer.
        stats: (2, E) the statistics of the layers before (None for the first): per expert, the tokens
            routed to it (over all k choices) and the sum of its probabilities.
        top_k: experts per token.
        mask: (B, N) or, while decoding, (B, cached + N) padding mask, True = padding: padding tokens
            count for no expert (HF's ``attention_mask`` in ``load_balancing_loss_func``).

    Returns:
        (2, E) statistics including this layer.
    """
    flat = logits.flatten(0, -2)  # (T, E)
    probs, _, index = route(flat, top_k, normalize=False)
    chosen = (
        F.one_hot(index, flat.shape[-1]).sum(dim=1).to(probs.dtype)
    )  # (T, E): times each expert is picked
    if mask is not None:
        keep = (~mask[:, -logits.shape[1] :]).reshape(-1, 1).to(probs.dtype)  # (T, 1): the new tokens' rows
        chosen, probs = chosen * keep, probs * keep
    layer = torch.stack((chosen.sum(dim=0), probs.sum(dim=0)))  # (2, E)
    return layer if stats is None else stats + layer


def load_balancing_loss(stats: Tensor, top_k: int) -> Tensor:
    """The load-balancing loss of Switch Transformer / Mixtral over all MoE layers: E times the sum over
    experts of (the share of routed tokens) x (the mean probability), as HF's ``load_balancing_loss_func``.

    Args:
        stats: (2, E) from :func:`routing_stats` after the last MoE layer.
        top_k: experts per token.

    Returns:
        A scalar, top_k when the routing is uniform. Add it, times a coefficient (Mixtral: 0.02), to the loss.
    """
    rows = stats[0].sum() / top_k  # tokens over all layers
    return (stats[0] / rows * (stats[1] / rows)).sum() * stats.shape[-1]


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``F.grouped_mm`` as ``FlopCounterMode`` counts a matmul's (2 per multiply-add): each output
    element is one dot product over the inputs' last dim, and two 2-D inputs split that dim into the groups
    (the experts' weight gradients)."""
    k = a_shape[-1]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (M, K) x (K, N) -> (G, M, N), the groups' K summing to K
        return 2 * a_shape[0] * k * b_shape[1]
    return 2 * math.prod(out_shape) * k


if torch.ops.aten._grouped_mm not in flop_registry:  # torch counts none: a model's experts would cost nothing
    register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


def expert_products(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """Rows sorted by expert through their experts' matrices: ``x`` (S, K) holds ``counts[e]`` rows of
    expert e in turn, ``weight`` (E, N, K) stacks the experts' ``nn.Linear``-shaped weights; (S, N).

    On CPU one grouped product (``F.grouped_mm``) runs them all, forward and backward: 4-6% faster than a
    product per expert at the Mixtral size of ``python -m benchmarks`` (2-core Xeon), where it takes the
    rows: float32, bfloat16 or float16, a multiple of 16 bytes long. Elsewhere, a product per expert.

    Args:
        x: (S, K) the rows.
        weight: (E, N, K) the experts' weights.
        counts: the rows of each expert, summing to S.
    """
    grouped = x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.dtype == weight.dtype
    if x.device.type == "cpu" and grouped and x.shape[-1] * x.element_size() % 16 == 0:  # rows it takes
        offs = torch.tensor(list(accumulate(counts)), dtype=torch.int32)  # (E,) where each expert's rows end
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)  # (S, N)
    w = weight.unbind(0)  # one backward stacks every expert's gradient (weight[e] each would make a zero
    # gradient of the whole stack per expert)
    return torch.cat([F.linear(part, w[e]) for e, part in enumerate(x.split(counts))])  # (S, N)


class MoeMlp(nn.Module):
    """E expert MLPs of which a router runs ``top_k`` per token, their outputs weighted by the router; with
    a shared expert every token also passes through (Qwen2-MoE), optionally gated per token.

    The experts' weights are stacked: ``fc1`` (E, F or 2F, D) packs [gate; value] when gated, as HF's
    ``gate_up_proj``; ``fc2`` (E, D, F). Only the chosen experts run on each token.

    Split across ranks (:func:`specvit.parallel.parallelize`), ``fc1`` and ``fc2`` hold this rank's experts
    ``first_expert`` .. ``first_expert + fc1.shape[0] - 1``, and the routed outputs are summed over ``group``
    (the shared expert runs whole on every rank). One process: ``first_expert`` 0, ``group`` None.

    Args:
        dim: input and output width D.
        hidden: expert hidden width F.
        experts: E.
        top_k: k, experts per token.
        activation: an activation of :class:`~specvit.nn.mlp.Mlp` or a gated one of :class:`~specvit.nn.mlp.GluMlp`.
        normalize: rescale the k routing weights to sum to 1.
        shared_hidden: hidden width of a shared expert (an MLP of the same activation), or None.
        shared_gate: scale the shared expert's output by ``sigmoid(shared_gate(x))``.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int,
        top_k: int,
        activation: MlpActivation = "swiglu",
        *,
        normalize: bool = True,
        shared_hidden: int | None = None,
        shared_gate: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in 1..experts={experts}, got {top_k}")
        self.experts, self.top_k, self.normalize = experts, top_k, normalize
        self.first_expert = 0  # this rank's first expert, and the tensor-parallel group of the ranks
        self.group: dist.ProcessGroup | None = None
        self.gated = activation in get_args(GluActivation)
        self.act = _activation(activation)
        fc1_out = 2 * hidden if self.gated else hidden
        self.fc1 = nn.Parameter(torch.empty(experts, fc1_out, dim, device=device, dtype=dtype))
        self.fc2 = nn.Parameter(torch.empty(experts, dim, hidden, device=device, dtype=dtype))
        self.shared = (
            None
            if shared_hidden is None
            else build_mlp(dim, shared_hidden, activation, bias=False, device=device, dtype=dtype)
        )
        self.shared_gate = Linear(dim, 1, bias=False, device=device, dtype=dtype) if shared_gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices as ``nn.Linear`` initialises its weight."""
        for weight in (self.fc1, self.fc2):
            for e in range(self.experts):
                nn.init.kaiming_uniform_(weight[e], a=5**0.5)

    def forward(self, x: Tensor, *, logits: Tensor) -> Tensor:
        """Route each token of x: (B, N, D) to its experts by the router's (B, N, E) ``logits``."""
        flat = x.flatten(0, -2)  # (T, D)
        out = leave_region(
            self._routed(enter_region(flat, self.group), enter_region(logits, self.group)), self.group
        )
        if self.shared is not None:
            shared = self.shared(flat)  # (T, D)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view_as(x)  # (B, N, D)

    def _routed(self, flat: Tensor, logits: Tensor) -> Tensor:
        """The (T, D) outputs of this rank's experts (every expert on one process) for the (T, D) tokens.

        The T * k (token, choice) slots are sorted by expert, so each expert's tokens are one contiguous run:
        one gather, the experts' two products (:func:`expert_products`), the activation and the routing
        weights over all slots at once, one scatter back (a loop of gathers and index-adds per expert costs
        more than the products).
        """
        _, weights, index = route(logits.flatten(0, -2), self.top_k, self.normalize)  # (T, k) each
        fc1, fc2 = local(self.fc1), local(self.fc2)  # (E or E / ranks, F or 2F, D), (..., D, F)
        mine = fc1.shape[0]
        expert = (index - self.first_expert).flatten()  # (T * k,) this rank's expert of each slot
        expert = torch.where((expert >= 0) & (expert < mine), expert, mine)  # other ranks' experts: last
        order = torch.argsort(expert, stable=True)  # (T * k,) slots by expert
        counts = torch.bincount(expert, minlength=mine + 1).tolist()[:mine]  # one sync with the host
        used = order[: sum(counts)]  # the slots this rank's experts run
        token = torch.div(used, self.top_k, rounding_mode="floor")  # (S,) each slot's token
        x = flat[token]  # (S, D) sorted by expert
        h = expert_products(x, fc1, counts)  # (S, F or 2F)
        grads = tracked(h)  # else products are written over their inputs
        if self.gated:
            gate, value = h.chunk(2, dim=-1)
            h = activate(self.act, gate)
            h = h * value if grads else h.mul_(value)  # (S, F), untracked: a strided view of the gates
        else:
            h = activate(self.act, h)
        y = expert_products(h, fc2, counts)  # (S, D)
        routing = weights.flatten()[used, None]  # (S, 1) each slot's routing weight
        y = y * routing if grads else y.mul_(routing)  # (S, D)
        return torch.zeros_like(flat).index_add_(0, token, y)  # (T, D)

    def extra_repr(self) -> str:
        shared = (
            "" if self.shared is None else ", shared" + (" gated" if self.shared_gate is not None else "")
        )
        norm = "" if self.normalize else ", normalize=False"
        return f"experts={self.experts}, top_k={self.top_k}{norm}{shared}"
