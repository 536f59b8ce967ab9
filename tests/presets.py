"""The bundled presets, and each made small enough to build and run in a test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import specvit
from specvit.graph import ArchGraph, build_graph
from specvit.spec.schema import ImageInput, TokensInput

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "specs").glob("*.yaml"))


def small_spec(path: Path) -> specvit.Spec:
    """The preset with at most 2 blocks per stack (or per stage), a vocabulary of at most 1024 tokens and
    images of at most 512 pixels a side (larger ones 256x256); everything else as written."""
    spec = specvit.load_spec(path)
    over: dict[str, Any] = {
        f"{r}.depth": [min(d, 2) for d in s.depth] if isinstance(s.depth, list) else min(s.depth, 2)
        for r, s in spec.stacks.items()
    }
    for r, s in spec.stacks.items():
        if s.prefix_at:  # a prefix entering late (CaiT): one block before it, at most two after
            names = s.pattern()
            keep = names[:1] + names[s.prefix_at :][:2]
            over |= {f"{r}.depth": len(keep), f"{r}.prefix.at": 1, f"{r}.schedule": keep}
        if isinstance(s.input, TokensInput) and s.input.vocab > 1024:
            over[f"{r}.input.vocab"] = 1024
        if isinstance(s.input, ImageInput) and max(s.input.size) > 512:  # SAM's 1024x1024: 256x256
            over[f"{r}.input.size"] = 256
    return specvit.load_spec(path, overrides=over)


def small_graph(path: Path) -> ArchGraph:
    """The small preset's graph at batch 2 and short sequences (12 tokens; 12 and 9 for an encoder-decoder)."""
    return build_graph(small_spec(path), batch=2, seq_len=12, src_len=12, tgt_len=9)
