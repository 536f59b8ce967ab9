"""timm and transformers import on this CPU-only torch because specvit is imported first: each case runs in
a fresh interpreter (tests/conftest.py installs the same hook in this one), beside a control without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specvit.interop import compat

ROOT = Path(__file__).resolve().parents[1]
MISSING = "RuntimeError: operator torchvision::nms does not exist"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter of this environment, from the checkout's root."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def broken_torchvision() -> None:
    """The control: without specvit, ``import timm`` fails here (skips where torchvision's ops load)."""
    pytest.importorskip("timm")
    run = _python("import timm")
    if run.returncode == 0:
        pytest.skip("torchvision's C++ ops load with this torch: there is nothing to fix")
    assert MISSING in run.stderr


def test_without_specvit_transformers_fails_as_timm_does(broken_torchvision: None) -> None:
    pytest.importorskip("transformers")
    run = _python("from transformers import LlamaConfig, LlamaForCausalLM")
    assert run.returncode != 0
    assert MISSING in run.stderr
    assert "Could not import module 'LlamaConfig'" in run.stderr


def test_import_specvit_first_makes_timm_and_transformers_import(broken_torchvision: None) -> None:
    pytest.importorskip("transformers")
    code = """
import sys
import specvit
assert "torch" not in sys.modules, "the hook imported torch before torchvision was imported"
import timm
import torch
import torchvision
from transformers import LlamaConfig, LlamaForCausalLM

model = timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32, num_classes=3).eval()
spec = specvit.from_timm(model)
ours = specvit.build_model(spec).eval()
ours.load_state_dict(specvit.convert_state_dict(model.state_dict(), "timm", spec), strict=True)
x = torch.randn(2, 3, 32, 32)
print(bool((ours(x) - model(x)).abs().max() < 1e-5))
print(specvit.interop.compat.defined_ops())
try:
    torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
except RuntimeError as exc:
    print(str(exc).split(".")[0])
"""
    run = _python(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "True",
        "['torchvision::nms', 'torchvision::qnms']",
        "Couldn't load custom C++ ops",  # the ops have schemas only: torchvision still says it has none
    ]


def test_a_torchvision_whose_ops_are_defined_is_left_alone(broken_torchvision: None) -> None:
    """Schemas defined before torchvision's import (as a loaded ``_C`` defines them): the hook adds none."""
    code = f"""
import torch
library = torch.library.Library("torchvision", "DEF")
for schema in {compat.SCHEMAS!r}:
    library.define(schema)
import specvit
import timm
print(specvit.interop.compat.defined_ops())
"""
    run = _python(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[]"]


def test_the_hook_is_installed_once() -> None:
    compat.torchvision_ops()
    compat.torchvision_ops()
    assert sum(isinstance(f, compat._BeforeMetaRegistrations) for f in sys.meta_path) == 1
