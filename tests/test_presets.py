"""The bundled presets by name: from any directory, through extends, in a wheel, listed by `specvit presets`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from presets import PRESETS, ROOT

import specvit
from specvit.cli import main
from specvit.spec.presets import preset_dir, preset_names

CHILD = "specvit: 1\nextends: vit_small_patch16_224.yaml\nname: mine\nencoder:\n  drop_path: 0.1\n"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_by_name_from_anywhere(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # outside the repository
    assert specvit.load_spec(path.stem) == specvit.load_spec(path)
    assert specvit.load_spec(path.name) == specvit.load_spec(path)


def test_extends_a_preset_by_name_from_outside_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text(CHILD)
    spec = specvit.load_spec("mine.yaml")
    base = specvit.load_spec("vit_small_patch16_224")
    assert spec.encoder is not None and base.encoder is not None
    assert spec.encoder.drop_path == 0.1 and spec.encoder.width == base.encoder.width == 384


def test_a_file_beside_the_spec_wins_over_the_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    local = (ROOT / "specs" / "vit_small_patch16_224.yaml").read_text().replace("width: 384", "width: 192")
    (tmp_path / "vit_small_patch16_224.yaml").write_text(local)
    (tmp_path / "mine.yaml").write_text(CHILD)
    spec = specvit.load_spec("mine.yaml")
    assert spec.encoder is not None and spec.encoder.width == 192
    assert specvit.load_spec("vit_small_patch16_224.yaml").encoder.width == 192  # type: ignore[union-attr]


def test_a_name_near_a_preset_is_suggested(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(specvit.SpecError, match="use the bundled preset 'vit_base_patch16_224'"):
        specvit.load_spec("vit_base_patch16_244")
    (tmp_path / "c.yaml").write_text(CHILD.replace("vit_small_patch16_224", "vit_smal_patch16_224"))
    with pytest.raises(specvit.SpecError, match=r"2:10: .*use the bundled preset 'vit_small_patch16_224'"):
        specvit.load_spec("c.yaml")
    with pytest.raises(specvit.SpecError, match="specvit presets lists them"):
        specvit.load_spec("nothing_like_it.yaml")


def test_specvit_presets_lists_every_preset_with_its_params(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed["presets"]] == [p.stem for p in PRESETS] == preset_names()
    assert listed["unit"] == "FLOPs (2 x MACs)"
    for row in listed["presets"]:
        graph = specvit.build_graph(specvit.load_spec(row["name"]))
        totals = (graph.total_params, graph.total_flops, graph.total_useful_flops, graph.dims)
        assert (row["params"], row["flops"], row["useful_flops"], row["dims"]) == totals
    assert main(["presets"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["name", "model", "params", "FLOPs", "useful", "FLOPs", "at", "description"]
    rows = {line.split()[0]: line.split() for line in table[1:] if line}
    assert rows["vit_base_patch16_224"][:6] == [
        "vit_base_patch16_224",
        "encoder",
        "86.6M",
        "35.1G",
        "35.1G",
        "B=1",
    ]
    assert rows["gpt2_small"][:7] == ["gpt2_small", "decoder", "124.4M", "32.2G", "31.9G", "B=1,", "S=128"]
    assert rows["mistral_7b"][:3] == ["mistral_7b", "decoder", "7.2B"]  # billions of parameters: B, not G
    assert table[-2].startswith("FLOPs (2 x MACs) of one forward at the sizes under 'at'")
    assert table[-1].startswith(f"{len(PRESETS)} presets in {preset_dir()}")


def test_the_package_list_is_complete() -> None:
    tomllib = pytest.importorskip("tomllib")
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "specvit").rglob("__init__.py")}
    assert set(tool["packages"]) == found | {"specvit.presets"}
    assert tool["package-dir"]["specvit.presets"] == "specs"


def test_a_wheel_carries_the_presets_and_finds_them_by_name(tmp_path: Path) -> None:
    # Built from the checkout's files (not ignored ones) and installed into a bare folder: what pip install gives.
    source = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for name in files.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("specvit-*.whl")
    data = sorted(n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("specvit/presets/"))
    assert data == [f"specvit/presets/{p.name}" for p in PRESETS]
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.yaml").write_text(CHILD)
    code = (
        "import specvit, sys\n"
        "from specvit.spec.presets import preset_dir\n"
        "assert str(preset_dir()).startswith(sys.argv[1]), preset_dir()\n"
        "print(specvit.load_spec('vit_base_patch16_224').name, specvit.load_spec('mine.yaml').encoder.width)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["vit_base_patch16_224", "384"]
