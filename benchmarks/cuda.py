"""The GPU section: bf16 autocast, flash SDPA, model FLOP utilisation of ViT-B and Llama-style training.
Runs when ``torch.cuda.is_available()``; otherwise one line says it was skipped."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from benchmarks.common import NOTES, Row, timeit

__all__ = ["PEAK_BF16_TFLOPS", "cuda_rows", "mfu"]

PEAK_BF16_TFLOPS = {"H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0}
"""Dense bf16 tensor-core peaks (vendor data sheets), by a substring of the device name."""


def mfu(flops: int, seconds: float, device_name: str) -> float | None:
    """Model FLOP utilisation: achieved FLOP/s over the device's dense bf16 peak (None if unknown)."""
    peak = next((p for k, p in PEAK_BF16_TFLOPS.items() if k in device_name), None)
    return None if peak is None else flops / seconds / (peak * 1e12)


def _train(model: nn.Module, loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = loss()
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    return step


def cuda_rows(repeat: int, smoke: bool = False) -> list[Row]:
    if not torch.cuda.is_available():
        NOTES.append(
            "GPU section (bf16 autocast, flash SDPA, MFU of ViT-B and Llama-style training) skipped: no CUDA device."
        )
        return []
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import specvit

    name = torch.cuda.get_device_name()
    ce = nn.functional.cross_entropy
    rows = []
    vit = specvit.load_spec("vit_base_patch16_224")
    model = specvit.build_model(vit, device="cuda").train()
    x, y = torch.randn(64, 3, 224, 224, device="cuda"), torch.randint(0, 1000, (64,), device="cuda")
    flops = 3 * specvit.build_graph(vit, batch=64).total_flops
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t = timeit(_train(model, lambda: ce(model(x), y)), repeat)
    rows.append(
        Row(
            "CUDA training, bf16 autocast, flash SDPA",
            f"ViT-B/16 batch 64 on {name}; MFU {mfu(flops, t, name) or float('nan'):.0%}",
            t,
            None,
            "-",
            flops,
        )
    )
    llama = specvit.load_spec(
        "llama_smollm_135m",
        overrides={
            "decoder.depth": 12,
            "decoder.width": 768,
            "decoder.block.heads": 12,
            "decoder.block.kv_heads": 12,
            "decoder.block.mlp.hidden": 3072,
            "decoder.input.vocab": 32000,
            "head.tied": False,
        },
    )
    lm = specvit.build_model(llama, device="cuda").train()
    tokens = torch.randint(0, 32000, (16, 1024), device="cuda")
    flops = 3 * specvit.build_graph(llama, batch=16, seq_len=1024).total_flops
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t = timeit(_train(lm, lambda: ce(lm(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())), repeat)
    rows.append(
        Row(
            "CUDA training, bf16 autocast, flash SDPA",
            f"Llama-style 12x768, 16 x 1024 tokens on {name}; MFU {mfu(flops, t, name) or float('nan'):.0%}",
            t,
            None,
            "-",
            flops,
        )
    )
    return rows
