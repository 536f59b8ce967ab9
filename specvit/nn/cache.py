"""The KV cache of a decoding loop, bounded for sliding-window attention."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    """The keys and values of every attention layer of a model, by the layer's index (HF's ``layer_idx``).

    Self-attention layers append the keys/values (after QK-norm and RoPE) of the tokens they see; a
    cross-attention layer stores its memory's keys/values once and reuses them. One object serves the
    whole model: pass it to every forward of a decoding loop.

    The cache stays bounded for windowed layers: a causal layer with a sliding window of W keeps only the
    last W - 1 keys/values after each forward (the next query, at the next position, sees W keys: those and
    its own). ``window`` bounds every causal self-attention layer so: each then attends as a sliding-window
    layer of ``min(own window, window)`` (prefill included), and the cache keeps at most ``window - 1``
    positions per layer. For ALiBi, whose bias depends only on the query-key distance, this is the
    sliding-window evaluation of the ALiBi paper (Press et al., 2022, section 4): exact windowed attention,
    with memory that no longer grows with the sequence.

    Args:
        window: the most positions any causal self-attention layer sees (>= 1), or None for the layers' own.
    """

    def __init__(self, window: int | None = None) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"KVCache(window=...) must be an integer >= 1 or None, got {window!r}")
        self.window = window
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.seen: dict[int, int] = {}
        self.memory: dict[int, tuple[Tensor, Tensor]] = {}

    def length(self, layer: int) -> int:
        """Positions fed to self-attention layer ``layer`` so far (the absolute position of the next token);
        the cache may hold fewer (see ``stored``)."""
        return self.seen.get(layer, 0)

    def stored(self, layer: int) -> int:
        """Positions whose keys/values layer ``layer`` holds."""
        k = self.keys.get(layer)
        return 0 if k is None else k.shape[2]

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append new (B, Hkv, N, hd) keys/values and return all (B, Hkv, T, hd) the layer holds."""
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)  # (B, Hkv, T + N, hd)
            v = torch.cat((self.values[layer], v), dim=2)  # (B, Hkv, T + N, hd)
        self.seen[layer] = self.seen.get(layer, 0) + k.shape[2] - self.stored(layer)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def bound(self, layer: int, window: int | None) -> None:
        """After a forward of causal layer ``layer`` with sliding window ``window`` (None: none), keep only
        the ``min(window, self.window) - 1`` positions the next query will see besides itself."""
        bounds = [w for w in (window, self.window) if w is not None]
        if not bounds:
            return
        drop = self.stored(layer) - (min(bounds) - 1)
        if drop > 0:
            self.keys[layer] = self.keys[layer][:, :, drop:]  # (B, Hkv, keep, hd)
            self.values[layer] = self.values[layer][:, :, drop:]  # (B, Hkv, keep, hd)
