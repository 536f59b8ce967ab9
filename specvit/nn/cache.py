"""The KV cache of a decoding loop, bounded for sliding-window attention."""

from __future__ import annotations

from torch import Tensor

__all__ = ["KVCache", "sub_cache"]


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
        self.keys: dict[int, Tensor] = {}  # (B, Hkv, T, hd) views into the buffers
        self.values: dict[int, Tensor] = {}
        self.seen: dict[int, int] = {}
        self.buffers: dict[int, tuple[Tensor, Tensor, int]] = {}  # keys, values (B, Hkv, capacity, hd), start
        self.memory: dict[int, tuple[Tensor, Tensor]] = {}
        self.subs: dict[int, KVCache] = {}

    def sub(self, key: int) -> KVCache:
        """The cache of another run of shared layers (a block whose weights later layers share): entries of
        their own under the same layer indexes, made on first use, bounded by the same ``window``."""
        if key not in self.subs:
            self.subs[key] = KVCache(self.window)
        return self.subs[key]

    def length(self, layer: int) -> int:
        """Positions fed to self-attention layer ``layer`` so far (the absolute position of the next token);
        the cache may hold fewer (see ``stored``)."""
        return self.seen.get(layer, 0)

    def stored(self, layer: int) -> int:
        """Positions whose keys/values layer ``layer`` holds."""
        k = self.keys.get(layer)
        return 0 if k is None else k.shape[2]

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append new (B, Hkv, N, hd) keys/values and return all (B, Hkv, T, hd) the layer holds.

        They are written into a buffer with room to grow (its capacity doubles when full, so a step copies
        only its own tokens, not the whole cache as a concatenation would); the returned tensors are views.
        """
        n, held = k.shape[2], self.stored(layer)
        self.seen[layer] = self.seen.get(layer, 0) + n
        buffer = self.buffers.get(layer)
        if buffer is None or buffer[2] + held + n > buffer[0].shape[2] or buffer[0].shape[0] != k.shape[0]:
            capacity = max(2 * (held + n), 16)
            bk = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])  # (B, Hkv, capacity, hd)
            bv = v.new_empty(v.shape[0], v.shape[1], capacity, v.shape[3])
            if held:
                bk[:, :, :held] = self.keys[layer]
                bv[:, :, :held] = self.values[layer]
            buffer = (bk, bv, 0)
            self.buffers[layer] = buffer
        bk, bv, start = buffer
        end = start + held + n
        bk[:, :, end - n : end] = k
        bv[:, :, end - n : end] = v
        self.keys[layer], self.values[layer] = bk[:, :, start:end], bv[:, :, start:end]  # (B, Hkv, T, hd)
        return self.keys[layer], self.values[layer]

    def bound(self, layer: int, window: int | None) -> None:
        """After a forward of causal layer ``layer`` with sliding window ``window`` (None: none), keep only
        the ``min(window, self.window) - 1`` positions the next query will see besides itself."""
        bounds = [w for w in (window, self.window) if w is not None]
        drop = self.stored(layer) - (min(bounds) - 1) if bounds else 0
        if drop > 0:
            bk, bv, start = self.buffers[layer]
            self.buffers[layer] = (bk, bv, start + drop)  # the buffer is reused from its start when full
            self.keys[layer] = self.keys[layer][:, :, drop:]  # (B, Hkv, window - 1, hd)
            self.values[layer] = self.values[layer][:, :, drop:]


def sub_cache(cache: KVCache | None, key: int) -> KVCache | None:
    """``cache.sub(key)``, or None without a cache: the cache a shared block's run ``key`` reads and writes."""
    return None if cache is None else cache.sub(key)
