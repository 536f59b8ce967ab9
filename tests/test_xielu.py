"""``mlp.activation: xielu`` (Apertus): transformers' XIELUActivation to the bit, its two learned scalars and
two buffers in the state dict and the parameter count, refused in a mixture of experts, and ejected as the
compiled model computes it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_eject import _outputs

import specvit
from specvit.codegen.eject import eject_source
from specvit.export import example_inputs
from specvit.graph import build_graph
from specvit.nn.mlp import XIELU


def test_xielu_is_transformers_xielu() -> None:
    from transformers.activations import XIELUActivation

    theirs = XIELUActivation(dtype=torch.float32)
    ours = XIELU()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in (*theirs.parameters(), *theirs.buffers()):
            t.add_(torch.randn(t.shape, generator=gen) * 0.1)
        ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 64, generator=gen) * 3
    x[0, :3] = torch.tensor([0.0, -1e-7, 1e-7])  # at the branches' seam
    assert torch.equal(ours(x), theirs._xielu_python(x))
    with torch.no_grad():
        ours.alpha_n.add_(0.2)  # the control: the negative branch reads alpha_n
    assert not torch.equal(ours(x), theirs._xielu_python(x))


def _spec(moe: bool = False) -> dict[str, Any]:
    mlp: dict[str, Any] = {"hidden": 40, "activation": "xielu", "bias": False}
    if moe:
        mlp["moe"] = {"experts": 4}
    block = {"heads": 4, "layers": ["masked_self_attention", "mlp"], "norm": {"kind": "rmsnorm"}, "mlp": mlp}
    return {"specvit": 1, "name": "xielu_lm", "model": "decoder",
            "decoder": {"input": {"kind": "tokens", "vocab": 50}, "position": {"kind": "rope"}, "width": 32,
                        "depth": 2, "block": block},
            "head": {"kind": "lm"}}  # fmt: skip


def test_a_spec_s_xielu_holds_its_parameters_and_buffers() -> None:
    spec = specvit.parse_spec(_spec())
    model = specvit.build_model(spec)
    keys = set(model.state_dict())
    assert {f"decoder.blocks.1.mlp.act.{n}" for n in ("alpha_p", "alpha_n", "beta", "eps")} <= keys
    act = model.decoder.blocks[0].mlp.act
    assert torch.allclose(torch.nn.functional.softplus(act.alpha_p), torch.tensor(0.8))
    assert (act.beta.item(), act.eps.item()) == (0.5, pytest.approx(-1e-6))
    assert build_graph(spec).total_params == sum(p.numel() for p in model.parameters())


def test_xielu_experts_are_refused() -> None:
    with pytest.raises(specvit.SpecError, match=r"decoder\.block\.mlp\.activation: xielu is learned per MLP"):
        specvit.parse_spec(_spec(moe=True))


def test_the_ejected_file_computes_xielu() -> None:
    graph = build_graph(specvit.parse_spec(_spec()), batch=2, seq_len=12)
    text = eject_source(graph, use_ruff=False)
    assert "alpha_p" in text
    got, want = _outputs(graph, text, example_inputs(graph, 2))
    assert (got - want).abs().max().item() == 0.0
