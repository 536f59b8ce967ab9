"""oneDNN pre-packed linears: equal outputs, swapped in and out whole, and what generation packs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import specvit
from specvit.generate import PACK_FROM
from specvit.nn import gemv, packed
from specvit.nn import program as lowering
from specvit.nn.layers import TiedLinear
from specvit.nn.linear import Linear
from specvit.nn.packed import SPLIT_ROWS, PackedLinear, can_pack, packed_linears, split_linear

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


def test_only_float32_and_native_bfloat16_cpu_linears_are_packed() -> None:
    assert can_pack(nn.Linear(4, 3))
    assert not can_pack(nn.Linear(4, 3, dtype=torch.float64))
    assert can_pack(nn.Linear(4, 3, dtype=torch.bfloat16)) == gemv.available()
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


@pytest.fixture
def torch_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate``'s steps run the model's modules, as for a model the step program does not lower."""
    monkeypatch.setattr(lowering, "compile_step", lambda *_, **__: None)


@pytest.mark.usefixtures("torch_steps")
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


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("blocks", [2, 4])
def test_split_linear_equals_f_linear(rows: int, bias: bool, blocks: int) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(rows, 1, 24)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        got = split_linear(x, layer.weight, layer.bias, blocks)
        parts = layer.weight.view(blocks, -1, 24).transpose(
            1, 2
        )  # control: blocks merged without the transpose
        wrong = torch.bmm(x.reshape(1, rows, 24).expand(blocks, rows, 24), parts).reshape(rows, 1, 40)
    assert got.shape == want.shape == (rows, 1, 40)
    assert (got - want).abs().max().item() <= 1e-5
    if rows > 1:
        assert (wrong - want).abs().max().item() > 1e-5


def test_one_row_calls_take_the_split_product_where_it_was_measured_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # two threads: blocks of the rows to spread
    model = _gpt(**{"decoder.input.vocab": 96})
    tied = next(m for m in model.modules() if isinstance(m, TiedLinear))
    head = PackedLinear(tied)
    assert head.blocks == 4
    assert head._plain[0].data_ptr() == tied.weight.data_ptr()  # the embedding's table, not a copy
    assert PackedLinear(nn.Linear(8, 7)).blocks == 1  # 7 rows do not split into blocks
    calls = [0]

    def counted(*args: object) -> torch.Tensor:
        calls[0] += 1
        return split_linear(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(packed, "split_linear", counted)
    x = torch.randn(SPLIT_ROWS + 1, 1, 64)
    want = torch.nn.functional.linear(x, tied.weight).detach()
    for faster, used in ((True, [1, 1, 0]), (False, [0, 0, 0])):
        path = "split" if faster else "packed"
        monkeypatch.setattr(packed, "few_rows_path", lambda rows, dtype, threads, p=path: p)
        got = []
        for rows in (1, SPLIT_ROWS, SPLIT_ROWS + 1):
            before = calls[0]
            with torch.no_grad():
                out = head(x[:rows])
            got.append(calls[0] - before)
            assert (out - want[:rows]).abs().max().item() <= 1e-5
        assert got == used


@pytest.mark.usefixtures("torch_steps")
@pytest.mark.parametrize("split", [True, False])
def test_generation_packs_only_where_the_steps_do_not_split(
    monkeypatch: pytest.MonkeyPatch, split: bool
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(packed, "few_rows_path", lambda rows, dtype, threads: "split" if split else "packed")
    model = _gpt()
    prompt = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        want = model.generate(prompt, PACK_FROM - 1)  # not swapped
    held: list[object] = []
    first = next(name for name, m in model.named_modules() if isinstance(m, nn.Linear))
    swapped = [0]

    def record(module: nn.Module, args: object, out: object) -> None:
        layer = model.get_submodule(first)
        if isinstance(layer, PackedLinear):
            held.append(layer.packed)
            swapped[0] += 1

    model.register_forward_hook(record)
    got = model.generate(prompt, PACK_FROM)
    assert swapped[0] == PACK_FROM  # every step ran the swapped layers
    assert all((t is None) == split for t in held)  # batch 1 splits: no packed copies; else packed
    assert torch.equal(got[:, : want.shape[1]], want)


def test_an_unpacked_layer_runs_more_rows_as_linear_does() -> None:
    torch.manual_seed(0)
    layer = Linear(24, 40)
    x = torch.randn(300, 24)
    with torch.no_grad():
        got, want = PackedLinear(layer, pack=False)(x), layer(x)
    assert PackedLinear(layer, pack=False).packed is None
    assert (got - want).abs().max().item() <= 1e-5
    assert (got - want[:, torch.randperm(40)]).abs().max().item() > 1e-3  # control: columns shuffled


@pytest.mark.skipif(not gemv.available(), reason="specvit's native kernel does not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_row_calls_take_the_native_kernel_where_it_was_measured_fastest(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(37, 24).to(dtype)  # 37 inputs: the kernel's 8-wide loop and its scalar tail
    swapped = PackedLinear(layer, pack=False)
    calls = [0]
    native = swapped._native
    assert native is not None

    def counted(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        calls[0] += 1
        return native(x, dtype)

    monkeypatch.setattr(swapped, "_native", counted)
    for path, used in (("native", 1), ("linear" if dtype == torch.bfloat16 else "packed", 0)):
        monkeypatch.setattr(packed, "few_rows_path", lambda rows, dtype, threads, p=path: p)
        for rows in (1, 8, 9):
            x = torch.randn(rows, 1, 37, dtype=dtype)
            before = calls[0]
            with torch.no_grad():
                got, want = swapped(x), layer(x)
            assert got.dtype == dtype and got.shape == want.shape
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert (got.float() - want.float()).abs().max().item() <= tol
            assert calls[0] - before == (used if rows <= 8 else 0)  # 9 rows: never the few-row kernel
