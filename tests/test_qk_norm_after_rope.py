"""``block.qk_norm_after_rope``: the QK-norm of the rotated queries and keys (HunYuan's order), against a
hand-written attention; the flag refused without a QK-norm; the ejected file computing what the compiled model
does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_eject import _outputs

import specvit
from specvit.codegen.eject import eject_source
from specvit.export import example_inputs
from specvit.graph import build_graph
from specvit.nn.attention import Attention
from specvit.nn.position import apply_rope, rope_tables

D, H, HKV, HD, N = 32, 4, 2, 8, 7


def _layer(late: bool) -> Attention:
    torch.manual_seed(0)
    layer = Attention(D, H, num_kv_heads=HKV, qk_norm="rmsnorm", qk_norm_after_rope=late, causal=True).eval()
    with torch.no_grad():  # QK-norm weights off 1: the order then matters
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.copy_(torch.linspace(0.2, 2.0, HD))
    return layer


def _by_hand(layer: Attention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate, then RMS-normalise each head and scale by the norm's weight, then causal attention."""
    q, k, v = layer.qkv(x).split((H * HD, HKV * HD, HKV * HD), dim=-1)
    q, k, v = (t.unflatten(-1, (-1, HD)).transpose(1, 2) for t in (q, k, v))  # (B, H or Hkv, N, hd)

    def norm(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    q, k = norm(apply_rope(q, *rope), layer.q_norm.weight), norm(apply_rope(k, *rope), layer.k_norm.weight)
    k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, N, hd)
    return layer.proj(out.transpose(1, 2).flatten(2))


def test_the_norm_of_the_rotated_heads_is_the_hand_written_one() -> None:
    x = torch.randn(2, N, D, generator=torch.Generator().manual_seed(1))
    rope = rope_tables(torch.arange(N), HD, 50.0)
    with torch.no_grad():
        want = _by_hand(_layer(True), x, rope)
        assert (_layer(True)(x, rope=rope) - want).abs().max().item() <= 1e-5
        assert (
            _layer(False)(x, rope=rope) - want
        ).abs().max().item() > 1e-2  # the control: norm, then rotate


def _spec(late: bool, qk_norm: Any = "head") -> dict[str, Any]:
    block = {"heads": H, "kv_heads": HKV, "layers": ["masked_self_attention", "mlp"], "qk_norm": qk_norm,
             "qk_norm_after_rope": late, "norm": {"kind": "rmsnorm"}, "mlp": {"hidden": 40, "activation": "swiglu"}}  # fmt: skip
    return {"specvit": 1, "name": "late_qk_norm", "model": "decoder",
            "decoder": {"input": {"kind": "tokens", "vocab": 50}, "position": {"kind": "rope", "base": 50.0},
                        "width": D, "depth": 2, "block": block},
            "head": {"kind": "lm"}}  # fmt: skip


def test_a_spec_s_flag_reaches_each_layer() -> None:
    model = specvit.build_model(specvit.parse_spec(_spec(True)))
    assert all(b.attn.qk_norm_after_rope for b in model.decoder.blocks)
    assert not specvit.build_model(specvit.parse_spec(_spec(False))).decoder.blocks[0].attn.qk_norm_after_rope


def test_the_flag_without_a_qk_norm_is_refused() -> None:
    specvit.parse_spec(_spec(True))  # the control
    with pytest.raises(
        specvit.SpecError, match=r"decoder\.block\.qk_norm_after_rope: the block has no qk_norm"
    ):
        specvit.parse_spec(_spec(True, qk_norm=False))


def test_the_ejected_file_normalises_after_rope(tmp_path: Path) -> None:
    graph = build_graph(specvit.parse_spec(_spec(True)), batch=2, seq_len=12)
    text = eject_source(graph, use_ruff=False)
    got, want = _outputs(graph, text, example_inputs(graph, 2))
    assert (got - want).abs().max().item() == 0.0
