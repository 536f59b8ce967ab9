"""The public API: every name in ``specvit.__all__`` is the function or class the docs call by that name."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import specvit

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "specvit").rglob("*.py"))]
NOT_IMPORTED = {"specvit.demo", "specvit.docs"}  # scripts (python -m ...), importable but with no API


def _called_names() -> dict[str, str]:
    """``specvit.NAME(`` as written in the README, the docs and the docstrings: name -> first place."""
    out: dict[str, str] = {}
    for path in TEXTS:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"(?<![\w.])specvit\.(\w+)\(", line):
                out.setdefault(name, f"{path.relative_to(ROOT)}:{i}")
    return out


def test_the_docs_call_functions_the_package_exports() -> None:
    called = _called_names()
    assert {"optimize", "load_spec", "build_model", "render"} <= set(called)
    missing = {name: where for name, where in called.items() if name not in specvit.__all__}
    assert missing == {}, "documented as specvit.NAME(...) but not exported"


@pytest.mark.parametrize("name", specvit.__all__)
def test_every_exported_name_is_a_function_or_class(name: str) -> None:
    value = getattr(specvit, name)
    assert not isinstance(value, types.ModuleType)
    assert name == "__version__" or inspect.isclass(value) or inspect.isfunction(value)
    if inspect.isfunction(value):
        assert value.__name__ == name and "Args:" in (value.__doc__ or "")


def test_importing_every_submodule_leaves_the_exports_alone() -> None:
    # `import specvit.optimize` (the module) used to replace the function `specvit.optimize`
    before = {name: getattr(specvit, name) for name in specvit.__all__}
    for info in pkgutil.walk_packages(specvit.__path__, "specvit."):
        if info.name not in NOT_IMPORTED:
            importlib.import_module(info.name)
    after = {name: getattr(specvit, name) for name in specvit.__all__}
    assert after == before


def test_optimize_as_its_docstring_writes_it() -> None:
    model = specvit.build_model(ROOT / "specs" / "mnist_vit.yaml").eval()
    fast = specvit.optimize(model, for_="inference", compile=False)
    (x,) = specvit.example_inputs(model, batch=2)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
    assert fast is not model


def test_dir_lists_the_lazy_names_and_import_stays_light() -> None:
    assert set(specvit.__all__) <= set(dir(specvit))
    code = "import sys, specvit; assert 'torch' not in sys.modules, 'import specvit imported torch'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr


def test_version_is_the_packages() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert specvit.__version__ == project["version"]
