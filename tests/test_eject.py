"""``specvit eject``: every preset as one standalone PyTorch file that computes exactly what the
compiled model computes, imports only torch, and carries no branch for a feature its spec does not use."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from presets import PRESETS, ROOT, small_graph

import specvit
from specvit.compile import build_model, eject
from specvit.export import example_inputs

STDLIB = set(sys.stdlib_module_names)


def _load(text: str) -> dict[str, Any]:
    """Execute an ejected file as its own module."""
    namespace: dict[str, Any] = {"__name__": "ejected"}
    exec(compile(text, "<ejected>", "exec"), namespace)
    return namespace


def _imports(text: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found


def defined_twice(text: str) -> list[str]:
    """Top-level classes and functions an ejected file defines more than once (the later would win)."""
    names = [n.name for n in ast.parse(text).body if isinstance(n, ast.ClassDef | ast.FunctionDef)]
    return sorted({n for n in names if names.count(n) > 1})


def _flat(out: Any) -> torch.Tensor:
    return torch.cat([v.flatten() for v in out.values()]) if isinstance(out, dict) else out


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_ejected_model_equals_compiled_model(preset: Path) -> None:
    graph = small_graph(preset)
    text = eject(graph)
    assert _imports(text) <= STDLIB | {"torch"}
    assert defined_twice(text) == []
    torch.manual_seed(0)
    compiled = build_model(graph).eval()
    ejected = _load(text)["Model"]().eval()
    assert list(ejected.state_dict()) == list(compiled.state_dict())
    ejected.load_state_dict(compiled.state_dict())
    x = example_inputs(graph, 2)
    with torch.no_grad():  # each call under one seed: MAE's masking draws its noise in eval mode too
        torch.manual_seed(1)
        got = _flat(ejected(*x))
        torch.manual_seed(1)
        assert (got - _flat(compiled(*x))).abs().max().item() == 0.0


def test_ejected_decoder_decodes_with_its_own_cache() -> None:
    text = eject(ROOT / "specs" / "gpt2_small.yaml", overrides={"decoder.depth": 2})
    torch.manual_seed(0)
    compiled = build_model(ROOT / "specs" / "gpt2_small.yaml", overrides={"decoder.depth": 2}).eval()
    module = _load(text)
    ejected = module["Model"]().eval()
    ejected.load_state_dict(compiled.state_dict())
    tokens = torch.randint(0, 50257, (2, 6))

    def decode(model: torch.nn.Module, cache: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(tokens[:, :4], cache=cache), model(tokens[:, 4:5], cache=cache, offset=4)]

    ours, theirs = decode(ejected, module["KVCache"]()), decode(compiled, specvit.nn.KVCache())
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_ejected_layers_keep_only_the_branches_the_spec_uses() -> None:
    vit = eject(ROOT / "specs" / "vit_tiny_patch16_224.yaml")
    start = vit.index("\nclass Attention")
    attention = vit[start : vit.index("\nclass ", start + 1)]
    forward = attention[attention.index("def forward") : attention.index("def extra_repr")]
    assert forward.startswith("def forward(self, x: Tensor) -> Tensor:")
    for gone in (
        "rope",
        "cache",
        "self.causal",
        "tril(",
        "pos is",
        "x + pos",
        "bias",
        "mask",
    ):  # code, not docstring
        assert gone not in forward[forward.index('"""', forward.index('"""') + 3) :], gone
    assert "# (B, N, (H + 2Hkv) * hd)" in attention  # the shape comments at reshapes survive
    assert "projection == " not in vit and "nn.Conv2d" in vit  # the conv patch projection only
    gpt2 = eject(ROOT / "specs" / "gpt2_small.yaml")
    assert "if cache is not None:" in gpt2 and "class KVCache" in gpt2 and "class KVCache" not in vit


def test_ejected_file_runs_without_specvit(tmp_path: Path) -> None:
    out = tmp_path / "model.py"
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "eject", "specs/mnist_vit.yaml", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert out.stat().st_mode & 0o777 == 0o644
    script = (
        "import sys, runpy, torch\n"
        "sys.modules['specvit'] = None  # importing specvit now fails\n"
        f"model = runpy.run_path({str(out)!r})['Model']().eval()\n"
        "print(tuple(model(torch.randn(3, 1, 28, 28)).shape))\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "(3, 10)"


def test_eject_refuses_to_overwrite_its_spec(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text((ROOT / "specs" / "mnist_vit.yaml").read_text())
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "eject", str(spec), "-o", str(spec)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and "is the spec itself" in run.stderr
    assert spec.read_text() == (ROOT / "specs" / "mnist_vit.yaml").read_text()
