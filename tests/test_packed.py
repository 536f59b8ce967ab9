"""oneDNN pre-packed linears: equal outputs, swapped in and out whole, and what generation packs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import specvit
from specvit.generate import PACK_FROM
from specvit.nn.layers import TiedLinear
from specvit.nn.linear import Linear
from specvit.nn.packed import PackedLinear, can_pack, packed_linears

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def _gpt(**over: object) -> specvit.SpecModel:
    torch.manual_seed(0)
    overrides = {"decoder.depth": 2, "decoder.width": 64, "decoder.block.heads": 4, "decoder.input.vocab": 97}
    return specvit.build_model(ROOT / "specs" / "gpt2_small.yaml", overrides={**overrides, **over}).eval()


def _layers(model: nn.Module) -> dict[str, type]:
    return {
        name: type(m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear | TiedLinear | PackedLinear)
    }


def test_packed_linears_equal_eager_and_are_put_back() -> None:
    model = _gpt()
    tokens = torch.randint(0, 97, (2, 11))
    before, keys = _layers(model), list(model.state_dict())
    assert TiedLinear in before.values() and Linear in before.values()  # GPT-2's head is tied
    with torch.no_grad():
        want = model(tokens)
        with packed_linears(model):
            assert set(_layers(model).values()) == {PackedLinear}  # every linear, the tied head too
            assert list(model.state_dict()) == keys  # same keys: the packed copies are not saved
            got = model(tokens)
    assert _layers(model) == before
    assert (got - want).abs().max().item() < 1e-5


def test_packed_linears_put_back_on_error_and_respect_the_budget() -> None:
    model = _gpt()
    before = _layers(model)
    with pytest.raises(RuntimeError, match="inside"), packed_linears(model):
        raise RuntimeError("inside")
    assert _layers(model) == before
    with packed_linears(model, max_bytes=1000):  # the weights need more: nothing packed
        assert _layers(model) == before


def test_only_float32_cpu_linears_are_packed() -> None:
    assert can_pack(nn.Linear(4, 3))
    assert not can_pack(nn.Linear(4, 3, dtype=torch.float64))
    assert not can_pack(nn.Linear(4, 3, dtype=torch.bfloat16))
    assert not can_pack(nn.Conv1d(4, 3, 1))
    model = _gpt().double()
    with packed_linears(model):
        assert PackedLinear not in _layers(model).values()


def _linear_calls(model: nn.Module) -> list[int]:
    """Counts the calls of the model's first nn.Linear: a packed layer replaces it, so it is not called."""
    calls = [0]
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    first.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_generation_packs_from_pack_from_tokens_with_the_same_tokens() -> None:
    model = _gpt()
    prompt = torch.randint(0, 97, (2, 5))
    calls = _linear_calls(model)
    short = model.generate(prompt, PACK_FROM - 1)
    assert calls[0] == PACK_FROM - 1  # not packed: one call per step
    long = model.generate(prompt, PACK_FROM)
    assert calls[0] == PACK_FROM - 1  # packed: the original layer was not called
    assert torch.equal(long[:, : short.shape[1]], short)  # greedy tokens unchanged by packing
    assert PackedLinear not in _layers(model).values()  # put back


def test_encoder_decoder_generation_packs_the_decoder_and_head_only() -> None:
    torch.manual_seed(0)
    small = {"depth": 1, "width": 64, "block.heads": 4, "input.vocab": 53}
    over = {f"{role}.{k}": v for role in ("encoder", "decoder") for k, v in small.items()}
    model = specvit.build_model(ROOT / "specs" / "transformer_base.yaml", overrides=over).eval()
    src = torch.randint(2, 53, (2, 7))
    enc, dec = _linear_calls(model.encoder), _linear_calls(model.decoder)  # type: ignore[arg-type]
    model.generate(src, PACK_FROM, bos_id=1)
    assert enc[0] == 1 and dec[0] == 0  # the encoder runs once, unpacked; the decoder packed
