"""The functional Swin reference (``tests/swin_reference.py``) reproduces a real timm Swin's logits.

The fixture holds a timm 1.0.31 ``swin_tiny_patch4_window7_224`` built with ``embed_dim=16``,
``depths=(2, 2, 2, 1)``, ``num_heads=(1, 2, 4, 8)``, every parameter from N(0, 0.05), a batch of 2 images
and timm's eval-mode logits for them (stage resolutions 56, 28, 14, 7: plain and shifted windows in stages
0..2, a single un-partitioned window in stage 3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import swin_reference
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from swin_reference import (
    relative_position_index,
    shifted_window_mask,
    swin_forward,
    swin_num_params,
    window_partition,
    window_reverse,
)
from torch import Tensor

FIXTURE = (
    Path(__file__).parent
    / "fixtures"
    / "swin_tiny_patch4_window7_224__embed_dim-16_depths-2-2-2-1_num_heads-1-2-4-8.safetensors"
)
CFG: dict[str, Any] = {"embed_dim": 16, "depths": (2, 2, 2, 1), "num_heads": (1, 2, 4, 8)}
TIGHT = 1e-7  # float64 reference against timm's fp32 logits


@pytest.fixture(scope="module")
def timm_swin() -> tuple[dict[str, Tensor], Tensor, Tensor, dict[str, object]]:
    """The fixture's timm state dict (``model.`` prefix removed), input, output and ``timm_kwargs``."""
    tensors = load_file(FIXTURE)
    with safe_open(FIXTURE, "pt") as f:
        metadata = f.metadata()
    assert metadata["timm_model"] == "swin_tiny_patch4_window7_224"
    kwargs = json.loads(metadata["timm_kwargs"])
    state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    return state, tensors["input"], tensors["output"], kwargs


def test_reference_reproduces_timm_logits(
    timm_swin: tuple[dict[str, Tensor], Tensor, Tensor, dict[str, object]],
) -> None:
    state, x, expected, kwargs = timm_swin
    assert kwargs == {"embed_dim": 16, "depths": [2, 2, 2, 1], "num_heads": [1, 2, 4, 8]}
    with torch.no_grad():
        out = swin_forward(state, x, **CFG)
    assert out.shape == expected.shape == (2, 1000)
    assert out.dtype == torch.float32
    assert (out - expected).abs().max().item() <= 1e-5


def test_reference_matches_timm_tightly_in_float64(
    timm_swin: tuple[dict[str, Tensor], Tensor, Tensor, dict[str, object]],
) -> None:
    """In float64 the reference is within 1e-7 of timm's fp32 logits, buffers included.

    1e-5 alone would not test the attention: with every parameter (LayerNorm scales too) from N(0, 0.05),
    the attention branches are small against the residual stream, and dropping the shifted-window mask,
    the relative position bias or the shift moves the logits by only 3e-7 to 3e-6 (see
    :func:`test_tight_tolerance_sees_attention_details`). The reference's float64 logits differ from the
    fixture by ~2.4e-8 (timm's own fp32 rounding), so 1e-7 separates the two.
    """
    state, x, expected, _ = timm_swin
    state64 = {k: v.double() for k, v in state.items()}
    # buffers as some timm versions store them: checked against the reference's own, then ignored
    state64["layers.1.blocks.1.attn.relative_position_index"] = swin_reference.relative_position_index(7)
    state64["layers.1.blocks.1.attn_mask"] = swin_reference.shifted_window_mask(28, 28, 7, 3)
    with torch.no_grad():
        out = swin_forward(state64, x.double(), **CFG)
    assert out.dtype == torch.float64
    assert (out - expected.double()).abs().max().item() <= TIGHT


def test_wrong_buffer_is_rejected(
    timm_swin: tuple[dict[str, Tensor], Tensor, Tensor, dict[str, object]],
) -> None:
    state, x, _, _ = timm_swin
    bad = dict(state)
    bad["layers.1.blocks.1.attn_mask"] = torch.zeros(16, 49, 49)
    with pytest.raises(ValueError, match="attn_mask"):
        swin_forward(bad, x, **CFG)
    bad = dict(state)
    bad["layers.0.blocks.0.attn.relative_position_index"] = swin_reference.relative_position_index(7).T
    with pytest.raises(ValueError, match="relative_position_index"):
        swin_forward(bad, x, **CFG)


@pytest.mark.parametrize("mutation", ["no_mask", "no_shift", "no_relative_bias"])
def test_tight_tolerance_sees_attention_details(
    timm_swin: tuple[dict[str, Tensor], Tensor, Tensor, dict[str, object]],
    monkeypatch: pytest.MonkeyPatch,
    mutation: str,
) -> None:
    """A reference without the mask, the shift or the relative position bias misses the fixture by > 1e-7.

    (Each of these stays within 1e-5 of the fixture; only the float64 comparison at 1e-7 catches them.)
    """
    state, x, expected, _ = timm_swin
    state64 = {k: v.double() for k, v in state.items()}
    if mutation == "no_mask":
        real_mask = swin_reference.shifted_window_mask
        monkeypatch.setattr(swin_reference, "shifted_window_mask", lambda *a: 0 * real_mask(*a))
    elif mutation == "no_shift":
        monkeypatch.setattr(swin_reference, "_stage_window_shift", lambda r, w: (min(r, w), 0))
    else:
        for k in state64:
            if k.endswith("relative_position_bias_table"):
                state64[k] = torch.zeros_like(state64[k])
    with torch.no_grad():
        out = swin_forward(state64, x[:1].double(), **CFG)  # one image suffices, at half the cost
    diff = (out - expected[:1].double()).abs().max().item()
    assert TIGHT < diff <= 1e-5


def test_window_partition_round_trip() -> None:
    x = torch.randn(2, 14, 21, 5)
    windows = window_partition(x, 7)
    assert windows.shape == (2 * 2 * 3, 49, 5)
    # window 1 of image 0 is rows 0..6, columns 7..13, tokens row-major
    assert torch.equal(windows[1], x[0, 0:7, 7:14].reshape(49, 5))
    assert torch.equal(window_reverse(windows, 7, 14, 21), x)


def test_relative_position_index_formula() -> None:
    """``[i, j] = (dy + w - 1) * (2w - 1) + (dx + w - 1)``, ``(dy, dx) = pos_i - pos_j``, spelt out."""
    w = 3
    index = relative_position_index(w)
    assert index.shape == (9, 9)
    for i in range(w * w):
        for j in range(w * w):
            dy, dx = i // w - j // w, i % w - j % w
            assert index[i, j].item() == (dy + w - 1) * (2 * w - 1) + (dx + w - 1)
    assert index[0, 0].item() == index[4, 4].item() == (2 * w - 1) ** 2 // 2  # the centre of the table


def test_shifted_window_mask_regions() -> None:
    mask = shifted_window_mask(14, 14, 7, 3)
    assert mask.shape == (4, 49, 49)
    assert set(mask.unique().tolist()) == {-100.0, 0.0}
    assert (mask[0] == 0).all()  # the top-left window holds one region only
    # bottom-right window: rows 7..13 of the rolled map split at row 11, columns likewise: 4 regions
    regions = torch.tensor([(r >= 4) * 2 + (c >= 4) for r in range(7) for c in range(7)])
    assert torch.equal(mask[3], torch.where(regions[:, None] == regions[None, :], 0.0, -100.0))


def test_num_params(timm_swin: tuple[dict[str, Tensor], Tensor, Tensor, dict[str, object]]) -> None:
    tiny = swin_num_params(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), num_classes=1000)
    assert tiny == 28_288_354
    small = swin_num_params(embed_dim=16, depths=(2, 2, 2, 1), num_heads=(1, 2, 4, 8), num_classes=1000)
    assert small == 507_902
    state = timm_swin[0]
    assert sum(v.numel() for v in state.values()) == small
