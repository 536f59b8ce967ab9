"""What a plain `pip install specvit` brings: diagrams out of the box where pygraphviz has a wheel."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from presets import ROOT

from specvit.diagram import render

tomllib = pytest.importorskip("tomllib")

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# The platforms pygraphviz 2.0.4 publishes wheels for (pip install --dry-run --only-binary :all: --platform
# ..., November 2026): manylinux x86_64 and aarch64, macOS arm64, Windows amd64. macOS x86_64 has none.
WHEELS = {
    "linux-x86_64": {"sys_platform": "linux", "platform_machine": "x86_64"},
    "linux-aarch64": {"sys_platform": "linux", "platform_machine": "aarch64"},
    "macos-arm64": {"sys_platform": "darwin", "platform_machine": "arm64"},
    "windows-x64": {"sys_platform": "win32", "platform_machine": "AMD64"},
}
NO_WHEEL = {
    "macos-x86_64": {"sys_platform": "darwin", "platform_machine": "x86_64"},
    "linux-ppc64le": {"sys_platform": "linux", "platform_machine": "ppc64le"},
    "windows-arm64": {"sys_platform": "win32", "platform_machine": "ARM64"},
}


def _default_requirement(name: str) -> Requirement:
    found = [r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == name]
    assert len(found) == 1, f"{name} is not a default dependency"
    return found[0]


def _applies(req: Requirement, env: dict[str, str]) -> bool:
    full: dict[str, Any] = {**default_environment(), **env}
    return req.marker is None or req.marker.evaluate(full)


@pytest.mark.parametrize("env", WHEELS.values(), ids=WHEELS.keys())
def test_pygraphviz_is_a_default_dependency_where_its_wheel_exists(env: dict[str, str]) -> None:
    assert _applies(_default_requirement("pygraphviz"), env)


@pytest.mark.parametrize("env", NO_WHEEL.values(), ids=NO_WHEEL.keys())
def test_pygraphviz_is_not_compiled_by_a_plain_install_elsewhere(env: dict[str, str]) -> None:
    assert not _applies(_default_requirement("pygraphviz"), env)
    assert any(
        Requirement(r).name == "pygraphviz" for r in PYPROJECT["project"]["optional-dependencies"]["render"]
    )


def test_a_plain_install_renders_svg_png_pdf_without_system_graphviz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _applies(_default_requirement("pygraphviz"), {}):
        pytest.skip("no pygraphviz wheel for this platform; the .dot fallback is tested in test_render.py")
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no `dot` on PATH: pygraphviz must draw
    spec = ROOT / "specs" / "mnist_vit.yaml"
    assert ET.parse(render(spec, tmp_path / "m.svg")).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    assert render(spec, tmp_path / "m.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert render(spec, tmp_path / "m.pdf").read_bytes().startswith(b"%PDF")
