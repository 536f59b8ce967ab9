"""Feed-forward blocks: plain two-layer MLP and gated (GLU) MLP.

Dim legend: B batch, N tokens, D width, H heads, Hkv kv heads, hd head dim, M memory tokens.
F below is the hidden width of the MLP.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import ClassVar, Literal, cast, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.nn.functional import to_map, to_tokens
from specvit.nn.layers import Dropout, drops
from specvit.nn.linear import Linear, autograd_recompute, hooked, recomputed_linear, recomputes, tracked
from specvit.nn.norm import make_norm

PlainActivation = Literal["gelu", "gelu_tanh", "quick_gelu", "relu", "relu2", "silu", "xielu"]
GluActivation = Literal["swiglu", "geglu", "geglu_tanh"]
MlpActivation = Literal[
    "gelu", "gelu_tanh", "quick_gelu", "relu", "relu2", "silu", "xielu", "swiglu", "geglu", "geglu_tanh"
]


class QuickGELU(nn.Module):
    """CLIP's GELU approximation ``x * sigmoid(1.702 * x)``."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


class ReLUSquared(nn.Module):
    """Primer's squared ReLU ``relu(x) ** 2`` (Nemotron)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.square(torch.relu(x))


class XIELU(nn.Module):
    """xIELU (Huang & Schlag 2024; Apertus): ``a_p x² + b x`` for x > 0, else
    ``a_n (expm1(min(x, eps)) - x) + b x``, with ``a_p = softplus(alpha_p)`` and ``a_n = b + softplus(alpha_n)``
    learned (initialised to 0.8 each) and ``beta`` (b, 0.5) and ``eps`` (-1e-6) buffers a checkpoint holds,
    as transformers' ``XIELUActivation`` names them."""

    INIT: ClassVar[dict[str, float]] = {
        "alpha_p": math.log(math.expm1(0.8)),
        "alpha_n": math.log(math.expm1(0.8 - 0.5)),
    }
    """The parameters' initial values: softplus of each is 0.8 - 0 and 0.8 - beta."""
    beta: Tensor
    eps: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.tensor([self.INIT["alpha_p"]]))  # (1,)
        self.alpha_n = nn.Parameter(torch.tensor([self.INIT["alpha_n"]]))  # (1,)
        self.register_buffer("beta", torch.tensor(0.5))
        self.register_buffer("eps", torch.tensor(-1e-6))

    def reset_buffers(self) -> None:
        """``beta`` and ``eps`` at their values (a meta-device build has none yet)."""
        with torch.no_grad():
            self.beta.fill_(0.5)
            self.eps.fill_(-1e-6)

    def forward(self, x: Tensor) -> Tensor:
        alpha_p = nn.functional.softplus(self.alpha_p)
        alpha_n = self.beta + nn.functional.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + self.beta * x


def _activation(name: str) -> nn.Module:
    if name in ("gelu", "geglu"):
        return nn.GELU()  # exact (erf) GELU
    if name in ("gelu_tanh", "geglu_tanh"):
        return nn.GELU(approximate="tanh")  # GPT-2's GELU, HF's gelu_new
    if name == "quick_gelu":
        return QuickGELU()
    if name == "relu":
        return nn.ReLU()
    if name == "relu2":
        return ReLUSquared()
    if name == "xielu":
        return XIELU()
    if name in ("silu", "swiglu"):
        return nn.SiLU()
    raise ValueError(f"unknown activation {name!r}; expected one of {get_args(MlpActivation)}")


_IN_PLACE: dict[type[nn.Module], Callable[[nn.Module, Tensor], Tensor]] = {
    nn.ReLU: lambda act, h: h.relu_(),
    nn.GELU: lambda act, h: torch.ops.aten.gelu_(h, approximate=cast(nn.GELU, act).approximate),
    nn.SiLU: lambda act, h: F.silu(h, inplace=True),
}


def activate(act: nn.Module, h: Tensor) -> Tensor:
    """``act(h)`` written over ``h`` where that is safe, else ``act(h)``.

    ``h`` must be a fresh product nothing else reads (``fc1``'s output or a view of it). ReLU always runs in
    place, since its backward reads its output; GELU and SiLU only when no gradient flows to ``h``, since
    theirs read their input. Hooks a call of ``act`` would run (its own or global) keep the module call. A
    new output costs the write of cold memory: a 6+6-layer encoder-decoder's eval forward was 2% slower with
    its ReLUs out of place.

    Args:
        act: the activation module (:func:`_activation`'s).
        h: its input, overwritten when the activation runs in place.
    """
    in_place = _IN_PLACE.get(type(act))
    if in_place is None or hooked(act) or (type(act) is not nn.ReLU and tracked(h)):
        return act(h)
    return in_place(act, h)


def _recomputes(h: Tensor, act: nn.Module, drop: nn.Module, norm: nn.Module | None, fc2: nn.Module) -> bool:
    """Whether an MLP's hidden activations ``drop(act(h))`` before ``fc2`` may be recomputed in the backward
    (:func:`~specvit.nn.linear.recomputed_linear`): ``act`` without parameters or hooks, and not ReLU (whose
    output, written over ``h`` by :func:`activate`, autograd already keeps once), no dropout dropping, no norm,
    and the conditions of ``recomputes`` on ``h`` and ``fc2``."""
    return (
        recomputes(h, fc2)
        and type(act) is not nn.ReLU
        and not any(True for _ in act.parameters())
        and not hooked(act)
        and not drops(drop)
        and norm is None
    )


def _glu(h: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    """``act(gate) * value`` of the packed (..., 2F) [gate; value]; (..., F)."""
    gate, value = h.chunk(2, dim=-1)  # (..., F) each
    return act(gate) * value


_BACKWARD_INTO: dict[type[nn.Module], Callable[[nn.Module, Tensor, Tensor, Tensor], object]] = {
    nn.SiLU: lambda act, grad, x, out: torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=out),
    nn.GELU: lambda act, grad, x, out: torch.ops.aten.gelu_backward.grad_input(
        grad, x, approximate=cast(nn.GELU, act).approximate, grad_input=out
    ),
}
"""Activations whose gradient torch writes into a given tensor: (act, grad of act(x), x, out)."""


def _glu_recompute(h: Tensor, act: nn.Module) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """:func:`_glu` of h again for the backward, and the map from its gradient to h's, which writes the gate's
    and the value's gradients into the halves of one (..., 2F) tensor, as autograd's ops compute them (autograd
    would write each, then concatenate them); see :func:`~specvit.nn.linear.recomputed_linear`."""
    backward_into = _BACKWARD_INTO.get(type(act))
    if backward_into is None:
        return autograd_recompute(functools.partial(_glu, act=act))(h)
    gate, value = h.chunk(2, dim=-1)  # (..., F) each
    activated = act(gate)

    def grad_of(grad: Tensor) -> Tensor:
        out = torch.empty_like(h)  # (..., 2F)
        grad_gate, grad_value = out.chunk(2, dim=-1)
        torch.mul(grad, activated, out=grad_value)
        backward_into(act, grad * value, gate, grad_gate)
        return out

    return activated * value, grad_of


def _dropout(p: float) -> nn.Module:
    return Dropout(p) if p > 0.0 else nn.Identity()


InnerNorm = Literal["layernorm", "rmsnorm"]


def _inner_norm(
    kind: InnerNorm | None,
    hidden: int,
    eps: float,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    **settings: bool,
) -> nn.Module | None:
    """The norm on the hidden activations before ``fc2`` (NormFormer, EVA-02), or None."""
    return None if kind is None else make_norm(kind, hidden, eps, device=device, dtype=dtype, **settings)


class Mlp(nn.Module):
    """Two-layer MLP ``fc2(act(fc1(x)))`` with timm submodule names; with ``dwconv``, PVT v2's Mix-FFN
    ``fc2(act(dwconv(fc1(x))))``, the depthwise conv over the hidden activations as a map of the token grid.

    Args:
        dim: input and output width D.
        hidden: hidden width F.
        activation: ``gelu`` (exact erf), ``gelu_tanh`` (tanh approximation), ``quick_gelu``, ``relu``,
            ``relu2`` (squared ReLU), ``silu`` or ``xielu`` (:class:`XIELU`, learned).
        bias: whether ``fc1`` and ``fc2`` have biases.
        dropout: dropout probability after the activation and after ``fc2``.
        norm: a norm on the hidden activations before ``fc2`` (``layernorm``, ``rmsnorm``), or None.
        norm_eps: its epsilon.
        norm_bias: its bias (layernorm).
        norm_affine: it has a learned weight.
        norm_unit_offset: it scales by ``1 + w``.
        dwconv: the (gh, gw) token grid of a depthwise 3x3 conv ``dwconv`` (with a bias) between ``fc1`` and
            the activation, or None.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: PlainActivation = "gelu",
        bias: bool = True,
        dropout: float = 0.0,
        norm: InnerNorm | None = None,
        norm_eps: float = 1e-6,
        norm_bias: bool = True,
        norm_affine: bool = True,
        norm_unit_offset: bool = False,
        dwconv: tuple[int, int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in get_args(PlainActivation):
            raise ValueError(f"Mlp activation must be one of {get_args(PlainActivation)}, got {activation!r}")
        self.activation = activation
        self.fc1 = Linear(dim, hidden, bias=bias, device=device, dtype=dtype)
        self.grid = dwconv
        if dwconv is not None:
            self.dwconv = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, device=device, dtype=dtype)
        self.act = _activation(activation)
        self.drop1 = _dropout(dropout)
        inner = {"bias": norm_bias, "affine": norm_affine, "unit_offset": norm_unit_offset}
        self.norm = _inner_norm(norm, hidden, norm_eps, device, dtype, **inner)
        self.fc2 = Linear(hidden, dim, bias=bias, device=device, dtype=dtype)
        self.drop2 = _dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)  # (B, N, F)
        if self.grid is not None:  # the hidden activations as a (B, F, gh, gw) map through the depthwise conv
            h = to_tokens(self.dwconv(to_map(h, self.grid)))  # (B, N, F)
        if _recomputes(h, self.act, self.drop1, self.norm, self.fc2):  # training: keep h, not act(h) too
            return self.drop2(recomputed_linear(h, self.act, self.fc2))  # (B, N, D)
        h = self.drop1(activate(self.act, h))  # (B, N, F)
        if self.norm is not None:
            h = self.norm(h)  # (B, N, F)
        return self.drop2(self.fc2(h))  # (B, N, D)


class GluMlp(nn.Module):
    """Gated MLP (SwiGLU / GeGLU): ``fc2(act(gate) * value)``.

    ``fc1`` is one packed Linear(D, 2F) whose first F outputs are the gate and last F the value.

    Args:
        dim: input and output width D.
        hidden: hidden width F (of the gate and of the value, each).
        activation: ``swiglu`` (SiLU gate), ``geglu`` (exact erf GELU gate) or ``geglu_tanh`` (tanh GELU gate).
        bias: whether ``fc1`` and ``fc2`` have biases.
        dropout: dropout probability after the gating product and after ``fc2``.
        norm: a norm on the hidden activations before ``fc2`` (``layernorm``, ``rmsnorm``), or None.
        norm_eps: its epsilon.
        norm_bias: its bias (layernorm).
        norm_affine: it has a learned weight.
        norm_unit_offset: it scales by ``1 + w``.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: GluActivation = "swiglu",
        bias: bool = True,
        dropout: float = 0.0,
        norm: InnerNorm | None = None,
        norm_eps: float = 1e-6,
        norm_bias: bool = True,
        norm_affine: bool = True,
        norm_unit_offset: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in get_args(GluActivation):
            raise ValueError(
                f"GluMlp activation must be one of {get_args(GluActivation)}, got {activation!r}"
            )
        self.fc1 = Linear(dim, 2 * hidden, bias=bias, device=device, dtype=dtype)
        self.act = _activation(activation)
        self.drop1 = _dropout(dropout)
        inner = {"bias": norm_bias, "affine": norm_affine, "unit_offset": norm_unit_offset}
        self.norm = _inner_norm(norm, hidden, norm_eps, device, dtype, **inner)
        self.fc2 = Linear(hidden, dim, bias=bias, device=device, dtype=dtype)
        self.drop2 = _dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)  # (B, N, 2F)
        if _recomputes(h, self.act, self.drop1, self.norm, self.fc2):  # training: keep h, not the gating's
            glu = functools.partial(_glu, act=self.act)
            recompute = functools.partial(_glu_recompute, act=self.act)
            return self.drop2(recomputed_linear(h, glu, self.fc2, recompute))  # (B, N, D)
        gate, value = h.chunk(2, dim=-1)  # (B, N, F) each
        h = self.drop1(activate(self.act, gate) * value)  # (B, N, F)
        if self.norm is not None:
            h = self.norm(h)  # (B, N, F)
        return self.drop2(self.fc2(h))  # (B, N, D)


def build_mlp(
    dim: int,
    hidden: int,
    activation: MlpActivation,
    bias: bool = True,
    dropout: float = 0.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build a :class:`GluMlp` for ``swiglu``/``geglu``, otherwise a :class:`Mlp`.

    Args:
        dim: input and output width D.
        hidden: hidden width F.
        activation: one of :data:`MlpActivation`.
        bias: whether the linear layers have biases.
        dropout: dropout probability inside the MLP.
        device: parameter device.
        dtype: parameter dtype.
    """
    if activation in get_args(GluActivation):
        glu = cast(GluActivation, activation)
        return GluMlp(dim, hidden, glu, bias=bias, dropout=dropout, device=device, dtype=dtype)
    if activation in get_args(PlainActivation):
        plain = cast(PlainActivation, activation)
        return Mlp(dim, hidden, plain, bias=bias, dropout=dropout, device=device, dtype=dtype)
    raise ValueError(f"unknown MLP activation {activation!r}; expected one of {get_args(MlpActivation)}")
