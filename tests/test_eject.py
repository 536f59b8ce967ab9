"""``specvit eject``: every preset as one standalone PyTorch file a person would keep. It computes exactly what
the compiled model computes, with the compiled model's reference kernels (its oneDNN linears agree with
``F.linear`` to float32 rounding: :data:`REFERENCE` turns them off); it imports only torch, uses no private
torch API, is ruff-clean as written (no ruff in the loop), defines each class once with a docstring naming the
spec lines it came from, and carries no branch for a feature its spec does not use."""

from __future__ import annotations

import ast
import contextlib
import functools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from presets import PRESETS, ROOT, small_graph

import specvit
from specvit.codegen.eject import eject_source
from specvit.compile import build_model
from specvit.export import example_inputs
from specvit.graph import build_graph

STDLIB = set(sys.stdlib_module_names)
PRIVATE = re.compile(r"torch\.ops\.|torch\._|torch\.utils\._|_python_dispatch")


@contextlib.contextmanager
def reference() -> Iterator[None]:
    """The compiled model's reference kernels: its linears are ``F.linear`` (no oneDNN fast path)."""
    saved = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = saved


@functools.cache
def small_file(preset: Path) -> str:
    """The small preset's ejected text, as specvit writes it (ruff not run on it)."""
    return eject_source(small_graph(preset), str(preset.relative_to(ROOT)), use_ruff=False)


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


def undocumented(text: str) -> list[str]:
    """Classes whose docstring names no spec line (``line 16``, ``lines 9-20``)."""
    classes = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)]
    spec = re.compile(r"\bspec\b.*\blines? \d+", re.S | re.I)
    return [c.name for c in classes if not spec.search(ast.get_docstring(c) or "")]


def ruff(path: Path) -> list[str]:
    """What ``ruff check`` and ``ruff format --check`` (the project's settings) find in ``path``."""
    config = ["--config", str(ROOT / "pyproject.toml")]
    runs = [
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", *config, str(path)],
        [sys.executable, "-m", "ruff", "format", "--check", "--diff", *config, str(path)],
    ]
    found = []
    for cmd in runs:
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=path.parent)
        if run.returncode != 0:
            found.append(run.stdout + run.stderr)
    return found


def _flat(out: Any) -> torch.Tensor:
    return torch.cat([v.flatten() for v in out.values()]) if isinstance(out, dict) else out


def _outputs(graph: Any, text: str, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled and the ejected model's outputs for ``inputs``, the ejected one holding the compiled
    weights; each under one seed (MAE's masking draws its noise in eval mode too)."""
    torch.manual_seed(0)
    compiled = build_model(graph).eval()
    ejected = _load(text)["Model"]().eval()
    assert list(ejected.state_dict()) == list(compiled.state_dict())
    ejected.load_state_dict(compiled.state_dict())
    with torch.no_grad(), reference():
        torch.manual_seed(1)
        got = _flat(ejected(*inputs))
        torch.manual_seed(1)
        want = _flat(compiled(*inputs))
    return got, want


HEAVY = {"mistral_7b", "vit_huge_patch14_224", "croco_vit_base", "pvt_v2_b0"}
"""Presets whose small model still takes over 20 s to build twice and run (a 4096-wide LM, ViT-H, ...)."""


def _marked(preset: Path) -> Any:
    slow = preset.stem in HEAVY or preset.stem.startswith("swin")
    return (
        pytest.param(preset, marks=pytest.mark.slow, id=preset.stem)
        if slow
        else pytest.param(preset, id=preset.stem)
    )


@pytest.mark.parametrize("preset", [_marked(p) for p in PRESETS])
def test_ejected_model_equals_compiled_model(preset: Path) -> None:
    graph = small_graph(preset)
    got, want = _outputs(graph, small_file(preset), example_inputs(graph, 2))
    assert (got - want).abs().max().item() == 0.0


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_ejected_file_is_plain_clean_python(preset: Path, tmp_path: Path) -> None:
    text = small_file(preset)
    assert _imports(text) <= STDLIB | {"torch"}
    assert PRIVATE.findall(text) == []
    assert defined_twice(text) == []
    assert undocumented(text) == []
    (tmp_path / "model.py").write_text(text)
    assert ruff(tmp_path / "model.py") == []


def _guide_specs() -> list[Any]:
    """The whole specs of the guide and docs/examples: features no preset has (mixture of experts, global
    tokens, soft-capping, unit-offset norms, hand-written block graphs, shared blocks)."""
    found = [p for p in sorted((ROOT / "docs" / "examples").glob("*.yaml")) if p.stem != "bad"]
    guide = (ROOT / "docs" / "guide.md").read_text()
    texts = [t for t in re.findall(r"```yaml\n(.*?)```", guide, flags=re.S) if "model:" in t and "name:" in t]
    return [pytest.param(p, id=p.stem) for p in found] + [
        pytest.param(t, id=re.search(r"name: (\S+)", t).group(1))
        for t in texts  # type: ignore[union-attr]
    ]


@pytest.mark.parametrize("spec", _guide_specs())
def test_guide_specs_eject_clean_and_equal(spec: Path | str, tmp_path: Path) -> None:
    path = spec if isinstance(spec, Path) else tmp_path / "spec.yaml"
    if isinstance(spec, str):
        path.write_text(spec)
    graph = build_graph(specvit.load_spec(path), batch=2, seq_len=12, src_len=12, tgt_len=9)
    text = eject_source(graph, use_ruff=False)
    assert PRIVATE.findall(text) == [] and defined_twice(text) == [] and undocumented(text) == []
    (tmp_path / "model.py").write_text(text)
    assert ruff(tmp_path / "model.py") == []
    got, want = _outputs(graph, text, example_inputs(graph, 2))
    assert (got - want).abs().max().item() == 0.0


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    """Broken controls: each check above finds its fault in a file that has it."""
    text = small_file(ROOT / "specs" / "mnist_vit.yaml")
    bad = text.replace(
        "import torch\n",
        "import torch\nfrom torch.utils._python_dispatch import _get_current_dispatch_mode\n",
    )
    assert PRIVATE.findall(bad) and not PRIVATE.findall(text)
    mlp = text[text.index("class Mlp") : text.index("\n\n\nclass ", text.index("class Mlp"))]
    assert defined_twice(text + "\n\n" + mlp) == ["Mlp"]
    assert undocumented(re.sub(r"spec: encoder\.block\.mlp, line \d+", "the MLP", text)) == ["Mlp"]
    (tmp_path / "model.py").write_text(text.replace("    def forward", "    def  forward", 1))
    assert len(ruff(tmp_path / "model.py")) == 1  # the format check


def _pair(name: str) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    """A small preset's graph, its compiled model and the ejected model holding the compiled weights."""
    graph = small_graph(ROOT / "specs" / f"{name}.yaml")
    torch.manual_seed(0)
    compiled = build_model(graph).eval()
    ejected = _load(small_file(ROOT / "specs" / f"{name}.yaml"))["Model"]().eval()
    ejected.load_state_dict(compiled.state_dict())
    return graph, compiled, ejected


def _padding(batch: int, length: int) -> torch.Tensor:
    """(B, S) True = padding: row 0 none, row 1 its first three tokens (left padding), row 2 all of them."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[1, :3] = True
    mask[2, :] = True
    return mask


@pytest.mark.parametrize("name", ["bert_base", "gpt2_small", "tiny_seq2seq"])
def test_ejected_model_equals_compiled_model_with_padding(name: str) -> None:
    """Padding masks, including a sample that is all padding (its queries see no key: zeros, not NaN)."""
    graph, compiled, ejected = _pair(name)
    inputs = example_inputs(graph, 3)
    masks = tuple(_padding(3, x.shape[1]) for x in inputs)
    with torch.no_grad(), reference():
        got, want = ejected(*inputs, *masks), compiled(*inputs, *masks)
        assert not torch.equal(compiled(*inputs), want)  # the masks change the outputs
    assert not want.isnan().any()
    assert (got - want).abs().max().item() == 0.0


GENERATE = ["gpt2_small", "llama_smollm_135m", "tiny_seq2seq", "t5_small"]


@pytest.mark.parametrize("name", GENERATE)
def test_ejected_generate_gives_the_compiled_models_tokens(name: str) -> None:
    """Greedy decoding, and sampling from one seed, give the compiled model's tokens; another seed, others."""
    graph, compiled, ejected = _pair(name)
    prompt = example_inputs(graph, 2)[0][:, :5]
    start = {"bos_id": 1} if graph.kind == "encoder_decoder" else {}

    def sampled(model: torch.nn.Module, seed: int, **kwargs: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 8, **start, temperature=0.7, top_k=5, generator=generator, **kwargs)  # type: ignore[operator]

    with reference():
        greedy = compiled.generate(prompt, 8, **start)  # type: ignore[operator]
        assert torch.equal(ejected.generate(prompt, 8, **start), greedy)  # type: ignore[operator]
        want = sampled(compiled, 3)
        assert torch.equal(sampled(ejected, 3, do_sample=True), want)
        assert not torch.equal(sampled(ejected, 4, do_sample=True), want)
    assert want.shape[1] == (1 if start else 5) + 8


def test_vit_b_file_is_short_and_keeps_only_the_branches_it_uses() -> None:
    vit = eject_source(
        build_graph(specvit.load_spec(ROOT / "specs" / "vit_base_patch16_224.yaml")), use_ruff=False
    )
    assert len(vit.splitlines()) <= 250
    start = vit.index("\nclass Attention")
    attention = vit[start : vit.index("\nclass ", start + 1)]
    assert "def forward(self, x: Tensor) -> Tensor:" in attention
    assert "F.scaled_dot_product_attention(q, k, v)" in attention and "nn.Linear(dim, 3 * inner)" in attention
    for gone in ("rope", "cache", "causal", "tril(", "pos is", "+ pos", "bias", "mask", "window", "Dropout"):
        assert gone not in attention, gone
    assert "# (B, H, N, hd)" in attention  # the shape comments at reshapes survive
    assert "nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch)" in vit and "linear" not in vit
    gpt2 = small_file(ROOT / "specs" / "gpt2_small.yaml")
    assert "if cache is not None:" in gpt2 and "class KVCache" in gpt2 and "class KVCache" not in vit
    assert "nn.Dropout(0.1)" in gpt2 and "def generate(" in gpt2 and "def generate(" not in vit


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
    assert ruff(out) == []


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


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_full_size_ejected_file_is_plain_clean_python(preset: Path, tmp_path: Path) -> None:
    """The checks on each preset's file at its own size (the small ones above share its classes)."""
    text = eject_source(build_graph(specvit.load_spec(preset)), use_ruff=False)
    assert PRIVATE.findall(text) == [] and defined_twice(text) == [] and undocumented(text) == []
    (tmp_path / "model.py").write_text(text)
    assert ruff(tmp_path / "model.py") == []
