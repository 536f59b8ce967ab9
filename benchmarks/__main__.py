"""Side-by-side benchmarks: ``python -m benchmarks`` (or ``make bench``); ``--only training`` runs a section.

Every row times specvit and a peer in this one process, alternating their runs, and prints their ratio;
training rows add the peak resident memory a step adds. Throughput is given against the GEMM ceiling
measured in the same run on the model's own GEMM shapes (ViT-B/16 at batch 8) through every path the
machine offers (MKL, oneDNN pre-packed, bf16). The report (machine, ISA, versions, command) is printed, and
written to docs/performance.md when every section ran (not with ``--only`` or ``--no-write``: a partial run
would replace the whole page); ``--smoke`` runs every section at toy sizes to check the code, never to publish.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import MALLOC_KEEP, NOTES, TARGETS, Row, environment, fmt_time

ROOT = Path(__file__).resolve().parents[1]


def _sections() -> dict[str, Callable[[int, bool], list[Row]]]:
    from benchmarks.build import build_rows
    from benchmarks.cuda import cuda_rows
    from benchmarks.decode import decode_rows
    from benchmarks.generation import generation_rows
    from benchmarks.inference import softcap_attention_rows, transformer_eval_rows, vit_rows
    from benchmarks.peers import moe_rows, swin_rows
    from benchmarks.training import training_rows

    return {
        "vit": vit_rows,
        "transformer": transformer_eval_rows,
        "attention": softcap_attention_rows,
        "moe": moe_rows,
        "swin": swin_rows,
        "training": training_rows,
        "generation": generation_rows,
        "decode": decode_rows,
        "build": build_rows,
        "cuda": cuda_rows,
    }


SECTIONS = (
    "vit",
    "transformer",
    "attention",
    "moe",
    "swin",
    "training",
    "generation",
    "decode",
    "build",
    "cuda",
)


def measure_ceiling(repeat: int, smoke: bool) -> tuple[dict[str, float], dict[str, float], str]:
    """GEMM rates of ViT-B/16's own shapes at batch 8 per path, the best per dtype, and what was measured."""
    import specvit
    from benchmarks.gemm import ceilings, gemm_shapes, shape_rates

    over = {"encoder.depth": 1} if smoke else {}
    model = specvit.build_model("vit_base_patch16_224", overrides=over).eval()
    shapes = gemm_shapes(model, (torch.randn(8, 3, 224, 224),))
    rates = shape_rates(shapes, repeat)
    listed = ", ".join(f"{m}x{k}x{n} (x{c})" for (m, k, n), c in sorted(shapes.items()))
    return rates, ceilings(rates), listed


def table(rows: list[Row], best: dict[str, float]) -> str:
    lines = [
        "| benchmark | case | specvit | peer | peer time | ratio (specvit/peer) | peak memory (specvit vs peer) "
        "| specvit GFLOP/s | of fp32 GEMM ceiling |",
        "|---|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        rate = r.flops / r.ours / 1e9 if r.flops else None
        gflops = f"{rate:.0f}" if rate else "-"
        share = f"{rate / best['fp32']:.0%}" if rate and "fp32" in best else "-"
        if rate and "fp32" in best and rate > best["fp32"] and "bf16" not in r.section:
            share += " (above: faster than the GEMMs timed alone; see the ceiling's note)"
        if rate and "bf16" in r.section and "bf16" in best:
            share += f" (bf16 ceiling: {rate / best['bf16']:.0%})"
        peer_time = fmt_time(r.peer) if r.peer else "-"
        lines.append(
            f"| {r.section} | {r.what} | {fmt_time(r.ours)} | {r.peer_name} | {peer_time} | {r.ratio()} "
            f"| {r.mem()} | {gflops} | {share} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per measurement (median)")
    parser.add_argument(
        "--only", nargs="*", default=None, choices=SECTIONS, help="run some sections (implies --no-write)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes, to check the code (implies --no-write)"
    )
    parser.add_argument("--no-write", action="store_true", help="do not write docs/performance.md")
    args = parser.parse_args(argv)
    if argv is None and any(os.environ.get(k) != v for k, v in MALLOC_KEEP.items()):
        os.execve(
            sys.executable, [sys.executable, "-m", "benchmarks", *sys.argv[1:]], {**os.environ, **MALLOC_KEEP}
        )
    torch.manual_seed(0)
    print(environment(), file=sys.stderr)
    rates, best, listed = measure_ceiling(args.repeat, args.smoke)
    rows: list[Row] = []
    for name, fn in _sections().items():
        if args.only is None or name in args.only:
            print(f"running {name} ...", file=sys.stderr)
            rows += fn(args.repeat, args.smoke)
    rate_text = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in rates.items())
    command = "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv)
    verdicts = "".join(f"- {check(best.get('fp32', 0.0))}\n" for check in TARGETS) + "".join(
        f"- {n}\n" for n in NOTES
    )
    report = (
        f"# Performance\n\nGenerated by `{command.strip()}`; every row ran in one process, specvit and its "
        f"peer alternating, median of {args.repeat} runs (fewer for the slow generation rows).\n\n"
        f"{environment()}\n"
        f"- GEMM ceiling: ViT-B/16's own GEMM shapes at batch 8 ({listed}), each shape's time the fastest of "
        f"{args.repeat} calls; the rate over the whole set through each path, and through the fastest path of "
        f"each shape: {rate_text}. 'of fp32 GEMM ceiling' is against the best fp32 rate; bf16 rows also give "
        "their share of the best bf16 rate. A model's FLOPs include its attention's (8% of ViT-B/16's at 197 "
        "tokens), which run in SDPA's fused kernels and are not timed here; a row above 100% says so.\n"
        "- timing runs keep freed memory in the process ("
        + ", ".join(f"{k}={v}" for k, v in MALLOC_KEEP.items())
        + "; glibc's malloc otherwise returns large blocks to the kernel and each step page-faults them back "
        "in, 10-25% of a training step on this VM and noisier than the differences measured); both sides "
        "of every row alike.\n"
        "- peak memory: measured in a fresh child process per side (`python -m benchmarks.memory <case> "
        "<side>`): it builds the case, resets the kernel's resident-set high-water mark (/proc/self/clear_refs), "
        "runs two training steps of one side and reports VmHWM less the resident size before them: activations, "
        "gradients and AdamW's states as the allocator touched them (tracemalloc does not see torch's "
        "allocations, and in one process memory an earlier run freed stays resident and hides later peaks), "
        "with glibc's default allocator.\n\n"
        f"{table(rows, best)}\n\n## Targets, judged from this run\n\n{verdicts}"
    )
    print(report)
    if not (args.no_write or args.smoke or args.only is not None):
        from specvit.io import atomic_write

        atomic_write(ROOT / "docs" / "performance.md", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
