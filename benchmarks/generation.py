"""Generation rows: greedy generation with and without the KV cache, and the time of one token."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import Row, target, timeit, timeit_pair

SPECS = Path(__file__).resolve().parents[1] / "specs"
ROOT = SPECS.parent


def generation_rows(repeat: int, smoke: bool = False) -> list[Row]:
    import specvit

    small = {"input.vocab": 1000, "dropout": {}}  # a 1000-token vocabulary keeps the LM head from dominating
    decoder = specvit.build_model(
        SPECS / "gpt2_small.yaml",
        overrides={
            "decoder.depth": 1 if smoke else 6,
            "decoder.width": 512,
            "decoder.block.heads": 8,
            "decoder.position.max_len": 512,
            **{f"decoder.{k}": v for k, v in small.items()},
        },
    ).eval()
    seq2seq = specvit.build_model(  # transformer_base: 6 + 6 layers of width 512
        SPECS / "transformer_base.yaml",
        overrides={
            **{f"{role}.{k}": v for role in ("encoder", "decoder") for k, v in small.items()},
            **({"encoder.depth": 1, "decoder.depth": 1} if smoke else {}),
        },
    ).eval()
    prompt = torch.randint(0, 1000, (1, 8))
    n_new = 32 if smoke else 256
    rows = []
    for name, model, kwargs in (
        ("decoder-only 6x512", decoder, {}),
        ("encoder-decoder 6+6x512", seq2seq, {"bos_id": 1}),
    ):
        gen = model.generate  # type: ignore[operator]
        t_cache, t_full = (
            timeit_pair(  # alternating: this machine's speed drifts by more than 10% over seconds
                lambda gen=gen, kwargs=kwargs: gen(prompt, n_new, use_cache=True, **kwargs),
                lambda gen=gen, kwargs=kwargs: gen(prompt, n_new, use_cache=False, **kwargs),
                max(1, repeat // 2),
            )
        )
        rows.append(
            Row(
                f"Greedy generation of {n_new} tokens",
                f"{name}: KV cache vs none",
                t_cache,
                t_full,
                "same model, no cache",
            )
        )
        target(
            f"KV-cache generation >= 5x faster than uncached at 256 tokens ({name})",
            t_full >= 5 * t_cache,
            f"{t_full / t_cache:.1f}x",
        )
        for at in (16, 128, 256) if not smoke else (16,):
            step_cache, step_full = _per_token(model, at, repeat)
            rows.append(
                Row("Per-token time", f"{name}: token {at}", step_cache, step_full, "same model, no cache")
            )
    return rows


def _per_token(model: torch.nn.Module, at: int, repeat: int) -> tuple[float, float]:
    """Time of producing token ``at``: one cached decoder step at position ``at`` vs a full forward of ``at``
    tokens, the linears packed as ``generate`` packs them."""
    from specvit.model import DecoderModel, EncoderDecoderModel
    from specvit.nn.cache import KVCache
    from specvit.nn.packed import packed_linears

    seq = torch.randint(2, 1000, (1, at))
    with torch.inference_mode(), packed_linears(model):
        if isinstance(model, EncoderDecoderModel):
            memory = model.encode(torch.randint(2, 1000, (1, 8)))

            def full() -> object:
                return model.decode(seq, memory)

            def prefill() -> object:
                cache = KVCache()
                model.decode(seq[:, :-1], memory, cache=cache)
                return cache

            def step(cache: object) -> object:
                return model.decode(seq[:, -1:], memory, cache=cache, offset=at - 1)  # type: ignore[arg-type]
        else:
            assert isinstance(model, DecoderModel)

            def full() -> object:
                return model(seq)

            def prefill() -> object:
                cache = KVCache()
                model(seq[:, :-1], cache=cache)
                return cache

            def step(cache: object) -> object:
                return model(seq[:, -1:], cache=cache, offset=at - 1)  # type: ignore[arg-type]

        times = []
        for _ in range(max(3, repeat)):
            cache = prefill()
            start = time.perf_counter()
            step(cache)
            times.append(time.perf_counter() - start)
        return statistics.median(times), timeit(full, max(3, repeat))
