"""specvit at two commits, each against the same peer: ``python -m benchmarks.ab BASE [--rounds N]``.

A row's ratio (specvit / peer) moves by 10% or more between runs on this project's VMs, more than any
change worth measuring, so comparing today's ratio with a published one says little. This runs the same
cases at ``BASE`` (a git revision, extracted with ``git archive``) and at the working tree, in fresh
child processes that alternate (base, head, base, head, ...). Each child times specvit and its peer
alternately and prints their ratio; the report gives each side's median ratio and the head's change
against the base, so a drift of the machine hits both sides of every comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import MALLOC_KEEP, cpu_info, timeit_pair

ROOT = Path(__file__).resolve().parents[1]

Pair = tuple[Callable[[], object], Callable[[], object]]


def _training(name: str) -> Pair:
    from benchmarks.training import CASES

    steps = CASES[name](False).steps
    return steps["ours"], steps["peer"]


def _vit_forward() -> Pair:
    from transformers import ViTConfig, ViTModel

    import specvit

    ours = specvit.build_model("vit_base_patch16_224", overrides={"head": "none"}).eval()
    config = ViTConfig(layer_norm_eps=1e-6)
    config._attn_implementation = "sdpa"
    hf = ViTModel(config, add_pooling_layer=False).eval()
    x = torch.randn(8, 3, 224, 224)
    return torch.inference_mode()(lambda: ours(x)), torch.inference_mode()(lambda: hf(pixel_values=x))


def _transformer_eval() -> Pair:
    import specvit
    from benchmarks.inference import TRANSFORMER

    ours = specvit.build_model(specvit.parse_spec(TRANSFORMER)).eval()
    peer = torch.nn.Transformer(512, 8, 6, 6, 2048, 0.1, batch_first=True).eval()
    src, tgt = torch.randn(8, 128, 512), torch.randn(8, 128, 512)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(128)
    return (
        torch.inference_mode()(lambda: ours(src, tgt)),
        torch.inference_mode()(lambda: peer(src, tgt, tgt_mask=causal, tgt_is_causal=True)),
    )


def _generation() -> Pair:
    """Greedy decoding of 128 tokens with the KV cache, against the same model's uncached forward of 128."""
    import specvit

    model = specvit.build_model(
        ROOT / "specs" / "gpt2_small.yaml",
        overrides={
            "decoder.depth": 6,
            "decoder.width": 512,
            "decoder.block.heads": 8,
            "decoder.position.max_len": 512,
            "decoder.input.vocab": 1000,
            "decoder.dropout": {},
        },
    ).eval()
    prompt, full = torch.randint(0, 1000, (1, 8)), torch.randint(0, 1000, (1, 128))
    gen = model.generate  # type: ignore[operator]
    return lambda: gen(prompt, 128, use_cache=True), torch.inference_mode()(lambda: model(full))


CASES: dict[str, tuple[str, Callable[[], Pair]]] = {
    "vit_forward": ("ViT-B/16 forward, eager, batch 8 / HF ViTModel", _vit_forward),
    "transformer_eval": ("Encoder-decoder 6+6 eval forward / torch.nn.Transformer", _transformer_eval),
    "vit_training": ("ViT-B/16 training step / timm", lambda: _training("vit")),
    "llama_training": ("Llama-style 12x768 training step / HF Llama", lambda: _training("llama")),
    "transformer_training": ("Encoder-decoder training step / torch.nn.Transformer", lambda: _training("transformer")),
    "generation": ("Greedy 128 tokens, cached / one uncached forward", _generation),
}


def child(case: str, repeat: int) -> None:
    """Time one case in this process and print ``ours peer``."""
    ours, peer = CASES[case][1]()
    t_ours, t_peer = timeit_pair(ours, peer, repeat)
    print(t_ours, t_peer)


def _run(tree: Path, case: str, repeat: int) -> tuple[float, float]:
    """One child process whose ``specvit`` is the one under ``tree`` (its working directory, first on the path)."""
    env = {**os.environ, **MALLOC_KEEP, "PYTHONPATH": str(tree)}
    args = [sys.executable, "-m", "benchmarks.ab", "--child", case, "--repeat", str(repeat)]
    run = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"{case} at {tree} failed:\n{run.stderr[-2000:]}")
    ours, peer = map(float, run.stdout.split()[-2:])
    return ours, peer


def _extract(rev: str, into: Path) -> Path:
    """``specvit/`` of ``rev`` under ``into``, beside links to this tree's ``benchmarks/`` and presets (a
    checkout's ``specs/`` is found beside its ``pyproject.toml``)."""
    archive = subprocess.run(["git", "archive", rev, "specvit"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for name in ("benchmarks", "specs", "pyproject.toml"):
        (into / name).symlink_to(ROOT / name)
    compat = into / "specvit" / "interop" / "compat.py"
    if not compat.exists():  # a base before it: benchmarks/common.py imports it (two op schemas, no model code)
        compat.write_bytes((ROOT / "specvit" / "interop" / "compat.py").read_bytes())
    return into


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("base", nargs="?", help="git revision to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per side and case")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per side in each child")
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="cases to run (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.repeat)
        return 0
    if not args.base:
        parser.error("give the base revision, e.g. 76412cc")
    info = cpu_info()
    print(f"CPU: {info['model']} ({info['isa']}), {os.cpu_count()} cores; base {args.base} vs working tree")
    print(f"{args.rounds} alternating child processes per side, {args.repeat} timed runs each; medians\n")
    print("| case | base specvit/peer | head specvit/peer | head vs base (ratio) | head vs base (time) |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="specvit-ab-") as tmp:
        base = _extract(args.base, Path(tmp))
        for case in args.only or CASES:
            runs: dict[Path, list[tuple[float, float]]] = {base: [], ROOT: []}
            for _ in range(args.rounds):
                for tree in (base, ROOT):
                    runs[tree].append(_run(tree, case, args.repeat))
            ratio = {t: statistics.median(o / p for o, p in r) for t, r in runs.items()}
            ours = {t: statistics.median(o for o, _ in r) for t, r in runs.items()}
            print(
                f"| {CASES[case][0]} | {ratio[base]:.3f} | {ratio[ROOT]:.3f} "
                f"| {ratio[ROOT] / ratio[base] - 1:+.1%} | {ours[ROOT] / ours[base] - 1:+.1%} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
