"""Small layers: dropout, stochastic depth, LayerScale, and layers that use another module's weights.

Dim legend: B batch, N tokens, D width, H heads, Hkv kv heads, hd head dim, M memory tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from specvit.nn.linear import eager_cpu_float32, onednn_linear


class _UniformDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, p: float) -> Tensor:
        keep = torch.rand_like(x) >= p  # (x.shape) bool: each element kept with probability 1 - p
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)  # type: ignore[attr-defined]
        return x.mul(keep).mul_(ctx.scale)  # type: ignore[attr-defined]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None


class Dropout(nn.Dropout):
    """``nn.Dropout`` whose float32 training masks on CPU come from ``torch.rand_like(x) >= p``.

    The same distribution as ``nn.Dropout`` (each element kept with probability 1 - p, scaled by 1 / (1 - p)),
    from a different draw of the same generator: uniform draws and a comparison cost about half of CPU
    ``bernoulli_``, which took 15% of the encoder-decoder training step of docs/performance.md (this makes
    that step about 5% faster). Elsewhere (inference, other dtypes and devices, in-place, torch.compile and
    export, dispatch modes such as ``FlopCounterMode``) it is exactly ``nn.Dropout``.
    """

    def forward(self, x: Tensor) -> Tensor:
        if self.training and 0.0 < self.p < 1.0 and not self.inplace and eager_cpu_float32(x):
            return _UniformDropout.apply(x, self.p)
        return F.dropout(x, self.p, self.training, self.inplace)


def drops(module: nn.Module) -> bool:
    """Whether a dropout module drops anything: in training, with a probability above 0."""
    return module.training and getattr(module, "p", 0.0) > 0


class DropPath(nn.Module):
    """Stochastic depth: zero a whole residual branch per sample (timm's ``DropPath``).

    Kept samples are scaled by ``1 / (1 - prob)`` so the expectation is unchanged. The module is the
    identity in eval mode or when ``prob == 0``.

    Args:
        prob: probability of dropping the branch for a given sample, in [0, 1).
    """

    def __init__(self, prob: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"DropPath prob must be in [0, 1), got {prob}")
        self.prob = prob

    def forward(self, x: Tensor) -> Tensor:
        if self.prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)  # (B, 1, ..., 1)
        mask = x.new_empty(shape).bernoulli_(keep).div_(keep)
        return x * mask

    def extra_repr(self) -> str:
        return f"prob={self.prob}"


class LayerScale(nn.Module):
    """Per-channel learnable scale of a residual branch (CaiT): ``x * gamma``.

    Args:
        dim: channel width D.
        init_value: initial value of every entry of ``gamma``.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        init_value: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.init_value = init_value
        self.gamma = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))  # (D,)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fill ``gamma`` with ``init_value``."""
        nn.init.constant_(self.gamma, self.init_value)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma

    def extra_repr(self) -> str:
        return f"dim={self.gamma.shape[0]}, init_value={self.init_value}"


class Shared(nn.Module):
    """Applies another module, its weights included (a decoder reusing the encoder's token embedding, CroCo's
    ``decoder_embed`` applied to the memory too); owns no parameters.

    Args:
        source: the module that owns the weights.
    """

    def __init__(self, source: nn.Module):
        super().__init__()
        self._source = (source,)  # a tuple, so the source is not registered (and saved) twice

    @property
    def source(self) -> nn.Module:
        return self._source[0]

    def forward(self, x: Tensor) -> Tensor:
        return self.source(x)


class TiedLinear(nn.Module):
    """Output layer sharing a token embedding's (V, D) weight: ``x @ E^T (+ bias)``.

    Args:
        source: the embedding whose weight is used.
        bias: add a learned (V,) bias.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        source: nn.Embedding,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self._source = (source,)
        vocab = source.num_embeddings
        self.bias = nn.Parameter(torch.zeros(vocab, device=device, dtype=dtype)) if bias else None

    @property
    def weight(self) -> Tensor:
        return self._source[0].weight

    def forward(self, x: Tensor) -> Tensor:
        return onednn_linear(x, self.weight, self.bias)  # (B, S, V)


def lender(module: nn.Module) -> nn.Module | None:
    """The module whose weights ``module`` applies without owning them (a :class:`Shared` layer's source, a
    :class:`TiedLinear` head's embedding), or None."""
    return module._source[0] if isinstance(module, Shared | TiedLinear) else None
