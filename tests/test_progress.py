"""Waits over a few seconds show what is under way on a terminal (builds, checkpoint reads, the demo's
phases), and nothing when standard error is not one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specvit
from specvit import compile as compile_module
from specvit import pretrained, progress

TINY = "tiny_seq2seq"  # a preset


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Standard error as a terminal: progress on, and rich drawing into the captured stream."""
    monkeypatch.setattr(progress, "enabled", lambda quiet=False: True)
    monkeypatch.setattr(compile_module, "enabled", lambda quiet=False: True)
    monkeypatch.setattr(pretrained, "enabled", lambda quiet=False: True)
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")


def test_a_large_build_shows_its_stages(
    terminal: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compile_module, "SHOWN_PARAMS", 0)  # every build counts as large
    specvit.build_model(TINY)
    err = capsys.readouterr().err
    assert "build tiny_seq2seq" in err and "initialise the weights" in err


def test_a_small_build_and_a_build_off_a_terminal_are_quiet(
    terminal: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    specvit.build_model(TINY)  # under SHOWN_PARAMS
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(compile_module, "SHOWN_PARAMS", 0)
    monkeypatch.setattr(compile_module, "enabled", lambda quiet=False: False)
    specvit.build_model(TINY)
    assert capsys.readouterr().err == ""


def test_reading_a_large_checkpoint_shows_a_bar_of_its_bytes(
    terminal: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    capsys.readouterr()
    specvit.from_pretrained(tmp_path)
    assert capsys.readouterr().err == ""  # a small checkpoint: no bar
    monkeypatch.setattr(pretrained, "SHOWN_BYTES", 0)
    specvit.from_pretrained(tmp_path)
    err = capsys.readouterr().err
    assert f"read {tmp_path.name}" in err and "kB" in err
