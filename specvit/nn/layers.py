"""Small layers: stochastic depth, LayerScale, and layers that use another module's weights.

Dim legend: B batch, N tokens, D width, H heads, Hkv kv heads, hd head dim, M memory tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specvit.nn.linear import onednn_linear


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
