"""A classifier head's ``tokens: true`` (issue #25): the model returns the final tokens beside the pooled
features, ``{"last_hidden_state", "pooler_output"}``, as a transformers base model does. Their shapes in the
graph, the summary and the ejected forward, the values against the same spec without the field, and the rule
that refuses it beside a classifier."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import specvit
from specvit.diagram.text import format_table
from specvit.errors import SpecError

SPEC = """\
specvit: 1
name: tiny_pooled
model: encoder
encoder:
  input: {kind: tokens, vocab: 100, type_vocab: 2}
  position: {kind: learned, max_len: 16}
  width: 32
  depth: 2
  block:
    heads: 2
    norm: {kind: layernorm, placement: post}
    mlp: {hidden: 48}
  embed_norm: true
  final_norm: false
head: {kind: classifier, pool: first, classes: null, tokens: true, ops: [{kind: linear, width: 24}, {kind: act, fn: tanh}]}
"""


def _spec(tmp_path: Path, text: str = SPEC) -> specvit.Spec:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return specvit.load_spec(path)


def test_the_model_returns_the_tokens_beside_the_pooled_features(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    torch.manual_seed(0)
    model = specvit.build_model(spec).eval()
    x = torch.randint(0, 100, (3, 9))
    with torch.no_grad():
        out = model(x)
    assert list(out) == ["last_hidden_state", "pooler_output"]
    assert tuple(out["last_hidden_state"].shape) == (3, 9, 32) and tuple(out["pooler_output"].shape) == (
        3,
        24,
    )
    pooled = specvit.build_model(_spec(tmp_path, SPEC.replace(", tokens: true", ""))).eval()
    pooled.load_state_dict(model.state_dict())
    bare = specvit.build_model(_spec(tmp_path, SPEC.split("head:")[0] + "head: none\n")).eval()
    bare.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("head.")})
    with torch.no_grad():
        assert torch.equal(pooled(x), out["pooler_output"])  # the pooled features are the head's as before
        assert torch.equal(bare(x), out["last_hidden_state"])  # the tokens the headless model returns
    # the control: the tokens are the encoder's, not the pooled features broadcast
    assert not torch.equal(out["last_hidden_state"][:, 0, :24], out["pooler_output"])


def test_summary_and_graph_show_both_outputs(tmp_path: Path) -> None:
    graph = specvit.build_graph(_spec(tmp_path))
    node = graph[graph.output]
    assert node["p"].keys == ("last_hidden_state", "pooler_output")
    assert node["inputs"]["last_hidden_state"] == ("B", "S", 32) and node["inputs"]["pooler_output"] == (
        "B",
        24,
    )
    table = format_table(graph)
    assert "outputs: last_hidden_state (B, S, 32), pooler_output (B, 24)" in table.splitlines()
    plain = format_table(specvit.build_graph(_spec(tmp_path, SPEC.replace(", tokens: true", ""))))
    assert "outputs:" not in plain  # the control: one output, named in its row


def test_the_ejected_forward_returns_both(tmp_path: Path) -> None:
    from specvit.codegen.eject import eject_source

    spec = _spec(tmp_path)
    source = eject_source(specvit.build_graph(spec))
    assert 'return {"last_hidden_state": encoder, "pooler_output": head}' in source
    path = tmp_path / "ejected.py"
    path.write_text(source)
    loaded = importlib.util.spec_from_file_location("ejected", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    ours = specvit.build_model(spec).eval()
    standalone = module.Model().eval()
    standalone.load_state_dict(ours.state_dict())
    x = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        a, b = ours(x), standalone(x)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tokens_beside_a_classifier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        _spec(tmp_path, SPEC.replace("classes: null", "classes: 5"))
    assert (
        "head.tokens: tokens returns the token features beside the pooled ones, and classes: 5 adds logits "
        "(set classes: null, or remove tokens)"
    ) in str(info.value)
    assert "spec.yaml:15" in str(info.value)  # the file and line


def test_onnx_export_names_both_outputs(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    from specvit.export import export_onnx

    model = specvit.build_model(_spec(tmp_path)).eval()
    path = export_onnx(model, tmp_path / "pooled.onnx", progress=False)
    names = [o.name for o in onnx.load(str(path)).graph.output]
    assert names == ["last_hidden_state", "pooler_output"]  # before: only the first named ("output")
