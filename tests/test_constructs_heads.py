"""Head ops (``head.ops``, specvit/ops/head_ops.py): the layers a classifier or lm head runs before its final
linear layer, checked in float64 against transformers' BERT heads (the pooler before the sequence classifier,
the prediction transform before the tied masked-LM decoder), drawn and ejected as built, and their problems.

Each parity test has a control: the same spec with one op changed (tanh for ReLU, GELU for ReLU) fails it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import converted, float64_reference, noised
from test_constructs_stems import ejects_the_same, problem

import specvit
from specvit.compile import build_graph
from specvit.interop.hf import spec_dict
from specvit.spec.loader import parse_spec

BERT = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
            max_position_embeddings=24, id2label={i: f"L{i}" for i in range(3)})  # fmt: skip


def _bert(cls: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return noised(getattr(transformers, cls)(transformers.BertConfig(**BERT)), 0).double()


def _diff(ref: torch.nn.Module, change: tuple[int, str] | None = None) -> float:
    """specvit's output against HF's in float64 on a padded batch; ``change`` sets one head op's ``fn``."""
    data = spec_dict(ref.config.to_dict() | {"architectures": [type(ref).__name__]})
    if change is not None:
        data["head"]["ops"][change[0]]["fn"] = change[1]
    model = converted(ref, parse_spec(data)).double()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (2, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad(), float64_reference():
        theirs = ref(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        ours = model(ids, key_padding_mask=mask == 0)
    keep = mask.bool() if ours.ndim == 3 else slice(None)
    return (ours[keep] - theirs[keep]).abs().max().item()


def test_a_pooler_before_the_classifier_is_berts_sequence_head() -> None:
    ref = _bert("BertForSequenceClassification")
    assert _diff(ref) <= 1e-10
    assert _diff(ref, (1, "relu")) > 1e-3  # the control: another activation in the pooler


def test_a_transform_before_the_tied_decoder_is_berts_masked_lm_head() -> None:
    ref = _bert("BertForMaskedLM")
    assert _diff(ref) <= 1e-10
    assert _diff(ref, (1, "relu")) > 1e-3


def _spec(head: dict[str, Any]) -> dict[str, Any]:
    return {
        "specvit": 1,
        "name": "heads",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "tokens", "vocab": 50},
            "position": {"kind": "learned", "max_len": 16},
            "width": 32,
            "depth": 1,
            "block": {"heads": 4},
        },
        "head": head,
    }


MLM = {"kind": "lm", "tied": True, "bias": True,
       "ops": [{"kind": "linear"}, {"kind": "act", "fn": "gelu"}, {"kind": "norm", "eps": 1e-3}]}  # fmt: skip
SEQUENCE = {"kind": "classifier", "classes": 3, "pool": "first",
            "ops": [{"kind": "linear", "width": 24}, {"kind": "act", "fn": "tanh"}]}  # fmt: skip


@pytest.mark.parametrize("head", [MLM, SEQUENCE], ids=["lm", "classifier"])
def test_head_ops_are_nodes_drawn_and_ejected_as_built(head: dict[str, Any]) -> None:
    graph = build_graph(parse_spec(_spec(head)))
    ops = [graph[f"head.ops.{i}"]["op"] for i in range(len(head["ops"]))]
    assert ops == (["linear", "act", "layernorm"] if head is MLM else ["linear", "act"])
    model = specvit.build_model(_spec(head))
    if head is MLM:  # the norm's own eps; the decoder's weight is the embedding's, its bias its own
        assert model.get_submodule("head.ops.2").eps == 1e-3
        assert [k for k in model.state_dict() if k.startswith("head.fc")] == ["head.fc.bias"]
        assert graph["head.fc"]["shape"] == ("B", "S", 50)
    else:
        assert graph["head.pool"]["shape"] == ("B", 32) and graph["head.fc"]["shape"] == ("B", 3)
        assert model.get_submodule("head.ops.0").weight.shape == (24, 32)
    ejects_the_same(_spec(head), torch.randint(0, 50, (2, 9)))


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda h: h["ops"].insert(0, {"kind": "linear", "width": 16}),
            "head.ops: a tied lm head reads features as wide as the embedding (32), and gets 16 (end head.ops "
            "with a linear layer of width 32, or set tied: false)",
        ),
        (lambda h: h["ops"].append({"kind": "linear", "width": 32}), None),  # the control: back to the width
        (
            lambda h: h["ops"][1].update(fn="mish"),
            "head.ops.1.fn: 'mish' is not one of gelu, gelu_tanh, quick_gelu, relu, relu2, silu, tanh",
        ),
    ],
    ids=["tied_width", "tied_width_restored", "unknown_act"],
)
def test_head_ops_problems(edit: Any, expected: str | None) -> None:
    head = {**MLM, "ops": [dict(op) for op in MLM["ops"]]}
    edit(head)
    if expected is None:
        build_graph(parse_spec(_spec(head)))
    else:
        assert problem(_spec(head)).startswith(expected)
