"""The docs are true to the code: generated files are current and every example runs."""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import specvit
from specvit.codegen.eject import eject_source
from specvit.codegen.emit import forward_source
from specvit.codegen.scopes import analyse
from specvit.docs import spec_reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for i, block in enumerate(re.findall(rf"```{lang}\n(.*?)```", doc.read_text(), flags=re.S)):
            out.append((f"{doc.name}:{lang}{i}", block))
    return out


def test_spec_reference_is_current() -> None:
    assert (ROOT / "docs" / "spec.md").read_text() == spec_reference(), "run: python -m specvit.docs"


def _generated() -> list[tuple[str, str, str, str]]:
    """Blocks fenced as ```python generated SPEC SCOPE: a scope's generated forward, as the docs show it."""
    out = []
    for doc in DOCS:
        for spec, scope, code in re.findall(
            r"```python generated (\S+) (\S+)\n(.*?)```", doc.read_text(), flags=re.S
        ):
            out.append((f"{doc.name}:{scope}", spec, scope, code))
    return out


@pytest.mark.parametrize(("where", "spec", "scope", "code"), _generated(), ids=[w for w, *_ in _generated()])
def test_generated_code_in_the_docs_is_what_the_compiler_writes(
    where: str, spec: str, scope: str, code: str
) -> None:
    graph = specvit.build_graph(specvit.load_spec(ROOT / spec))
    scopes = analyse(graph)
    assert forward_source(graph, scopes, scopes[scope]) + "\n" == code


def _ejected() -> list[tuple[str, str, str, str]]:
    """Blocks fenced as ```python ejected SPEC CLASS: a class of the ejected file, as the docs show it."""
    out = []
    for doc in DOCS:
        for spec, name, code in re.findall(
            r"```python ejected (\S+) (\S+)\n(.*?)```", doc.read_text(), flags=re.S
        ):
            out.append((f"{doc.name}:{name}", spec, name, code))
    return out


@pytest.mark.parametrize(("where", "spec", "name", "code"), _ejected(), ids=[w for w, *_ in _ejected()])
def test_ejected_code_in_the_docs_is_what_eject_writes(where: str, spec: str, name: str, code: str) -> None:
    text = eject_source(specvit.build_graph(specvit.load_spec(ROOT / spec)), spec, use_ruff=False)
    found = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"{spec}'s file has no class {name}"
    assert ast.get_source_segment(text, found[0]) + "\n" == code


FOREIGN = re.compile(r"^(import|from) (timm|transformers)\b", flags=re.M)
"""Blocks importing these run in a fresh interpreter, as a reader runs them: in this one, conftest.py has
made them importable already (on a CPU-only torch they need specvit imported first)."""


@pytest.mark.parametrize(("where", "code"), _blocks("python"), ids=[w for w, _ in _blocks("python")])
def test_python_examples_run(where: str, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if FOREIGN.search(code):
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600
        )
        assert run.returncode == 0, f"{where} fails as written:\n{run.stderr}"
        return
    monkeypatch.chdir(ROOT)
    exec(compile(code, where, "exec"), {})


@pytest.mark.parametrize(("where", "text"), _blocks("yaml"), ids=[w for w, _ in _blocks("yaml")])
def test_yaml_examples_validate(where: str, text: str, tmp_path: Path) -> None:
    if "model:" not in text and "extends:" not in text:
        pytest.skip("a fragment, not a whole spec")
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    path = tmp_path / "specs" / "example.yaml"
    path.write_text(text)
    assert isinstance(specvit.load_spec(path), specvit.Spec)


@pytest.mark.parametrize(("where", "session"), _blocks("console"), ids=[w for w, _ in _blocks("console")])
def test_console_examples_print_what_they_show(where: str, session: str) -> None:
    command, *expected = session.strip().splitlines()
    assert command.startswith("$ specvit ")
    argv = shlex.split(command[2:])
    if any("*" in a for a in argv):
        argv = argv[:-1] + sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(argv[-1]))
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", *argv[1:]], capture_output=True, text=True, cwd=ROOT
    )
    assert (run.stdout + run.stderr).splitlines() == expected
