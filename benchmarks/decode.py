"""Decode rows: generation against HF ``generate`` on the same weights, prefill against HF's forward, and the
time of one decoded token against the memory wall (the bytes a step must read / a streaming-read rate).

The model is SmolLM-135M's shape (30 layers, width 576, 9 query / 3 key-value heads, MLP 1536, a tied
49152-token vocabulary), built from a ``LlamaConfig`` with random weights on both sides: HF's
``LlamaForCausalLM`` and specvit's ``from_hf`` of the same config with HF's weights converted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.common import NOTES, Row, target

SMOLLM = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
SMOKE = {**SMOLLM, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
SMOKE.update(num_attention_heads=4, num_key_value_heads=2)


@dataclass(frozen=True)
class Sizes:
    """The lengths of one run: the prompt, the tokens generated, the prefill row's sequence, the stream."""

    prompt: int
    new: int
    prefill: int
    stream_bytes: int


FULL = Sizes(prompt=32, new=128, prefill=512, stream_bytes=256 * 2**20)
SMALL = Sizes(prompt=8, new=8, prefill=16, stream_bytes=8 * 2**20)


def llama_pair(smoke: bool) -> tuple[nn.Module, nn.Module]:
    """(HF's ``LlamaForCausalLM``, specvit's model) with the same random weights, both in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import specvit  # benchmarks.common installed the torchvision op-schema hook transformers needs
    from specvit.convert import convert_state_dict

    torch.manual_seed(0)
    config = LlamaConfig(**(SMOKE if smoke else SMOLLM))
    ref = LlamaForCausalLM(config).eval()
    spec = specvit.from_hf(config)
    ours = specvit.build_model(spec).eval()
    ours.load_state_dict(convert_state_dict(ref.state_dict(), "hf", spec), strict=True)
    return ref, ours


def stream_rate(nbytes: int, repeat: int) -> float:
    """Bytes per second a sum over an ``nbytes`` float32 tensor reads (the fastest of ``repeat`` runs): the
    machine's streaming-read rate, measured in this process with its threads."""
    x = torch.ones(nbytes // 4)
    x.sum()
    times = []
    for _ in range(max(3, repeat)):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.nbytes / min(times)


class Rates:
    """Streaming-read rates sampled between the measurements (this VM's rate drifts by a third within
    minutes): each the fastest of 3 sums over ``nbytes``; :meth:`median` is the wall's rate so far."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.samples = nbytes, [stream_rate(nbytes, 3)]

    def sample(self) -> None:
        self.samples.append(stream_rate(self.nbytes, 3))

    def median(self) -> float:
        return statistics.median(self.samples)


def step_bytes(ref: nn.Module, batch: int, position: float, dtype_bytes: int = 4) -> float:
    """Bytes one decode step must read: every weight once (the embedding table only when the LM head is tied
    to it; a lookup reads a row otherwise) and the KV cache of ``position`` tokens per row."""
    seen: dict[int, int] = {}
    for p in ref.parameters():
        seen[p.data_ptr()] = p.numel() * dtype_bytes
    embed, head = ref.get_input_embeddings().weight, ref.get_output_embeddings().weight
    weights = sum(seen.values()) - (0 if embed.data_ptr() == head.data_ptr() else embed.numel() * dtype_bytes)
    cfg = ref.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes * position * batch
    return weights + kv


def _pair(a: Callable[[], Any], b: Callable[[], Any], repeat: int) -> tuple[float, float, Any, Any]:
    """Medians of ``a`` and ``b`` run alternately after one warm-up each, and the warm-ups' results."""
    out_a, out_b = a(), b()
    ta, tb = [], []
    for _ in range(repeat):
        for fn, times in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb), out_a, out_b


def _agreement(got: torch.Tensor, want: torch.Tensor) -> str:
    """``same tokens``, or where the first row that differs from HF's departs from it (random weights leave
    near-ties that summation order can flip, after which a row goes its own way)."""
    if torch.equal(got, want):
        return "same tokens"
    if got.shape != want.shape:
        return f"{list(got.shape)} tokens vs HF's {list(want.shape)}"
    row = int((got != want).any(dim=1).nonzero()[0])
    at = int((got[row] != want[row]).nonzero()[0])
    return f"tokens differ from HF's from position {at} of row {row}"


def _token_agreement(got: torch.Tensor, want: torch.Tensor, prompt: int) -> str:
    """How closely greedy tokens ``got`` follow ``want`` (both (B, prompt + new) with the same prompts): the
    share of new positions holding the same token, and the rows equal throughout (after a first difference a
    row continues from another context, so later positions differ more)."""
    if got.shape != want.shape:
        return f"{list(got.shape)} tokens vs fp32's {list(want.shape)}"
    same = got[:, prompt:] == want[:, prompt:]  # (B, new)
    rows, new = same.shape
    return (
        f"greedy tokens equal fp32's at {same.float().mean().item():.0%} of {rows} prompts x {new} positions "
        f"({int(same.all(dim=1).sum())} of {rows} rows throughout)"
    )


def _hf_generate(ref: nn.Module, prompt: torch.Tensor, new: int, sample: bool) -> torch.Tensor:
    """HF's ``generate`` of exactly ``new`` tokens: greedy, or sampling at temperature 1 from the top 50."""
    extra = {"temperature": 1.0, "top_k": 50, "top_p": 1.0} if sample else {}
    return ref.generate(  # type: ignore[no-any-return]
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=sample,
        pad_token_id=0,
        **extra,
    )


def decode_rows(repeat: int, smoke: bool = False) -> list[Row]:
    """Greedy and sampled generation at batch 1 and 8, prefill, and per-token decode against the wall."""
    ref, ours = llama_pair(smoke)
    sizes = SMALL if smoke else FULL
    runs = max(1, repeat // 5)  # a generation takes seconds
    vocab = ref.config.vocab_size
    rows: list[Row] = []
    ids = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        rates = Rates(sizes.stream_bytes)
        for batch in (1, 8):
            prompt = torch.randint(0, vocab, (batch, sizes.prompt), generator=ids)
            for sample in (False, True):
                kwargs = {"temperature": 1.0, "top_k": 50} if sample else {}
                t_ours, t_hf, got, want = _pair(
                    lambda p=prompt, kw=kwargs: ours.generate(p, sizes.new, **kw),
                    lambda p=prompt, s=sample: _hf_generate(ref, p, sizes.new, s),
                    runs,
                )
                rates.sample()
                what = f"sampled (T=1, top-50), batch {batch}"
                if not sample:
                    what = f"greedy, {_agreement(got, want)}, batch {batch}"
                    target(f"greedy tokens equal HF's (batch {batch})", torch.equal(got, want), what)
                rows.append(
                    Row(
                        f"Generation of {sizes.new} tokens from {sizes.prompt}",
                        what,
                        t_ours,
                        t_hf,
                        "HF generate",
                    )
                )
            rows.append(_per_token(ref, ours, prompt, sizes, rates, runs, rows[-2]))
            if batch == 1:
                rows += _smaller_weights(ours, prompt, sizes, rates, runs, rows[-1], vocab)
        seq = torch.randint(0, vocab, (1, sizes.prefill), generator=ids)
        t_ours, t_hf, _, _ = _pair(lambda: ours(seq), lambda: ref(input_ids=seq).logits, repeat)
        rows.append(
            Row(f"Prefill of {sizes.prefill} tokens", "batch 1, all logits", t_ours, t_hf, "HF forward")
        )
    low, high = min(rates.samples) / 1e9, max(rates.samples) / 1e9
    NOTES.append(
        f"decode wall: streaming-read rate {rates.median() / 1e9:.1f} GB/s, the median of {len(rates.samples)} "
        f"samples taken between the decode rows ({low:.1f}-{high:.1f} GB/s; each the fastest of 3 sums over a "
        f"{sizes.stream_bytes // 2**20} MB float32 tensor), each row's wall at the median of the samples taken "
        "up to it; a step reads every weight once (the "
        "tied LM head included) and the KV cache of its position; the per-token time is "
        f"(t(generate {sizes.new}) - t(generate 1)) / {sizes.new - 1}, as a user of generate sees it"
    )
    return rows


def _per_token(
    ref: nn.Module, ours: nn.Module, prompt: torch.Tensor, sizes: Sizes, rates: Rates, runs: int, greedy: Row
) -> Row:
    """One decoded token's time, from the greedy row less a one-token generation, against the wall."""
    t_ours1, t_hf1, _, _ = _pair(
        lambda: ours.generate(prompt, 1), lambda: _hf_generate(ref, prompt, 1, False), max(2, runs)
    )
    steps = sizes.new - 1
    assert greedy.peer is not None
    ours_step, hf_step = (greedy.ours - t_ours1) / steps, (greedy.peer - t_hf1) / steps
    batch = prompt.shape[0]
    rates.sample()
    wall = step_bytes(ref, batch, sizes.prompt + sizes.new / 2) / rates.median()
    share = wall / ours_step if ours_step > 0 else float("nan")
    if batch == 1:
        target("fp32 decode >= 70% of the memory wall (batch 1)", share >= 0.7, f"{share:.0%}")
    what = (
        f"fp32, batch {batch}: {share:.0%} of the memory wall ({wall * 1e3:.1f} ms), HF {wall / hf_step:.0%}"
    )
    return Row("Per-token decode", what, ours_step, hf_step, "HF generate")


def module_step_bytes(module: nn.Module) -> int:
    """Bytes of weights one decode step of ``module`` reads: every parameter and buffer once, less the token
    embedding's table when no tied output layer reads it whole (a lookup reads one row per token)."""
    from specvit.nn.embed import TokenEmbed
    from specvit.nn.layers import TiedLinear

    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        seen[t.data_ptr()] = t.nbytes
    tied = any(isinstance(m, TiedLinear) for m in module.modules())
    tables = [m for m in module.modules() if isinstance(m, TokenEmbed)]
    return sum(seen.values()) - (0 if tied else sum(t.weight.nbytes for t in tables))


def _smaller_weights(
    ours: nn.Module, prompt: torch.Tensor, sizes: Sizes, rates: Rates, runs: int, fp32: Row, vocab: int
) -> list[Row]:
    """Per-token decode from bf16 and from int8 weights with float32 activations (the modules
    ``optimize(for_='generation', precision='int8')`` measures), each against its own wall, with its logit
    error against fp32 and how often its greedy tokens equal fp32's over a fixed set of prompts."""
    import specvit

    fast = specvit.optimize(ours, (prompt,), "generation", precision="int8", repeat=max(1, runs))
    report = fast.optimize_report  # type: ignore[union-attr]
    prompts = torch.randint(0, vocab, (8, sizes.prompt), generator=torch.Generator().manual_seed(1))
    greedy = min(sizes.new, 32)  # new tokens of the agreement check, from a fixed set of 8 prompts
    want = ours.generate(prompts, greedy)
    rows = []
    for name in ("bf16 weights", "int8 weights"):
        module = report.modules[name]
        t_new, t_one, _, _ = _pair(
            lambda m=module: m.generate(prompt, sizes.new), lambda m=module: m.generate(prompt, 1), runs
        )
        step = (t_new - t_one) / (sizes.new - 1)
        rates.sample()
        layers, width = _kv_layout(ours)
        kv = 2 * layers * width * 4 * (sizes.prompt + sizes.new / 2)  # float32 keys and values, mean position
        wall = (module_step_bytes(module) + kv) / rates.median()
        share = wall / step if step > 0 else float("nan")
        diff = next(t.max_abs_diff for t in report.trials if t.name == name)
        target(f"{name} decode >= 60% of its memory wall (batch 1)", share >= 0.6, f"{share:.0%}")
        agreement = _token_agreement(module.generate(prompts, greedy), want, sizes.prompt)
        what = (
            f"{name}, batch 1: {share:.0%} of its memory wall ({wall * 1e3:.1f} ms); max logit diff vs fp32 "
            f"{diff:.1e}; {agreement}; optimize chose {report.chosen!r}"
        )
        rows.append(Row("Per-token decode", what, step, fp32.ours, "specvit fp32"))
    return rows


def _kv_layout(model: nn.Module) -> tuple[int, int]:
    """The number of attention layers of ``model`` and their Hkv * hd."""
    from specvit.nn.attention import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return len(layers), int(layers[0].num_kv_heads * layers[0].head_dim)
