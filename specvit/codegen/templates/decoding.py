"""Decoding in an ejected file: the KV cache, the choice of the next token, and ``generate``.

They decode as the compiled model does (:mod:`specvit.generate`, :class:`specvit.nn.cache.KVCache`): the same
keys and values, the same greedy choice, the same draws from a ``torch.Generator`` when sampling, so a seed
gives the same tokens. Performance plumbing (packed weights, bounded caches, stopping at an end id) stays in
specvit.

Dim legend: B batch, N new tokens, T cached + new tokens, Hkv key/value heads, hd head dim, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["DecoderGenerate", "EncoderDecoderGenerate", "KVCache", "next_token"]


class KVCache:
    """The keys and values each attention layer has computed while decoding, by the layer's index."""

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.memory: dict[int, tuple[Tensor, Tensor]] = {}  # cross-attention: the memory's, computed once

    def length(self, layer: int) -> int:
        """The positions layer ``layer`` holds: the position of its next token."""
        return self.keys[layer].shape[2] if layer in self.keys else 0

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new keys and values (B, Hkv, N, hd) of layer ``layer``; all it holds: (B, Hkv, T, hd)."""
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def next_token(
    logits: Tensor, do_sample: bool, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """The next token ids (B,) from the last position's logits (B, V): the most likely one, or a sample of
    ``softmax(logits / temperature)`` over the ``top_k`` most likely (all with None)."""
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -torch.inf)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


class DecoderGenerate(nn.Module):
    """The ``generate`` an ejected decoder's ``Model`` gets (its text is copied)."""

    @torch.no_grad()
    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        do_sample: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue the prompts ``ids`` (B, T0) by ``max_new_tokens`` tokens: (B, T0 + max_new_tokens).

        Greedy, or with ``do_sample`` drawn from the logits divided by ``temperature`` (among the ``top_k``
        most likely); each step runs the new tokens only, the earlier ones' keys and values cached.
        """
        cache, fed = KVCache(), 0
        for _ in range(max_new_tokens):
            logits = self(ids[:, fed:], cache=cache, offset=fed)  # (B, T, V) for the T new tokens
            fed = ids.shape[1]
            token = next_token(logits[:, -1], do_sample, temperature, top_k, generator)  # (B,)
            ids = torch.cat((ids, token[:, None]), dim=1)
        return ids

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class EncoderDecoderGenerate(nn.Module):
    """The ``generate`` an ejected encoder-decoder's ``Model`` gets (its text is copied)."""

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        max_new_tokens: int,
        *,
        bos_id: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        do_sample: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Decode ``max_new_tokens`` tokens after ``bos_id`` for the inputs ``src``: (B, 1 + max_new_tokens).

        The encoder runs once; greedy, or with ``do_sample`` drawn from the logits divided by ``temperature``
        (among the ``top_k`` most likely); each step runs the new token only, the earlier ones' keys and
        values and the memory's cached.
        """
        memory = self.encode(src)
        ids = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        cache, fed = KVCache(), 0
        for _ in range(max_new_tokens):
            logits = self.decode(ids[:, fed:], memory, cache=cache, offset=fed)  # (B, 1, V)
            fed = ids.shape[1]
            token = next_token(logits[:, -1], do_sample, temperature, top_k, generator)  # (B,)
            ids = torch.cat((ids, token[:, None]), dim=1)
        return ids

    def encode(self, src: Tensor) -> Any:
        raise NotImplementedError

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError
