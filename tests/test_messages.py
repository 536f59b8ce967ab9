"""Messages for the slips of people who come from timm, HF transformers, x-transformers and PyTorch: their
names get specvit's key and where it goes, one mistake gives one message, and ``--set`` reaches into a
shorthand. Every message is quoted whole."""

from __future__ import annotations

from typing import Any

import pytest

import specvit
from specvit import SpecError

VIT = """specvit: 1
name: tiny
model: encoder
encoder:
  input: {kind: image, size: 32, patch: 8, channels: 3}
  prefix: {cls: true}
  position: learned
  width: 64
  depth: 2
  block:
    heads: 4
    layers: [self_attention, mlp]
    norm: {kind: layernorm, placement: pre, eps: 1.0e-6}
    mlp: {ratio: 4, activation: gelu}
head: {kind: classifier, pool: cls, classes: 10}
"""


def _problems(text: str, overrides: dict[str, Any] | None = None) -> list[str]:
    """Every problem of the spec, one line each, as ``specvit validate`` prints them."""
    with pytest.raises(SpecError) as info:
        specvit.parse_spec(text, source="t.yaml", overrides=overrides)
    return str(info.value).splitlines()


def _edit(old: str, new: str) -> str:
    assert old in VIT
    return VIT.replace(old, new, 1)


def test_heads_that_do_not_divide_the_width_give_one_message() -> None:
    """Not also "encoder.position: rope2d needs a head dim divisible by 4, got 12"."""
    text = _edit("heads: 4", "heads: 5").replace("position: learned", "position: rope2d")
    assert _problems(text) == [
        "t.yaml:11:12: encoder.block.heads: width 64 is not divisible by 5 heads (use a divisor of 64 such as "
        "4 or 8, or set block.head_dim)"
    ]


def test_a_rope_check_still_runs_when_the_heads_divide() -> None:
    text = _edit("heads: 4", "heads: 8").replace("position: learned", "position: rope2d")  # head dim 8
    assert specvit.parse_spec(text).encoder.head_dim == 8  # type: ignore[union-attr]
    text = _edit("heads: 4", "heads: 4\n    head_dim: 6").replace("position: learned", "position: rope2d")
    assert _problems(text) == [
        "t.yaml:7:13: encoder.position: rope2d needs a head dim divisible by 4, got 6 (pick heads (or head_dim) "
        "so that width/heads is a multiple of 4)"
    ]


def test_independent_problems_beside_the_heads_are_still_all_reported() -> None:
    text = _edit("heads: 4", "heads: 5").replace("size: 32", "size: 36")
    assert _problems(text) == [
        "t.yaml:5:41: encoder.input.patch: image size 36 is not divisible by patch 8 (use a patch size that "
        "divides 36, such as 6 or 9)",
        "t.yaml:11:12: encoder.block.heads: width 64 is not divisible by 5 heads (use a divisor of 64 such as "
        "4 or 8, or set block.head_dim)",
    ]
