"""The main job, as ``make demo`` runs it.

For every bundled spec: validate it, render its diagram into ``build/diagrams/``, build the model
(for real when it is small, on the meta device when it is large), run a forward on random input, and
print a table. Then train a tiny encoder-decoder to reverse sequences for a few seconds and
greedy-generate with it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
OUT = ROOT / "build" / "diagrams"
REAL_LIMIT = 130_000_000  # parameters: larger models are built on the meta device
STEPS = 300  # training steps of the reverser


def models() -> int:
    """Validate, render, build and run every bundled spec; print one table row each, its FLOPs counted at
    the sizes ``specvit summary`` counts them at (printed beside them) and run at those sizes."""
    import torch

    from specvit import SpecError, build_graph, build_model, load_spec
    from specvit.diagram import RenderError, render
    from specvit.export import example_inputs
    from specvit.progress import stages
    from specvit.units import FLOPS, format_count, format_sizes

    OUT.mkdir(parents=True, exist_ok=True)
    print(
        f"{'spec':30} {'params':>12} {FLOPS.name:>7} {'useful':>7}  {'at':26} {'input':22} {'output':32} "
        f"{'built on':8} {'forward':>8}"
    )
    status = 0
    for path in sorted(SPECS.glob("*.yaml")):
        with stages(path.name, 4) as step:
            step("validate and lower")
            try:
                spec = load_spec(path)
                graph = build_graph(spec)  # the sizes summary counts at: B=1, S=128 (or max_len if shorter)
            except SpecError as exc:
                print(exc, file=sys.stderr)
                status = 2
                continue
            step(f"render {OUT.relative_to(ROOT)}/{spec.name}.svg")
            try:
                render(graph, OUT / f"{spec.name}.svg")
            except RenderError as exc:
                print(f"  (diagram not rendered: {exc})", file=sys.stderr)
            device = "cpu" if graph.total_params <= REAL_LIMIT else "meta"
            step(f"build on {device}")
            torch.manual_seed(0)
            model = build_model(graph, device=device, progress=False).eval()
            step("forward")
            inputs = example_inputs(model, batch=1)
            with torch.no_grad():
                out = model(*inputs)  # warm-up: the first call pays one-off kernel selection
                start = time.perf_counter()
                out = model(*inputs)
        took = f"{(time.perf_counter() - start) * 1000:.0f} ms" if device == "cpu" else "-"
        shape_in = "x".join(str(d) for d in inputs[0].shape) + (" +tgt" if len(inputs) > 1 else "")
        outs = out.items() if isinstance(out, dict) else [("", out)]  # DETR returns {"logits", "boxes"}
        shape_out = " + ".join(f"{k} {'x'.join(str(d) for d in v.shape)}".strip() for k, v in outs)
        flops, useful = format_count(graph.total_flops), format_count(graph.total_useful_flops)
        print(
            f"{spec.name:30} {graph.total_params:>12,} {flops:>7} {useful:>7}  {format_sizes(graph.dims):26} "
            f"{shape_in:22} {shape_out:32} {device:8} {took:>8}"
        )
    print(
        f"\n{FLOPS.meaning} of one forward at the sizes under 'at' (specvit summary's); useful {FLOPS.name} "
        f"leave out the attention pairs a causal mask or a sliding window hides"
    )
    print(f"diagrams: {OUT.relative_to(ROOT)}/*.svg")
    return status


def reverse() -> None:
    """Train a tiny encoder-decoder to reverse 8 digits, then greedy-decode a few sequences."""
    import torch
    import torch.nn.functional as F

    from specvit.compile import build_model
    from specvit.model import EncoderDecoderModel
    from specvit.progress import stages

    torch.manual_seed(0)
    model = build_model(SPECS / "tiny_seq2seq.yaml")
    assert isinstance(model, EncoderDecoderModel)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(f"\ntraining a tiny encoder-decoder to reverse 8 digits ({STEPS} steps of 64)", flush=True)
    start = time.perf_counter()
    with stages("train", STEPS) as step:
        for i in range(STEPS):
            src = torch.randint(2, 12, (64, 8))
            tgt = src.flip(1)
            tgt_in = torch.cat((torch.ones(64, 1, dtype=torch.long), tgt[:, :-1]), dim=1)
            loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i % 10 == 0:
                shown = f"loss {loss.item():.4f}"
            step(shown)
    model.eval()
    src = torch.randint(2, 12, (3, 8))
    out = model.generate(src, 8, bos_id=1)[:, 1:]
    print(
        f"reverser ({sum(p.numel() for p in model.parameters()):,} params) trained {STEPS} steps in "
        f"{time.perf_counter() - start:.1f} s, final loss {loss.item():.4f}; greedy decoding (KV cache):"
    )
    for s, o in zip(src.tolist(), out.tolist(), strict=True):
        print(f"  {s} -> {o}  {'ok' if o == s[::-1] else 'WRONG'}")


def main() -> int:
    """Run the demo; returns the exit status."""
    status = models()
    reverse()
    return status


if __name__ == "__main__":
    sys.exit(main())
