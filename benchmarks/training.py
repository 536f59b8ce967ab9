"""Training rows: one fwd + bwd + AdamW step on the same batch, specvit and its peer alternating in one
process (median), with each side's peak memory beside it, measured in a fresh child process per side
(``benchmarks.memory``) so neither side's allocations are already resident when the other is measured."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.common import Row, pair_spread, target, timeit_pairs

__all__ = ["CASES", "Case", "training_rows"]


@dataclass
class Case:
    """Two training steps to compare: ``steps["ours"]`` against ``steps["peer"]``."""

    section: str
    what: str
    peer_name: str
    flops: int
    steps: dict[str, Callable[[], None]]


def step_fn(model: nn.Module, loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """One training step: forward, backward, AdamW update."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _tag(smoke: bool) -> str:
    return " [smoke size]" if smoke else ""


def vit_case(smoke: bool, checkpointing: bool = False) -> Case:
    import timm

    import specvit

    over = {"encoder.depth": 2, "encoder.width": 192, "encoder.block.heads": 3} if smoke else {}
    batch = 2 if smoke else 8
    spec = specvit.load_spec("vit_base_patch16_224", overrides=over)
    torch.manual_seed(0)
    ours = specvit.build_model(spec).train()
    x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))
    ce = nn.functional.cross_entropy
    flops = 3 * specvit.build_graph(spec, batch=batch).total_flops
    if checkpointing:  # ours with block checkpointing against ours without
        plain = specvit.build_model(spec).train()
        ours.set_checkpointing(True)
        steps = {
            "ours": step_fn(ours, lambda: ce(ours(x), y)),
            "peer": step_fn(plain, lambda: ce(plain(x), y)),
        }
        name = "Activation checkpointing, ViT-B/16 training step"
        return Case(name + _tag(smoke), f"batch {batch}", "same model, no checkpointing", flops, steps)
    kw = {"depth": 2, "embed_dim": 192, "num_heads": 3} if smoke else {}
    peer = timm.create_model("vit_base_patch16_224", pretrained=False, **kw).train()
    steps = {"ours": step_fn(ours, lambda: ce(ours(x), y)), "peer": step_fn(peer, lambda: ce(peer(x), y))}
    return Case(
        "ViT-B/16 training step (AdamW)" + _tag(smoke),
        f"batch {batch}",
        "timm vit_base_patch16_224",
        flops,
        steps,
    )


def llama_case(smoke: bool) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    import specvit

    layers, width, heads, vocab, seq, batch = (
        (2, 64, 4, 512, 32, 2) if smoke else (12, 768, 12, 32000, 256, 4)
    )
    spec = specvit.load_spec(
        "llama_smollm_135m",
        overrides={
            "decoder.depth": layers,
            "decoder.width": width,
            "decoder.block.heads": heads,
            "decoder.block.kv_heads": heads,
            "decoder.block.mlp.hidden": 4 * width,
            "decoder.input.vocab": vocab,
            "head.tied": False,
        },
    )
    torch.manual_seed(0)
    ours = specvit.build_model(spec).train()
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    peer = LlamaForCausalLM(config).train()
    tokens = torch.randint(0, vocab, (batch, seq))
    # HF's loss from labels: next-token cross-entropy, the labels shifted and padded with the ignored index
    # rather than the logits sliced (a copy of (B, S, V) and its gradient)
    labels = nn.functional.pad(tokens[:, 1:], (0, 1), value=-100).flatten()

    def ours_loss() -> torch.Tensor:
        return nn.functional.cross_entropy(ours(tokens).flatten(0, 1), labels)

    steps = {
        "ours": step_fn(ours, ours_loss),
        "peer": step_fn(peer, lambda: peer(input_ids=tokens, labels=tokens).loss),
    }
    return Case(
        f"Llama-style {layers}x{width} training step (AdamW)" + _tag(smoke),
        f"batch {batch} x {seq} tokens, vocab {vocab}",
        "HF LlamaForCausalLM (sdpa)",
        3 * specvit.build_graph(spec, batch=batch, seq_len=seq).total_flops,
        steps,
    )


def transformer_case(smoke: bool) -> Case:
    import specvit
    from benchmarks.inference import TRANSFORMER

    layers, n = (1, 32) if smoke else (6, 128)
    spec = specvit.load_spec(
        specvit.parse_spec(TRANSFORMER), {"encoder.depth": layers, "decoder.depth": layers}
    )
    torch.manual_seed(0)
    ours = specvit.build_model(spec).train()
    peer = nn.Transformer(512, 8, layers, layers, 2048, 0.1, batch_first=True).train()
    src, tgt = torch.randn(8, n, 512), torch.randn(8, n, 512)
    causal = nn.Transformer.generate_square_subsequent_mask(n)
    steps = {
        "ours": step_fn(ours, lambda: ours(src, tgt).square().mean()),
        "peer": step_fn(peer, lambda: peer(src, tgt, tgt_mask=causal, tgt_is_causal=True).square().mean()),
    }
    return Case(
        f"Encoder-decoder 512/8h/{layers}+{layers} training step (AdamW)" + _tag(smoke),
        f"batch 8, {n}/{n} tokens",
        "torch.nn.Transformer",
        3 * specvit.build_graph(spec, batch=8, src_len=n, tgt_len=n).total_flops,
        steps,
    )


CASES: dict[str, Callable[[bool], Case]] = {
    "vit": vit_case,
    "checkpointing": lambda smoke: vit_case(smoke, checkpointing=True),
    "llama": llama_case,
    "transformer": transformer_case,
}


def training_rows(repeat: int, smoke: bool = False) -> list[Row]:
    from benchmarks.memory import child_peak

    rows = []
    for name, make in CASES.items():
        case = make(smoke)
        times_ours, times_peer = timeit_pairs(case.steps["ours"], case.steps["peer"], repeat)
        t_ours, t_peer = statistics.median(times_ours), statistics.median(times_peer)
        m_ours, m_peer = child_peak(name, "ours", smoke), child_peak(name, "peer", smoke)
        row = Row(case.section, case.what, t_ours, t_peer, case.peer_name, case.flops, m_ours, m_peer)
        rows.append(row)
        del case
        if name == "checkpointing":
            saved = "-" if m_ours is None or m_peer is None else f"{(m_peer - m_ours) / 2**20:.0f} MiB"
            row.what += f"; memory saved {saved}, time paid {t_ours / t_peer - 1:+.0%}"
            continue
        spread = pair_spread(times_ours, times_peer)
        row.what += f"; each pair's ratio: {spread}"
        target(
            f"{row.section} no slower than {row.peer_name}",
            t_ours <= t_peer,
            f"ratio {row.ratio()} (pairs {spread})",
        )
        if m_ours is not None and m_peer:
            target(f"{row.section} peak memory <= {row.peer_name}'s", m_ours <= m_peer, row.mem())
    return rows
