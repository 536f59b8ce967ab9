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


def test_a_weight_file_of_another_size_than_its_header_says_is_refused_unread(
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


# ------------------------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("command", ["render", "eject", "export", "schema", "import", "diff"])
@pytest.mark.parametrize("node", ["/dev/null", "/dev/full", "/proc/self/fd/1", "fifo"])
def test_an_output_that_is_not_a_regular_file_is_refused_and_left(
    command: str, node: str, tmp_path: Path
) -> None:
    """`-o` through a link to a device, to the process's stdout, or onto a FIFO: refused, the node kept."""
    out = tmp_path / {"render": "x.mmd", "eject": "x.py", "export": "x.onnx", "diff": "x.dot"}.get(
        command, "x.json"
    )
    if node == "fifo":
        os.mkfifo(out)
    else:
        out.symlink_to(node)
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 1}')
    argv = {
        "import": ["import", "hf", str(config)],
        "diff": ["diff", str(MNIST), str(MNIST)],
        "schema": ["schema"],
    }.get(command, [command, str(MNIST)])
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", *argv, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"specvit {command}: {out}: is " in run.stderr and "not a regular file" in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1
    assert out.is_symlink() or stat.S_ISFIFO(out.lstat().st_mode)  # the link or FIFO is still there
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISCHR(os.stat("/dev/full").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({out.name, "config.json"})


@pytest.mark.parametrize("length", [240, 254, 255])
def test_an_output_of_any_valid_name_length_is_written(length: int, tmp_path: Path) -> None:
    """The temporary file beside it must fit 255 bytes too: a 254-character name used to fail."""
    name = "é" * ((length - 4) // 2) + "x" * ((length - 4) % 2) + ".mmd"  # 2-byte characters
    assert len(name.encode()) == length
    assert main(["render", str(MNIST), "-o", str(tmp_path / name)]) == 0
    assert main(["eject", str(MNIST), "-o", str(tmp_path / name.replace(".mmd", ".py"))]) == 0
    assert sorted(len(p.name.encode()) for p in tmp_path.iterdir()) == [length - 1, length]
    assert (tmp_path / name).read_text().strip()


def test_diff_refuses_to_write_over_its_specs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.dot", tmp_path / "b.dot"
    a.write_text(MNIST.read_text())
    b.write_text(MNIST.read_text())
    before = a.read_bytes()
    for spec in (a, b):
        assert main(["diff", str(a), str(b), "-o", str(spec)]) == 1
        err = capsys.readouterr().err
        assert f"specvit diff: {spec}: is the spec itself" in err and "name another file" in err, err
    assert a.read_bytes() == before == b.read_bytes()
    assert main(["diff", str(a), str(b), "-o", str(tmp_path / "c.dot")]) == 0  # the control


# ------------------------------------------------------------------------------------ the process


def test_a_deleted_working_directory_is_named(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    code = (
        "import os, sys, specvit.cli as cli\n"
        f"os.chdir({str(gone)!r}); os.rmdir({str(gone)!r})\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    for argv in (["validate", "mnist_vit"], ["validate", "x.yaml"], ["render", str(MNIST), "-o", "x.mmd"]):
        gone.mkdir()
        if argv[1] == "mnist_vit":  # the control: a preset by name needs no working directory
            run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
            assert run.returncode == 0 and run.stdout.startswith("ok  mnist_vit"), run.stderr
            continue
        run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        assert run.returncode == 1 and "Traceback" not in run.stderr
        assert ": :" not in run.stderr and "does not exist" not in run.stderr, run.stderr
        assert "the working directory no longer exists" in run.stderr and run.stderr.count("\n") == 1


@pytest.mark.parametrize("argv", [["validate", str(MNIST)], ["summary", str(MNIST)], ["schema"]])
def test_a_full_standard_output_is_named(argv: list[str]) -> None:
    with open("/dev/full", "w") as full:  # opened for writing, never replaced
        run = subprocess.run(
            [sys.executable, "-m", "specvit.cli", *argv], stdout=full, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr and "Exception ignored" not in run.stderr
    assert run.stderr == (
        f"specvit {argv[0]}: cannot write to standard output: No space left on device (is the disk full, or the "
        "pipe closed?)\n"
    )


@pytest.mark.parametrize("which", ["all", "one"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_weights_in_a_dtype_the_model_cannot_compute_in_are_refused_at_load(
    which: str, dtype: torch.dtype, model: specvit.SpecModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float8 in model.safetensors: refused when loading, naming the dtype, not at the first forward."""
    directory = tmp_path / "ck"
    state = {
        k: v.to(dtype) if which == "all" or k.endswith("fc1.weight") else v
        for k, v in model.state_dict().items()
    }
    # save_pretrained refuses float8 itself: write the checkpoint as a tool without that check would
    monkeypatch.setattr(specvit.checkpoint, "check_weights", lambda *args, **kwargs: [])
    model.save_pretrained(directory, state_dict=state)
    monkeypatch.undo()
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError, match=rf"checkpoint has {name}, a dtype the model cannot compute in"):
        specvit.load_pretrained(directory)
    cast = specvit.load_pretrained(directory, dtype=torch.float32)  # the control: cast, it loads and runs
    assert cast(torch.randn(1, 1, 28, 28)).isfinite().all()
