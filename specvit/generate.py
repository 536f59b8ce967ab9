"""The decoding loop shared by decoder-only and encoder-decoder generation."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn

from specvit import argcheck
from specvit.nn.decoding import native_steps
from specvit.nn.packed import packed_linears
from specvit.nn.program import StepProgram
from specvit.resources import available_memory

PACK_FROM = 16
"""Generations of at least this many tokens pack the stepped modules' linears: packing the weights costs about
as much time as a dozen one-token steps save (measured on ``transformer_base``)."""

PROGRAM_POSITIONS = 256
"""The new positions a native step program holds at first (:mod:`specvit.nn.program`); it doubles when full."""

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


def _integer(
    value: object, name: str, *, low: int, high: int | None = None, hint: str = "", vocab: int | None = None
) -> int:
    """``value`` as an int >= ``low`` (NumPy and 0-d tensor integers too), or a TypeError / ValueError.

    ``vocab`` bounds a token id: below the vocabulary's size (a finished row's ``pad_id`` is fed back to the
    model, and an ``eos_id`` outside it is never produced).
    """
    if vocab is not None:
        high, hint = vocab - 1, hint or f"a token id of the model's vocabulary of {vocab}"
    return argcheck.integer(
        value, name, low=low, high=argcheck.INT64_MAX if high is None else high, hint=hint
    )


def _temperature(value: object) -> float:
    """``value`` as a finite float >= 0, or a TypeError / ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"temperature must be a number, got {type(value).__name__} {value!r}")
    t = float(value)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 for greedy), got {t}")
    return t


def _check_prompt(tokens: object) -> None:
    """A prompt is a (B, T0) tensor of integer ids with B >= 1 and T0 >= 1."""
    if not isinstance(tokens, Tensor):
        raise TypeError(f"the prompt must be a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.dim() != 2 or tokens.is_floating_point() or tokens.dtype == torch.bool:
        ids = not (tokens.is_floating_point() or tokens.dtype == torch.bool)
        raise ValueError(
            f"the prompt must be a 2-D (batch, length) tensor of integer token ids, got a {tokens.dim()}-D "
            f"{str(tokens.dtype).removeprefix('torch.')} tensor of shape {list(tokens.shape)}"
            + ("; pass tokens.unsqueeze(0) for one prompt" if tokens.dim() == 1 and ids else "")
        )
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(
            f"the prompt is empty (shape {list(tokens.shape)}): give at least one sequence of at least one "
            "token, e.g. a BOS id"
        )


class _Feed:
    """The next position's logits (B, V) of a growing sequence (B, T): its new tokens fed to ``step`` with the
    cache, or the whole sequence without one; with a step program, every step after the prompt's runs it
    (grown when full)."""

    def __init__(self, step: Step, cache: Any, program: StepProgram | None) -> None:
        self.step, self.cache, self.program = step, cache, program
        self.fed = 0  # tokens already in the cache

    def __call__(self, seq: Tensor) -> Tensor:
        if self.cache is None:
            return self.step(seq, None, 0)
        fed, self.fed = self.fed, seq.shape[1]
        if self.program is None or not fed:
            logits = self.step(seq[:, fed:], self.cache, fed)
            if self.program is not None:
                self.program.load(self.cache)  # the prompt's keys and values
            return logits
        if fed >= self.program.capacity:
            self.program = self.program.grown()
        return self.program(seq[:, fed:], fed)


def decode_loop(
    step: Step,
    new_cache: Callable[[], Any],
    tokens: Tensor,
    max_new_tokens: int,
    *,
    eos_id: int | None,
    pad_id: int | None = None,
    temperature: float,
    top_k: int | None,
    use_cache: bool,
    generator: torch.Generator | None,
    stepped: Sequence[nn.Module] = (),
    lower: Callable[[int, int], StepProgram | None] | None = None,
) -> Tensor:
    """Append up to ``max_new_tokens`` tokens to ``tokens`` (B, T0).

    Args:
        step: ``step(new_tokens, cache, offset) -> (B, V)`` logits of the last position.
        new_cache: makes an empty KV cache.
        tokens: (B, T0) the prompt.
        max_new_tokens: the most tokens to add.
        eos_id: a row that emits this id has finished: it stops growing (later positions hold ``pad_id``);
            stop when every row has finished. Each row's tokens equal its own generation alone.
        pad_id: what fills a finished row's later positions; None = ``eos_id``.
        temperature: 0 for greedy.
        top_k: restrict sampling to the k most likely tokens (>= 1), or None for all.
        use_cache: feed one token per step into a KV cache instead of the whole sequence.
        generator: random generator for sampling.
        stepped: the modules ``step`` runs; from ``PACK_FROM`` new tokens on, their float32 and bfloat16
            linears are swapped for decoding ones on CPU (:mod:`specvit.nn.packed`): a few rows per call run
            the kernel measured fastest, and weights are pre-packed for oneDNN when the steps' rows take the
            packed product and the memory available holds the copies; their RMSNorms, SwiGLU gating and RoPE
            run natively (:mod:`specvit.nn.decoding`).
        lower: ``lower(rows, capacity)`` makes the steps' native program (:mod:`specvit.nn.program`), or None
            where the model has none; from ``PACK_FROM`` new tokens on with a cache, the prompt's step runs
            ``step`` and every later step the program instead (the stepped modules are then left as they are).

    Raises:
        TypeError: an argument of the wrong type (NumPy integers are integers).
        ValueError: an empty prompt, ``top_k`` < 1, a negative or non-finite temperature, a negative
            ``max_new_tokens``, ``eos_id`` or ``pad_id``.
    """
    max_new_tokens = _integer(max_new_tokens, "max_new_tokens", low=0)
    eos_id = None if eos_id is None else _integer(eos_id, "eos_id", low=0)
    pad_id = eos_id if pad_id is None else _integer(pad_id, "pad_id", low=0)
    top_k = None if top_k is None else _integer(top_k, "top_k", low=1, hint="None samples from every token")
    temperature = _temperature(temperature)
    use_cache = argcheck.flag(use_cache, "use_cache")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    _check_prompt(tokens)
    cache = new_cache() if use_cache else None
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    seq = tokens
    program = None
    if cache is not None and lower is not None and max_new_tokens >= PACK_FROM:
        program = lower(tokens.shape[0], tokens.shape[1] + min(max_new_tokens, PROGRAM_POSITIONS))
    feed = _Feed(step, cache, program)
    with ExitStack() as decoding:
        if max_new_tokens >= PACK_FROM and program is None:
            decoding.enter_context(
                packed_linears(*stepped, max_bytes=available_memory(), step_rows=tokens.shape[0])
            )
            decoding.enter_context(native_steps(*stepped))
        for _ in range(max_new_tokens):
            logits = feed(seq)  # (B, V)
            nxt = _pick(logits, temperature, top_k, generator)  # (B,)
            if eos_id is not None:
                assert pad_id is not None
                nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)  # finished rows are padded
                done = done | (nxt == eos_id)
            seq = torch.cat((seq, nxt[:, None]), dim=1)  # (B, T + 1)
            if eos_id is not None and bool(done.all()):
                break
    return seq
