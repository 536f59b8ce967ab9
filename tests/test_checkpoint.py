"""Checkpoints (safetensors, never pickle), atomic writes, and refusing models that do not fit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import specvit
from specvit.checkpoint import CheckpointError
from specvit.compile import load_pretrained
from specvit.io import atomic_write

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT / "specs" / "mnist_vit.yaml"


def _model(**over: object) -> specvit.SpecModel:
    torch.manual_seed(0)
    return specvit.build_model(MNIST, overrides=over or None).eval()


def test_save_and_load_give_equal_outputs(tmp_path: Path) -> None:
    model = _model()
    model.save_pretrained(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path / "ck")) == ["checkpoint.json", "model.safetensors", "spec.yaml"]
    again = load_pretrained(tmp_path / "ck").eval()
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(model(x), again(x))
    assert again.spec == model.spec


def test_tied_and_shared_weights_survive_a_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = specvit.build_model(
        ROOT / "specs" / "transformer_base.yaml", overrides={"encoder.depth": 1, "decoder.depth": 1}
    ).eval()
    model.save_pretrained(tmp_path / "ck")
    again = load_pretrained(tmp_path / "ck").eval()
    assert again.head.fc.weight is again.encoder.tok_embed.weight  # type: ignore[union-attr]
    src, tgt = torch.randint(0, 37000, (2, 5)), torch.randint(0, 37000, (2, 4))
    assert torch.equal(model(src, tgt), again(src, tgt))


def test_non_empty_directory_is_refused_unless_overwrite(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    model = _model()
    with pytest.raises(CheckpointError, match="is not empty; pass overwrite=True"):
        model.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_weights_that_do_not_match_the_spec_are_refused(tmp_path: Path) -> None:
    _model().save_pretrained(tmp_path / "ck")
    spec = specvit.load_spec(MNIST, overrides={"encoder.width": 256, "encoder.block.mlp.hidden": 512})
    (tmp_path / "ck" / "spec.yaml").write_text(spec.to_yaml())
    with pytest.raises(CheckpointError) as info:
        load_pretrained(tmp_path / "ck")
    text = str(info.value)
    assert "encoder.prefix.cls_token: checkpoint has [1, 1, 512], the spec needs [1, 1, 256]" in text
    assert "encoder.blocks.0.mlp.fc1.weight: checkpoint has [1024, 512], the spec needs [512, 256]" in text


def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    _model().save_pretrained(tmp_path / "ck")
    (tmp_path / "ck" / "spec.yaml").write_text(
        specvit.load_spec(MNIST, overrides={"encoder.depth": 2}).to_yaml()
    )
    with pytest.raises(CheckpointError, match=r"missing encoder\.blocks\.1\.attn\.qkv\.weight \[1536, 512\]"):
        load_pretrained(tmp_path / "ck")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_weight_file_is_a_clear_error(tmp_path: Path, damage: str) -> None:
    _model().save_pretrained(tmp_path / "ck")
    weights = tmp_path / "ck" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated or corrupted"):
        load_pretrained(tmp_path / "ck")


def test_failed_write_leaves_the_old_file_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, b"new" * 1000)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temporary file left behind


def test_model_too_large_is_refused_before_allocating() -> None:
    with pytest.raises(specvit.SpecError) as info:
        specvit.build_model(ROOT / "specs" / "vit_huge_patch14_224.yaml", max_bytes=10**9)
    assert str(info.value) == (
        "vit_huge_patch14_224: its 632,045,800 parameters need 2.5GB as float32, more than the limit given "
        '(1.0GB) (build it on device="meta" to inspect it without allocating, or on a machine with more memory)'
    )
    meta = specvit.build_model(ROOT / "specs" / "vit_huge_patch14_224.yaml", device="meta", max_bytes=1)
    assert sum(p.numel() for p in meta.parameters()) == 632_045_800


def test_bf16_halves_the_estimate() -> None:
    with pytest.raises(specvit.SpecError, match=r"need 1\.3GB as bfloat16"):
        specvit.build_model(
            ROOT / "specs" / "vit_huge_patch14_224.yaml", dtype=torch.bfloat16, max_bytes=10**9
        )
