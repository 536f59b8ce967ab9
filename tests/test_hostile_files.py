"""Hostile input, third round: files are read only if they are regular files, with a size bound, and
outputs replace only regular files. Nothing here writes to a real device node: the special files are
FIFOs, sparse files and symlinks made under tmp_path."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specvit
from specvit.checkpoint import CheckpointError
from specvit.cli import main
from specvit.io import Unreadable, read_regular

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT / "specs" / "mnist_vit.yaml"
SMALL = {"encoder.width": 32, "encoder.block.heads": 2, "encoder.block.mlp.hidden": 64}
KINDS = ["fifo", "dev_zero", "dev_urandom", "sparse", "directory"]


def _special(path: Path, kind: str, size: int = 8 << 30) -> str:
    """Make ``path`` a special file of ``kind``; return the words the refusal must hold."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return "is not a regular file but a FIFO"
    if kind == "directory":
        path.mkdir()
        return "is a directory"
    if kind == "sparse":
        with path.open("wb") as f:
            f.truncate(size)  # a hole: no block is written
        return f"{size:,} bytes"
    path.symlink_to("/dev/" + kind.removeprefix("dev_"))
    return "is not a regular file but a character device"


@pytest.mark.parametrize("kind", KINDS)
def test_read_regular_refuses_what_is_not_a_regular_file(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "x"
    words = _special(path, kind)
    with pytest.raises(Unreadable) as info:
        read_regular(path, 1 << 20, "spec")
    assert f"spec '{path}'" in str(info.value) and words in str(info.value)
    path.unlink() if not path.is_dir() else path.rmdir()
    path.write_bytes(b"x" * 10)  # the control: a regular file within the limit is read
    assert read_regular(path, 10, "spec") == b"x" * 10
    with pytest.raises(Unreadable, match="10 bytes, over the 9-byte limit"):
        read_regular(path, 9, "spec")


@pytest.mark.parametrize("kind", KINDS)
def test_a_spec_that_is_not_a_regular_file_is_a_one_line_message(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    words = _special(path, kind)
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == (2 if kind == "sparse" else 1) and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and str(path) in run.stderr, run.stderr
    assert words in run.stderr or "over the 1,048,576-byte limit" in run.stderr, run.stderr


@pytest.fixture(scope="module")
def model() -> specvit.SpecModel:
    torch.manual_seed(0)
    return specvit.build_model(MNIST, overrides=SMALL).eval()


@pytest.mark.parametrize("name", ["spec.yaml", "model.safetensors", "checkpoint.json"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_file_of_a_checkpoint_is_read_only_if_regular(
    name: str, kind: str, model: specvit.SpecModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "ck"
    model.save_pretrained(directory)
    words = _special(directory / name, kind)
    with pytest.raises(CheckpointError) as info:
        specvit.load_pretrained(directory)
    message = str(info.value)
    assert str(directory / name) in message and "save the model again" in message, message
    if kind != "sparse":
        assert words in message, message
    assert main(["export", "--checkpoint", str(directory), "-o", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(directory / name) in err, err
    assert not (tmp_path / "x.onnx").exists()


def test_a_weight_file_larger_than_its_manifest_says_is_refused_before_reading(
    model: specvit.SpecModel, tmp_path: Path
) -> None:
    directory = tmp_path / "ck"
    model.save_pretrained(directory)
    weights = directory / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(64 << 30)  # sparse: 64 GiB that take no disk, more than the machine's memory
    with pytest.raises(
        CheckpointError, match=rf"its header describes {size:,} bytes, the file holds 68,719,476,736"
    ):
        specvit.load_pretrained(directory)
    with weights.open("r+b") as f:
        f.truncate(size)  # the control: cut back, it loads
    assert specvit.load_pretrained(directory).spec == model.spec
    assert stat.S_ISREG(weights.stat().st_mode)
