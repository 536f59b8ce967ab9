"""Deployment: torch.export and ONNX (onnxruntime) with dynamic batch and sequence, equal to eager within 1e-4."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from reference import converted, timm_model
from timm_cases import CONVERTED

import specvit
from specvit.export import example_inputs, export_onnx, export_program

pytestmark = pytest.mark.slow  # `make test-all` runs it; `make test` leaves it out (see README)

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "vit": ("vit_tiny_patch16_224", {"encoder.depth": 2}),
    "bert": (
        "bert_base",
        {"encoder.depth": 2, "encoder.width": 128, "encoder.block.heads": 4, "encoder.block.mlp.hidden": 256},
    ),
}


def _model(name: str) -> specvit.SpecModel:
    spec, over = CASES[name]
    torch.manual_seed(0)
    model = specvit.build_model(ROOT / "specs" / f"{spec}.yaml", overrides=over).eval()
    for p in model.parameters():  # random everywhere, so a zero head cannot hide a wrong export
        torch.nn.init.normal_(p, std=0.05)
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_export_has_a_dynamic_batch_and_sequence(name: str) -> None:
    model = _model(name)
    program = export_program(model)  # traced at batch 2 and the graph's length (128)
    sizes = [(1, None), (5, None)] + ([(3, 7), (2, 512)] if name == "bert" else [])  # 512: BERT's max_len
    for batch, seq_len in sizes:
        x = example_inputs(model, batch, seq_len=seq_len)
        with torch.no_grad():
            # the exported graph runs the same fp32 kernels as eager: equal (0.0) seen
            torch.testing.assert_close(program.module()(*x), model(*x), atol=1e-5, rtol=0)


def test_sequence_limits_and_example_lengths() -> None:
    from specvit.inputs import dynamic_axes, sequence_limits

    bert = specvit.load_spec("bert_base")
    assert sequence_limits(bert) == {"S": 512}
    assert sequence_limits(specvit.load_spec("transformer_base")) == {"S_src": 1 << 20, "S_tgt": 1 << 20}
    model = _model("bert")
    assert dynamic_axes(model.graph) == {"x": {0: "batch", 1: "seq_len"}}
    assert dynamic_axes(specvit.build_graph(specvit.load_spec("vit_tiny_patch16_224"))) == {"x": {0: "batch"}}
    assert example_inputs(model, 3, seq_len=9)[0].shape == (3, 9)
    with pytest.raises(ValueError, match=r"seq_len 513 is longer than bert_base takes \(S <= 512\)"):
        example_inputs(model, 2, seq_len=513)


@pytest.mark.parametrize("name", sorted(CASES))
def test_onnx_runs_in_onnxruntime_at_another_batch(name: str, tmp_path: Path) -> None:
    model = _model(name)
    path = export_onnx(model, tmp_path / f"{name}.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    axes = {"vit": ["batch", 3, 224, 224], "bert": ["batch", "seq_len"]}[name]
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("x", axes)]
    x = example_inputs(model, 3, seq_len=40 if name == "bert" else None)
    got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), x, strict=True)})[0]
    with torch.no_grad():
        want = model(*x).numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4  # onnxruntime's own fp32 kernels: 1.2e-7 seen on outputs near 0.3


def _cli(*args: str, stderr: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specvit.cli", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        cwd=ROOT,
    )


def test_cli_export(tmp_path: Path) -> None:
    out = tmp_path / "mnist.onnx"
    old_umask = os.umask(0o022)
    try:
        run = _cli("export", "specs/mnist_vit.yaml", "-o", str(out))
    finally:
        os.umask(old_umask)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"wrote {out} (dynamic: batch)\n"
    assert run.stderr == ""  # no exporter warnings, no progress off a terminal
    assert out.stat().st_mode & 0o777 == 0o644  # as every other file specvit writes
    assert [p.name for p in tmp_path.iterdir()] == ["mnist.onnx"]  # no temporary left behind
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["x"]
    assert session.run(None, {"x": np.zeros((4, 1, 28, 28), np.float32)})[0].shape == (4, 10)


def test_cli_export_seq_len_and_its_usage_errors(tmp_path: Path) -> None:
    out = tmp_path / "s.onnx"
    run = _cli("export", "tiny_seq2seq", "--seq-len", "6", "-o", str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"wrote {out} (dynamic: batch, src_len, tgt_len)\n" and run.stderr == ""
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.shape for i in session.get_inputs()] == [["batch", "src_len"], ["batch", "tgt_len"]]
    feed = {"src": np.ones((3, 11), np.int64), "tgt": np.ones((3, 4), np.int64)}
    assert session.run(None, feed)[0].shape == (3, 4, 12)
    for args, message in [
        (["--seq-len", "1"], "argument --seq-len: must be 2 or more"),
        (["--seq-len", "ten"], "argument --seq-len: expected a whole number, got 'ten'"),
        (["--set", "decoder.position={kind: learned, max_len: 8}", "--seq-len", "9"], "S_tgt <= 8"),
    ]:
        bad = _cli("export", "tiny_seq2seq", *args, "-o", str(tmp_path / "bad.onnx"))
        assert bad.returncode == 2 and "specvit export: error: " in bad.stderr and message in bad.stderr
        assert bad.stderr.startswith("usage: specvit export")
    none = _cli("export", "-o", str(tmp_path / "bad.onnx"))
    assert none.returncode == 2 and "specvit export: error: give a SPEC or --checkpoint DIR" in none.stderr
    assert not (tmp_path / "bad.onnx").exists()


def _on_a_terminal(*args: str) -> str:
    """What ``specvit ARGS`` shows on a terminal's standard error (a pseudo-terminal)."""
    leader, follower = pty.openpty()
    try:
        # read while it runs: a terminal holds a few KB, and a spinner that filled it would block the export
        run = subprocess.Popen(
            [sys.executable, "-m", "specvit.cli", *args], stdout=subprocess.DEVNULL, stderr=follower, cwd=ROOT
        )
        os.close(follower)
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: everything is read
                break
            if not chunk:
                break
            shown += chunk
        status = run.wait(timeout=600)
    finally:
        os.close(leader)
    assert status == 0
    return shown.decode(errors="replace")


def test_export_shows_progress_on_a_terminal_unless_quiet(tmp_path: Path) -> None:
    shown = _on_a_terminal("export", "tiny_seq2seq", "-o", str(tmp_path / "a.onnx"))
    assert "export tiny_seq2seq" in shown and "tracing and translating to ONNX" in shown
    assert "Warning" not in shown
    assert _on_a_terminal("export", "tiny_seq2seq", "--quiet", "-o", str(tmp_path / "b.onnx")) == ""


def test_atomic_save_puts_side_files_first_with_plain_modes(tmp_path: Path) -> None:
    from specvit.io import atomic_save

    target = tmp_path / "m.onnx"
    target.write_bytes(b"old")

    def save(staged: Path) -> None:  # as ONNX does for models over 2 GB: weights beside the graph
        (staged.parent / f"{staged.name}.data").write_bytes(b"weights")
        staged.write_bytes(b"graph")
        staged.chmod(0o600)

    def fail(staged: Path) -> None:
        staged.write_bytes(b"half")
        raise RuntimeError("exporter failed")

    old_umask = os.umask(0o022)
    try:
        with pytest.raises(RuntimeError, match="exporter failed"):
            atomic_save(target, fail)
        assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
        target.unlink()
        assert atomic_save(target, save) == target
    finally:
        os.umask(old_umask)
    assert target.read_bytes() == b"graph" and (tmp_path / "m.onnx.data").read_bytes() == b"weights"
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {
        "m.onnx": 0o644,
        "m.onnx.data": 0o644,
    }


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_converted_timm_models_export_to_onnx(name: str, tmp_path: Path) -> None:
    """A timm model read by from_timm, its weights converted: the ONNX file computes timm's outputs."""
    timm_name, kwargs = CONVERTED[name]
    ref = timm_model(timm_name, seed=4, **kwargs)
    model = converted(ref, specvit.from_timm(ref), "timm")
    path = export_onnx(model, tmp_path / f"{name}.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (x,) = example_inputs(model, 3)
    got = session.run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        want = ref(x).numpy()
    assert np.abs(got - want).max() <= 1e-4  # onnxruntime's fp32 kernels against timm's eager ones
