"""Every documented command that claims learning is run, and must learn (docs/distributed.md)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from presets import ROOT

CHANCE = 2.303  # ln 10: the 10-class synthetic digits at random
LEARNED = 1.8  # seed 0 ends at 0.99, seeds 1-4 between 0.44 and 1.48 (lr 1e-4, 200 steps)


def _first_command() -> list[str]:
    """The first `python examples/train.py ...` line of docs/distributed.md, as the docs write it."""
    text = (ROOT / "docs" / "distributed.md").read_text()
    line = next(m for m in re.findall(r"^python (examples/train\.py .*)$", text, flags=re.M))
    return shlex.split(line)


def _losses(argv: list[str], log: Path) -> list[float]:
    run = subprocess.run(
        [sys.executable, *argv, "--log", str(log)], capture_output=True, text=True, cwd=ROOT, timeout=900
    )
    assert run.returncode == 0, run.stderr
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_the_first_command_of_distributed_md_learns(tmp_path: Path) -> None:
    argv = _first_command()
    assert argv[:2] == ["examples/train.py", "specs/mnist_vit.yaml"] and "--lr" in argv
    losses = _losses(argv, tmp_path / "run.jsonl")
    assert len(losses) == 10  # --steps 200 --every 20
    assert losses[0] > 2.0, "it should start near chance"
    assert losses[-1] < LEARNED, f"the documented command does not learn: {losses}"
    # the broken control: without positions the bright patch's index cannot be told, so nothing is learned
    blind = _losses([*argv, "--set", "encoder.position=none"], tmp_path / "blind.jsonl")
    assert min(blind[-3:]) > 2.0 > LEARNED, f"the control learned, so the test proves nothing: {blind}"
    assert abs(blind[-1] - CHANCE) < 0.2
