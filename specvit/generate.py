"""The decoding loop shared by decoder-only and encoder-decoder generation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["decode_loop"]

Step = Callable[[Tensor, Any, int], Tensor]


def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """Next token ids (B,) from last-position logits (B, V)."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def decode_loop(
    step: Step,
    new_cache: Callable[[], Any],
    tokens: Tensor,
    max_new_tokens: int,
    *,
    eos_id: int | None,
    temperature: float,
    top_k: int | None,
    use_cache: bool,
    generator: torch.Generator | None,
) -> Tensor:
    """Append up to ``max_new_tokens`` tokens to ``tokens`` (B, T0).

    Args:
        step: ``step(new_tokens, cache, offset) -> (B, V)`` logits of the last position.
        new_cache: makes an empty KV cache.
        tokens: (B, T0) the prompt.
        max_new_tokens: the most tokens to add.
        eos_id: a finished sequence keeps emitting this id; stop when every sequence has finished.
        temperature: 0 for greedy.
        top_k: restrict sampling to the k most likely tokens.
        use_cache: feed one token per step into a KV cache instead of the whole sequence.
        generator: random generator for sampling.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cache = new_cache() if use_cache else None
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    seq = tokens
    fed = 0  # tokens already in the cache
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = step(seq[:, fed:], cache, fed)
            fed = seq.shape[1]
        else:
            logits = step(seq, None, 0)
        nxt = _pick(logits, temperature, top_k, generator)  # (B,)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done = done | (nxt == eos_id)
        seq = torch.cat((seq, nxt[:, None]), dim=1)  # (B, T + 1)
        if eos_id is not None and bool(done.all()):
            break
    return seq
