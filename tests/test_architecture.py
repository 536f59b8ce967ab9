"""The shape of the code, kept by tests: small files and functions, no import cycle (imports inside
functions counted), a compiler that never reads the spec language, one call convention for layers, and
stages that keep no list of op kinds of their own."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from torch import nn

import specvit.nn
from specvit.ops import OPS, fragments

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specvit"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> nx.DiGraph:
    """Module -> the specvit modules it imports anywhere in its text, functions included."""
    modules = {_module(p): p for p in SOURCES}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            for target in targets:
                parts = target.split(".")
                for k in range(2, len(parts) + 1):  # importing a.b.c imports a.b too
                    t = ".".join(parts[:k])
                    if t in modules and t != name and not name.startswith(t + "."):
                        graph.add_edge(name, t)
    return graph


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_files_and_functions_are_small(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 500
    long = [
        (n.name, n.end_lineno - n.lineno + 1)  # type: ignore[operator]
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > 80  # type: ignore[operator]
    ]
    assert long == []


def test_no_import_cycles() -> None:
    cycles = list(nx.simple_cycles(_imports()))
    assert cycles == []


def test_the_compiler_never_imports_the_spec_language() -> None:
    """Importing every compiler module (and running nothing else) loads no module of specvit.spec."""
    modules = [_module(p) for p in sorted((PACKAGE / "codegen").glob("*.py"))]
    script = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nprint(sorted(m for m in sys.modules if m.startswith('specvit.spec')))"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_layers_share_one_call_convention() -> None:
    """Every layer's forward takes its main input positionally and everything else by keyword."""
    for name in specvit.nn.__all__:
        obj = getattr(specvit.nn, name)
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            params = list(inspect.signature(obj.forward).parameters.values())[1:]
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            assert len(positional) <= 1, f"{name}.forward takes {[p.name for p in positional]} positionally"


@pytest.mark.parametrize(
    "path",
    [
        *sorted((PACKAGE / "codegen").glob("*.py")),
        PACKAGE / "model.py",
        *sorted((PACKAGE / "diagram").glob("*.py")),
    ],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_stage_keeps_its_own_list_of_kinds(path: Path) -> None:
    """The compiler, the model classes and the diagrams name no op or fragment kind: they read the registries."""
    kinds = {k for k in OPS if len(k) > 4} | {
        c.model_fields["kind"].annotation.__args__[0]  # type: ignore[union-attr]
        for slot in ("input", "position", "head")
        for c in fragments(slot)
    }
    kinds -= {"input", "output", "linear", "tokens", "image", "none", "call"}  # words the code uses plainly
    strings = {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    assert strings & kinds == set()


GENERIC_OPS = {f"specvit.ops.{m}" for m in ("base", "block", "norm", "structure", "grid", "embed")} | {
    "specvit.ops"
}
"""The op modules every stack uses: tokens, blocks, norms, residual plumbing, the grid, embeddings."""


@pytest.mark.parametrize(
    "path",
    [PACKAGE / "graph" / "lower.py", *sorted((PACKAGE / "patterns").glob("*.py"))],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_the_driver_and_patterns_name_no_family(path: Path) -> None:
    """The lowering driver and the block patterns import only the generic op modules and name no op kind
    defined elsewhere (an attention's configuration, a family's op): a family is data to them."""
    imported = {t for t in _imports().successors(_module(path)) if t.startswith("specvit.ops")}
    assert imported <= GENERIC_OPS
    elsewhere = {k for k, o in OPS.items() if type(o).__module__ not in GENERIC_OPS}
    strings = {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    assert strings & elsewhere == set()


def test_core_args_state_the_attention_cores_defaults() -> None:
    """specvit.ops.core lists the core's parts without importing torch; the list must be the module's own
    defaults, so a part an op leaves unsaid is off in the built layer as in the ejected one."""
    from specvit.nn.attention import Attention
    from specvit.ops.core import core_args

    defaults = inspect.signature(Attention.__init__).parameters
    stated = core_args()
    assert stated and {k: defaults[k].default for k in stated} == stated


def test_every_attention_is_one_op() -> None:
    """Self, cross, class, talking-heads, window, grid and SAGAN's feature-map attention are names of one
    op's configurations, all built by one module."""
    attention = {type(o).__qualname__ for o in OPS.values() if o.category == "attention"}
    assert attention == {"Attention"}
    names = [k for k, o in OPS.items() if type(o).__qualname__ == "Attention"]
    assert len(names) == 7 and len({id(OPS[k]) for k in names}) == 1
    assert "sagan_attention" in names
    assert {o.module for o in OPS.values() if o.category == "attention"} == {"specvit.nn.attention:Attention"}
