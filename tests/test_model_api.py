"""The Python API from a user's side: dict specs, from_pretrained, and inputs checked against the spec."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from presets import ROOT

import specvit
from specvit.inputs import InputError
from specvit.model import DecoderModel, EncoderModel, SpecModel

TINY_GPT = {"decoder.depth": 1, "decoder.width": 32, "decoder.block.heads": 2}


def _dict(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "specs" / f"{name}.yaml").read_text())


def test_load_build_and_graph_accept_a_dict_and_a_spec() -> None:
    data = _dict("mnist_vit")
    spec = specvit.load_spec(ROOT / "specs" / "mnist_vit.yaml")
    assert specvit.load_spec(data) == spec and specvit.load_spec(spec) is spec
    assert specvit.load_spec(data, {"encoder.depth": 2}).encoder.depth == 2  # type: ignore[union-attr]
    assert specvit.load_spec(spec, {"encoder.depth": 2}).encoder.depth == 2  # type: ignore[union-attr]
    graph = specvit.build_graph(data, {"encoder.depth": 2}, batch=3)
    assert graph.total_params == specvit.build_graph(spec, {"encoder.depth": 2}).total_params
    assert graph.dims["B"] == 3
    assert specvit.build_graph("mnist_vit").total_params == specvit.build_graph(spec).total_params
    model = specvit.build_model(data, overrides={"encoder.depth": 2})
    assert len(model.blocks()) == 2
    assert "class Model(nn.Module)" in specvit.eject(data)


def test_a_dict_gets_the_same_errors_at_its_key_paths() -> None:
    data = _dict("mnist_vit")
    data["encoder"]["width"] = "512"
    data["encoder"]["block"]["hedas"] = 2
    for call in (specvit.load_spec, specvit.build_graph, specvit.build_model):
        with pytest.raises(specvit.SpecError) as info:
            call(data)
        assert sorted(str(info.value).splitlines()) == [
            "<dict>: encoder.block.hedas: unknown key 'hedas' (did you mean 'heads'?)",
            "<dict>: encoder.width: expected an integer, got '512' (write the number without quotes: 512)",
        ]


def test_from_pretrained(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = specvit.build_model("mnist_vit").eval()
    model.save_pretrained(tmp_path / "ckpt")
    for cls in (SpecModel, EncoderModel):
        again = cls.from_pretrained(tmp_path / "ckpt")
        assert isinstance(again, EncoderModel) and not again.training
        (x,) = specvit.example_inputs(model, 2)
        with torch.no_grad():
            torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)
    with pytest.raises(
        specvit.CheckpointError,
        match=r"model: encoder \(EncoderModel\); DecoderModel.from_pretrained cannot load it",
    ):
        DecoderModel.from_pretrained(tmp_path / "ckpt")


def _raises(message: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    with pytest.raises(InputError, match=re.escape(message)):
        fn(*args, **kwargs)


def test_image_inputs_are_checked_against_the_spec() -> None:
    model = specvit.build_model("mnist_vit").eval()
    _raises(
        "x: expected (batch, 1, 28, 28) (image 28x28), got (1, 28, 28): the batch dimension is missing; "
        "pass x.unsqueeze(0) for a single example",
        model,
        torch.randn(1, 28, 28),
    )
    _raises(
        "got (2, 3, 28, 28): the spec's images have 1 channel, not 3 (input.channels)",
        model,
        torch.randn(2, 3, 28, 28),
    )
    _raises(
        "got (2, 1, 32, 32): the spec's images are 28x28 pixels, not 32x32 (input.size)",
        model,
        torch.randn(2, 1, 32, 32),
    )
    _raises(
        "x: expected floating-point values, got torch.int64; pass x.float()",
        model,
        torch.zeros(2, 1, 28, 28, dtype=torch.long),
    )
    _raises("x: expected a tensor of image 28x28, got list", model, [[0.0]])
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_token_inputs_are_checked_against_the_spec() -> None:
    gpt = specvit.build_model("gpt2_small", overrides=TINY_GPT).eval()
    ids = torch.randint(0, 50257, (2, 8))
    _raises(
        "tokens: token id 50257 is outside the vocabulary of 50257 (ids 0..50256)",
        gpt,
        torch.cat([ids, torch.full((2, 1), 50257)], 1),
    )
    _raises("tokens: token id -1 is outside the vocabulary", gpt, torch.full((2, 3), -1))
    _raises("tokens: expected integer token ids, got torch.float32; pass tokens.long()", gpt, ids.float())
    _raises(
        "tokens: 1025 positions are more than gpt2_small takes (S <= 1024, the learned position "
        "table's length)",
        gpt,
        torch.zeros(1, 1025, dtype=torch.long),
    )
    _raises(
        "key_padding_mask: seq_len is 9 but tokens has 8; they must agree",
        gpt,
        ids,
        torch.zeros(2, 9, dtype=torch.bool),
    )
    with torch.no_grad():
        assert gpt(ids).shape == (2, 8, 50257)
        _raises(
            "generate: 1000 + max_new_tokens 100 = 1100 positions, more than gpt2_small takes (S <= 1024); "
            "ask for at most 24 new tokens",
            gpt.generate,
            torch.zeros(1, 1000, dtype=torch.long),
            100,
        )
        assert gpt.generate(torch.zeros(1, 1000, dtype=torch.long), 24).shape == (1, 1024)


def test_checks_can_be_turned_off_and_stay_out_of_tracing() -> None:
    model = specvit.build_model("mnist_vit").eval()
    model.checks_inputs = False
    with pytest.raises(RuntimeError):  # torch's own error, as before the checks
        model(torch.randn(2, 3, 28, 28))
    model.checks_inputs = True
    program = specvit.export_program(model)  # traced with symbolic sizes: no checks, no guards from them
    assert program.module()(torch.randn(3, 1, 28, 28)).shape == (3, 10)
