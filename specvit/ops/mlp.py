"""The position-wise feed-forward op: a two-layer MLP or a gated (GLU) one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specvit.ops.base import Op, Params, linear_flops, numel, op
from specvit.ops.norm import norm_params

__all__ = ["ACTIVATIONS", "GATED", "MlpParams"]

ACTIVATIONS = (
    "gelu", "gelu_tanh", "quick_gelu", "relu", "relu2", "silu", "xielu", "swiglu", "geglu", "geglu_tanh"
)  # fmt: skip
"""``mlp.activation`` values: exact GELU, GPT-2's tanh GELU, CLIP's x·sigmoid(1.702x), ReLU, squared ReLU
(Primer, Nemotron), SiLU, xIELU (Apertus: two learned scalars per MLP), and the gated SwiGLU / GeGLU (exact or
tanh GELU gate, T5 v1.1)."""
GATED = ("swiglu", "geglu", "geglu_tanh")


@dataclass(frozen=True)
class MlpParams(Params):
    """``fc2(act(fc1(x)))``, or ``fc2(act(gate) * value)`` with ``fc1`` packing [gate; value] when gated.

    Args:
        dim: input and output width.
        hidden: hidden width (of the gate and of the value each, when gated).
        activation: one of :data:`ACTIVATIONS`.
        bias: biases in both layers.
        dropout: dropout after the activation and after ``fc2``.
        norm: the kind of a norm on the hidden activations before ``fc2`` (NormFormer; EVA-02's
            ``scale_mlp``), or None.
        norm_eps: its epsilon.
        norm_bias: its bias (layernorm).
        norm_affine: it has a learned weight.
        norm_unit_offset: it scales by ``1 + w``.
        dwconv: the (rows, cols) token grid of a depthwise 3x3 conv over the hidden activations between
            ``fc1`` and the activation (PVT v2's Mix-FFN), or None.
    """

    dim: int
    hidden: int
    activation: str = "gelu"
    bias: bool = True
    dropout: float = 0.0
    norm: str | None = None
    norm_eps: float = 1e-6
    norm_bias: bool = True
    norm_affine: bool = True
    norm_unit_offset: bool = False
    dwconv: tuple[int, int] | None = None

    @property
    def fc1_out(self) -> int:
        return 2 * self.hidden if self.activation in GATED else self.hidden


@op
class Mlp(Op):
    kind = "mlp"
    params_type = MlpParams
    category = "mlp"

    def module_for(self, p: MlpParams) -> str:
        return "specvit.nn.mlp:GluMlp" if p.activation in GATED else "specvit.nn.mlp:Mlp"

    def params(self, p: MlpParams) -> int:
        inner = norm_params(p.norm, p.hidden, p.norm_bias, p.norm_affine) if p.norm else 0
        conv = 10 * p.hidden if p.dwconv else 0  # a 3x3 kernel and a bias per channel
        act = 2 if p.activation == "xielu" else 0  # alpha_p and alpha_n
        return p.dim * p.fc1_out + p.fc1_out * p.bias + p.hidden * p.dim + p.dim * p.bias + inner + conv + act

    def flops(self, p: MlpParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        tokens = numel(inputs["x"])
        conv = 2 * tokens * p.hidden * 9 if p.dwconv else 0
        return linear_flops(tokens, p.dim, p.fc1_out) + linear_flops(tokens, p.hidden, p.dim) + conv

    def ctor(self, p: MlpParams) -> dict[str, Any]:
        inner: dict[str, Any] = {}
        if p.norm:
            inner = {"norm": p.norm, "norm_eps": p.norm_eps, "norm_bias": p.norm_bias}
            inner |= {} if p.norm_affine else {"norm_affine": False}
            inner |= {"norm_unit_offset": True} if p.norm_unit_offset else {}
        return {
            "dim": p.dim,
            "hidden": p.hidden,
            "activation": p.activation,
            "bias": p.bias,
            "dropout": p.dropout,
            **inner,
            **(
                {} if p.activation in GATED else {"dwconv": p.dwconv}
            ),  # stated when None: an ejected Mlp folds it
        }

    def label(self, p: MlpParams) -> tuple[str, ...]:
        drop = f" · dropout {p.dropout:g}" if p.dropout else ""
        line = f"hidden {p.hidden}{' · depthwise 3x3 conv' if p.dwconv else ''} · {p.activation}{drop}"
        return (line, f"inner {p.norm} (eps {p.norm_eps:g}) before fc2") if p.norm else (line,)
