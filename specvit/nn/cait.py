"""CaiT's attention layers (Touvron et al. 2021, "Going deeper with Image Transformers"; timm ``cait.py``), as
configurations of the attention core (:class:`~specvit.nn.attention.Attention`), and the class-token helpers.

- :class:`TalkingHeadsAttention`: self-attention whose scores are mixed across heads by a learned
  H x H map before the softmax (``proj_l``) and again after it (``proj_w``) (Shazeer et al. 2020). The
  mixing sits between the two matmuls, so the core runs its math path.
- :class:`ClassAttention`: only the class token (the first token) forms a query; it attends over every
  token, itself included. The output is the class token's update, (B, 1, D).

Masks follow :mod:`specvit.nn.attention`: ``mask`` is (B, T) bool, True = padding key. In talking-heads
attention the mask and an additive bias apply to the mixed logits, just before the softmax, so a hidden key
gets no weight from any head.

Dim legend: B batch, N tokens, D width, H heads, hd head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specvit.nn.attention import Attention

__all__ = ["ClassAttention", "TalkingHeadsAttention", "class_token", "join_class_token"]


class TalkingHeadsAttention(Attention):
    """Multi-head self-attention with talking heads: the (B, H, N, N) scores are mixed across H by
    ``proj_l`` before the softmax and the probabilities by ``proj_w`` after it (timm ``TalkingHeadAttn``).
    A configuration of the attention core: ``Attention(..., talking_heads=True)``.

    Args:
        dim: token width D.
        num_heads: number of heads H (keys and values have as many).
        kwargs: the other arguments of :class:`~specvit.nn.attention.Attention`.
    """

    def __init__(self, dim: int, num_heads: int, **kwargs: Any) -> None:
        super().__init__(dim, num_heads, talking_heads=True, **kwargs)


class ClassAttention(Attention):
    """Class attention (timm ``ClassAttn``): the first token's query attends over all N tokens, through
    ``q``, ``k`` and ``v`` projections of their own. A configuration of the attention core:
    ``Attention(..., projection="split", queries=1)``; its output is the class token's update, (B, 1, D).

    Args:
        dim: token width D.
        num_heads: number of heads H.
        kwargs: the other arguments of :class:`~specvit.nn.attention.Attention`.
    """

    def __init__(self, dim: int, num_heads: int, **kwargs: Any) -> None:
        super().__init__(dim, num_heads, projection="split", queries=1, **kwargs)


def class_token(x: Tensor) -> Tensor:
    """The class token (the first) of (B, N, D) tokens: (B, 1, D)."""
    return x[:, :1]


def join_class_token(x: Tensor, cls: Tensor) -> Tensor:
    """The (B, N, D) tokens with their first replaced by the (B, 1, D) class token ``cls``."""
    return torch.cat((cls, x[:, 1:]), dim=1)  # (B, N, D)
