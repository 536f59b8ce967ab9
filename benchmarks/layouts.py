"""Memory per rank of each parallel layout, predicted and measured: ``python -m benchmarks.layouts``.

For each layout, ``specvit.parallel_layout.layout_report`` predicts what a rank holds in training (fp32
weights, gradients and AdamW states, and the activations kept for the backward), and ``examples/train.py
--memory`` runs the layout under torchrun (gloo, CPU) and reports each rank's peak resident memory in
training above its memory before the model was built. The table goes into docs/distributed.md. Memory is
not time: the figures do not need a quiet machine. Rank order: a pipeline's stages first, then its tensor
ranks (``--pp 2 --tp 2``: ranks 0, 1 hold stage 0).

Usage: python -m benchmarks.layouts [--depth N] [--seq-len S] [--batch B]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = "specs/llama_smollm_135m.yaml"

LAYOUTS = [  # name, processes, train.py arguments, layout_report arguments
    ("one process", 1, [], {}),
    ("DDP x 2", 2, ["--parallel", "ddp"], {"dp": 2}),
    ("FSDP2 x 2", 2, ["--parallel", "fsdp"], {"dp": 2, "fsdp": True}),
    ("TP 3", 3, ["--tp", "3"], {"tp": 3}),
    ("PP 2", 2, ["--pp", "2", "--microbatches", "2"], {"pp": 2}),
    ("TP 3 x FSDP2 x 2", 6, ["--tp", "3", "--parallel", "fsdp"], {"tp": 3, "dp": 2, "fsdp": True}),
    ("PP 2 x TP 3", 6, ["--pp", "2", "--tp", "3", "--microbatches", "2"], {"pp": 2, "tp": 3}),
]


def measured(processes: int, args: list[str]) -> list[float]:
    """Each rank's peak MiB in training, from ``examples/train.py --memory`` (torchrun beyond one process)."""
    script = [str(ROOT / "examples" / "train.py"), *args, "--memory", "--quiet"]
    if processes == 1:
        cmd = [sys.executable, *script]
    else:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--standalone", "--nproc_per_node", str(processes), *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
    found = re.search(r"peak memory above start, MiB per rank: ([\d, ]+)", run.stdout)
    if run.returncode or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
    return [float(x) for x in found.group(1).split(",")]


def predicted(spec: object, batch: int, seq_len: int, report: dict[str, object]) -> list[float]:
    """Each stage's weights, gradients, AdamW states and activations in MiB (its ranks hold the same)."""
    from specvit.parallel_layout import layout_report

    dp = int(report.get("dp", 1))  # type: ignore[call-overload]
    loads = layout_report(spec, batch=batch // dp, seq_len=seq_len, **report).stages  # type: ignore[arg-type]
    return [(s.state_bytes + s.activation_bytes) / 2**20 for s in loads]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layouts", description=__doc__.splitlines()[0])
    p.add_argument(
        "--depth", type=int, default=6, help="blocks of the SmolLM-135M-shaped decoder (default 6)"
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=12)
    a = p.parse_args(argv)
    import specvit

    spec = specvit.load_spec(ROOT / SPEC, overrides={"decoder.depth": a.depth})
    common = [SPEC, "--set", f"decoder.depth={a.depth}", "--batch", str(a.batch), "--seq-len", str(a.seq_len)]
    common += ["--steps", "2", "--every", "2"]
    print(f"{SPEC} at depth {a.depth}: batch {a.batch} x {a.seq_len} tokens, 2 AdamW steps, fp32, gloo CPU")
    print("| layout | ranks | predicted per rank (MiB) | measured peak per rank (MiB) |")
    print("|---|---:|---|---|")
    for name, processes, args, report in LAYOUTS:
        stages = predicted(spec, a.batch, a.seq_len, report)
        per_stage = processes // len(stages)
        guess = [stages[r // per_stage] for r in range(processes)]
        peaks = measured(processes, [*common, *args])
        show = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
        print(f"| {name} | {processes} | {show(guess)} | {show(peaks)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
