"""make demo's table runs for every kind of input and output (a failing preset would stop the demo)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specvit import demo

ROOT = Path(__file__).resolve().parents[1]
KINDS = {  # one preset per input/output kind, plus one too large to build for real
    "mnist_vit": "image -> classifier",
    "tiny_seq2seq": "tokens -> lm (encoder-decoder)",
    "detr_resnet50": "features + queries -> detection dict",
    "transformer_big": "built on the meta device",
}


def test_demo_table_covers_every_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in KINDS:
        shutil.copy(ROOT / "specs" / f"{name}.yaml", specs)
    shutil.copy(ROOT / "specs" / "transformer_base.yaml", specs)  # transformer_big extends it
    monkeypatch.setattr(demo, "SPECS", specs)
    monkeypatch.setattr(demo, "OUT", tmp_path / "diagrams")
    monkeypatch.setattr(demo, "ROOT", tmp_path)
    assert demo.models() == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "logits 1x100x92 + boxes 1x100x4" in rows["detr_resnet50"]
    assert " meta " in rows["transformer_big"]
    assert "1x16x12" in rows["tiny_seq2seq"]
    assert sorted(p.name for p in (tmp_path / "diagrams").iterdir()) == sorted(
        f"{n}.svg" for n in [*KINDS, "transformer_base"]
    )
