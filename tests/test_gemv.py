"""specvit's few-row product kernel (specvit/nn/gemv.c): equal to torch's products for every weight dtype,
refusing what it cannot take, built once into the cache folder, and absent (not an error) where it cannot build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specvit.nn import gemv
from specvit.nn.gemv import MAX_ROWS, Gemv
from specvit.nn.quant import quantize_rows

needs_kernel = pytest.mark.skipif(not gemv.available(), reason="specvit's native kernel does not build here")


@needs_kernel
@pytest.mark.parametrize("k", [1, 7, 8, 33, 64, 577])  # below, at and past the 8- and 32-wide loops
@pytest.mark.parametrize("rows", [1, 2, 5, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [37, 38])  # one row takes weight rows two at a time: the last alone, or not
def test_float32_and_bfloat16_weights_equal_f_linear(k: int, rows: int, bias: bool, n: int) -> None:
    torch.manual_seed(k * 10 + rows)
    weight, x = torch.randn(n, k), torch.randn(rows, 1, k)
    b = torch.randn(n) if bias else None
    got = gemv.gemv(x, weight, bias=b)
    assert got.shape == (rows, 1, n) and got.dtype == torch.float32
    assert (got - F.linear(x, weight, b)).abs().max().item() <= 1e-4
    half = weight.bfloat16()
    want = F.linear(x, half.float(), b)  # the bfloat16 weights' exact values, summed in float32
    assert (gemv.gemv(x, half, bias=b) - want).abs().max().item() <= 1e-4
    if k > 1:  # control: each row's weights shifted by one place misses by far more
        shifted = gemv.gemv(x, weight.roll(1, dims=1), bias=b)
        assert (shifted - F.linear(x, weight, b)).abs().max().item() > 1e-2


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n", [49, 50])
def test_int8_weights_times_their_scales_equal_the_dequantized_product(rows: int, n: int) -> None:
    torch.manual_seed(rows)
    q, scale = quantize_rows(torch.randn(n, 45))
    x, b = torch.randn(rows, 45), torch.randn(n)
    want = F.linear(x, q.float() * scale[:, None], b)
    got = Gemv(q, scale, b)(x)
    assert (got - want).abs().max().item() <= 1e-4
    assert (Gemv(q, None, b)(x) - want).abs().max().item() > 1e-2  # control: the scales left out


@needs_kernel
def test_in_place_updates_of_the_weight_are_seen() -> None:
    weight, x = torch.randn(16, 24), torch.randn(1, 24)
    kernel = Gemv(weight)
    weight.mul_(2)
    assert (kernel(x) - x @ weight.T).abs().max().item() <= 1e-4


@needs_kernel
def test_what_the_kernel_cannot_take_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        gemv.gemv(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(
        ValueError, match=r"contiguous 2-D float32, bfloat16 or int8 weight, got a torch\.float64"
    ):
        Gemv(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        Gemv(torch.randn(8, 4).T)
    with pytest.raises(ValueError, match=r"scale and bias must have shape \(4,\)"):
        Gemv(torch.randn(4, 8), bias=torch.randn(5))


def test_it_is_absent_where_it_cannot_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gemv, "_cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert gemv._build() is None  # no compiler: no kernel, no error
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.so"))
    monkeypatch.setenv("SPECVIT_NATIVE", "0")
    assert gemv._unsupported() == "SPECVIT_NATIVE=0"
    gemv._library.cache_clear()
    try:
        assert not gemv.available()
        with pytest.raises(RuntimeError, match="not available here: SPECVIT_NATIVE=0"):
            Gemv(torch.randn(4, 8))
    finally:
        monkeypatch.delenv("SPECVIT_NATIVE")
        gemv._library.cache_clear()


@needs_kernel
def test_it_is_built_once_into_the_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gemv, "_cache_dir", lambda: tmp_path)
    built = gemv._build()
    assert built is not None and built.parent == tmp_path and built.name.startswith("gemv-")
    assert [p.name for p in tmp_path.iterdir()] == [
        built.name
    ]  # the build folder removed, nothing half-written
    stamp = built.stat().st_mtime_ns
    assert gemv._build() == built and built.stat().st_mtime_ns == stamp  # found, not rebuilt


@needs_kernel
def test_the_result_is_cast_only_when_another_dtype_is_asked() -> None:
    weight, x = torch.randn(6, 16), torch.randn(2, 16)
    layer = Gemv(weight)
    out = layer(x)
    assert out.dtype == torch.float32 and torch.equal(layer(x, torch.float32), out)
    half = layer(x, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, out.to(torch.bfloat16))
