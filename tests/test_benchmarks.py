"""The benchmark helpers that can be checked cheaply: CPU description, GEMM shapes, ceilings, memory."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import specvit
from benchmarks.common import Row, cpu_info, pair_spread, timeit_pairs
from benchmarks.cuda import mfu
from benchmarks.gemm import ceilings, gemm_shapes, shape_rates
from benchmarks.memory import status_kib

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2
"""


def test_cpu_info_reads_the_model_and_the_isa_extensions() -> None:
    info = cpu_info(CPUINFO)
    assert info == {
        "model": "Intel(R) Xeon(R) Platinum 8480+",
        "isa": "AVX2, AVX-512, AVX512-BF16, AVX512-VNNI, AMX, AMX-BF16, AMX-INT8",
    }
    assert cpu_info("model name\t: Old CPU\nflags\t: fpu sse2\n") == {"model": "Old CPU", "isa": "none found"}


def test_gemm_shapes_of_a_small_vit() -> None:
    model = specvit.build_model(
        "vit_tiny_patch16_224", overrides={"encoder.depth": 2, "encoder.width": 64, "encoder.block.heads": 2}
    ).eval()
    shapes = gemm_shapes(model, (torch.randn(2, 3, 224, 224),))
    tokens = 2 * 197  # batch x (196 patches + class token)
    assert shapes == Counter(
        {
            (2 * 196, 3 * 16 * 16, 64): 1,  # the patch embedding, a stride-16 conv
            (tokens, 64, 3 * 64): 2,  # qkv
            (tokens, 64, 64): 2,  # attention output
            (tokens, 64, 256): 2,  # MLP up
            (tokens, 256, 64): 2,  # MLP down
            (2, 64, 1000): 1,  # the head, on the class token
        }
    )
    assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())


def test_shape_rates_and_ceilings() -> None:
    rates = shape_rates(Counter({(16, 32, 8): 2, (4, 8, 16): 1}), repeat=1)
    assert {"fp32 torch.mm (MKL)", "fp32 F.linear", "bf16 torch.mm"} <= set(rates)
    assert all(r > 0 for r in rates.values())
    for dtype in ("fp32", "bf16"):  # the fastest path of each shape is at least as fast as any one path
        paths = [r for name, r in rates.items() if name.startswith(dtype + " ") and "per shape" not in name]
        assert rates[f"{dtype} best path per shape"] >= max(paths) * (1 - 1e-9)
    best = ceilings({"fp32 a": 10.0, "fp32 b": 12.0, "bf16 a": 30.0})
    assert best == {"fp32": 12.0, "bf16": 30.0}


def test_status_fields() -> None:
    status = "Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n"
    assert status_kib("VmHWM", status) == 204800 and status_kib("VmRSS", status) == 102400
    assert status_kib("VmSwap", status) is None


def test_row_text_and_mfu() -> None:
    row = Row("s", "w", 2.0, 4.0, "peer", ours_mem=100 * 2**20, peer_mem=200 * 2**20)
    assert row.ratio() == "0.50" and row.mem() == "100 MiB vs 200 MiB (0.50)"
    assert mfu(312 * 10**12, 2.0, "NVIDIA A100-SXM4-80GB") == 0.5
    assert mfu(1, 1.0, "unknown GPU") is None


def test_decode_step_bytes_count_each_weight_once_and_the_cache() -> None:
    from benchmarks.decode import llama_pair, step_bytes

    ref, _ = llama_pair(smoke=True)
    # the smoke Llama: a tied 256 x 64 table, 2 layers of q 64x64, k and v 64x32, o 64x64, MLP 3 x 64x128,
    # two norms of 64, and the final norm: 90432 float32 weights
    weights = 4 * (256 * 64 + 2 * (4096 + 2 * 2048 + 4096 + 3 * 8192 + 2 * 64) + 64)
    kv_per_token = 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers, 2 kv heads of 16, float32
    assert step_bytes(ref, 1, 10) == weights + 10 * kv_per_token
    assert step_bytes(ref, 8, 10) == weights + 80 * kv_per_token  # the weights are read once for the batch


def test_decode_rows_smoke() -> None:
    """The decode section at toy sizes: its rows, greedy tokens equal to HF's (the rows say "same tokens")."""
    from benchmarks.common import NOTES
    from benchmarks.decode import decode_rows

    rows = decode_rows(1, smoke=True)
    assert [(r.section, r.what.split(":")[0]) for r in rows] == [
        ("Generation of 8 tokens from 8", "greedy, same tokens, batch 1"),
        ("Generation of 8 tokens from 8", "sampled (T=1, top-50), batch 1"),
        ("Per-token decode", "fp32, batch 1"),
        ("Per-token decode", "bf16 weights, batch 1"),
        ("Per-token decode", "int8 weights, batch 1"),
        ("Generation of 8 tokens from 8", "greedy, same tokens, batch 8"),
        ("Generation of 8 tokens from 8", "sampled (T=1, top-50), batch 8"),
        ("Per-token decode", "fp32, batch 8"),
        ("Prefill of 16 tokens", "batch 1, all logits"),
    ]
    assert all(r.ours > 0 and r.peer for r in rows if r.section != "Per-token decode")
    assert "of the memory wall" in rows[2].what and "of its memory wall" in rows[4].what
    assert all("greedy tokens equal fp32's at" in r.what for r in rows[3:5])
    assert NOTES[-1].startswith("decode wall: streaming-read rate")


def test_module_step_bytes_of_smaller_weights() -> None:
    """fp32 and bf16 read the tied table through the head; int8 reads its int8 copy (and bf16 scales), not the
    bf16 table, of which a lookup reads one row; the weight-only copies read their linears' smaller weights and
    float32 norms (and float32 scales)."""
    from benchmarks.decode import llama_pair, module_step_bytes, step_bytes
    from specvit.tuning import bf16_weights, bf16_weights_only, int8_weights, int8_weights_only

    ref, ours = llama_pair(smoke=True)
    fp32 = module_step_bytes(ours)
    assert fp32 == step_bytes(ref, 1, 0)
    assert module_step_bytes(bf16_weights(ours)) == fp32 // 2
    # int8: every linear weight in 1 byte plus a 2-byte scale per output; the norms (5 x 64) in bf16
    linears = 2 * (4096 + 2 * 2048 + 4096 + 3 * 8192) + 256 * 64
    outputs = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64) + 256
    assert module_step_bytes(int8_weights(ours)) == linears + 2 * outputs + 2 * 5 * 64
    assert module_step_bytes(bf16_weights_only(ours)) == 2 * linears + 4 * 5 * 64
    assert module_step_bytes(int8_weights_only(ours)) == linears + 4 * outputs + 4 * 5 * 64


def test_decode_agreement_text() -> None:
    from benchmarks.decode import _agreement

    want = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert _agreement(want.clone(), want) == "same tokens"
    got = want.clone()
    got[1, 2:] = 0  # row 1 departs at position 2
    assert _agreement(got, want) == "tokens differ from HF's from position 2 of row 1"
    assert _agreement(want[:, :3], want) == "[2, 3] tokens vs HF's [2, 4]"


def test_token_agreement_text() -> None:
    from benchmarks.decode import _token_agreement

    want = torch.tensor([[9, 1, 2, 3, 4], [9, 5, 6, 7, 8]])  # a one-token prompt, then four new tokens
    assert _token_agreement(want.clone(), want, 1) == (
        "greedy tokens equal fp32's at 100% of 2 prompts x 4 positions (2 of 2 rows throughout)"
    )
    got = want.clone()
    got[1, 3:] = 0  # row 1 departs at its third new token: 6 of 8 new positions equal
    assert _token_agreement(got, want, 1) == (
        "greedy tokens equal fp32's at 75% of 2 prompts x 4 positions (1 of 2 rows throughout)"
    )
    assert _token_agreement(want[:, :3], want, 1) == "[2, 3] tokens vs fp32's [2, 5]"


def _finite(rows: list[Row]) -> bool:
    return all(math.isfinite(r.ours) and r.ours > 0 and r.peer and math.isfinite(r.peer) for r in rows)


def _verdicts(count: int) -> list[str]:
    from benchmarks.common import TARGETS

    return [check(0.0) for check in TARGETS[-count:]]


def test_moe_rows_smoke() -> None:
    """The MoE section at toy sizes: a forward and a training-step row against HF's Mixtral block, each
    stating the difference it asserted (outputs, then gradients) and recording its target."""
    from benchmarks.peers import moe_rows

    rows = moe_rows(1, smoke=True)
    assert [r.section for r in rows] == [
        "Mixture-of-experts MLP (Mixtral's), eval forward [smoke size]",
        "Mixture-of-experts MLP (Mixtral's), training step (AdamW) [smoke size]",
    ]
    assert _finite(rows) and all(r.peer_name.startswith("HF MixtralSparseMoeBlock (") for r in rows)
    assert rows[0].what.startswith("4 experts, top 2, width 32, expert hidden 64, batch 2 x 16 tokens")
    assert "; max abs diff " in rows[0].what and "max abs diff of the gradients" in rows[1].what
    assert all(float(r.what.rsplit(" ", 1)[1]) < 1e-4 for r in rows)
    # 32 tokens: the router (32 x 4) and 2 experts of 3 matrices 32 x 64 each, 2 FLOPs a multiply-add
    assert rows[0].flops == 2 * 32 * 32 * (4 + 2 * 3 * 64) and rows[1].flops == 3 * rows[0].flops
    for verdict, row in zip(_verdicts(2), rows, strict=True):
        assert verdict.split(": ", 1)[0] in ("met", "MISSED")
        assert f": {row.section} no slower than {row.peer_name}: ratio {row.ratio()}" in verdict


def test_moe_rows_refuse_to_time_a_different_mlp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: one expert's weights changed on specvit's side, the row's equality assert fires."""
    from benchmarks import peers

    original = peers.moe_pair

    def tampered(smoke: bool) -> peers.MoePair:
        pair = original(smoke)
        with torch.no_grad():
            pair.experts.get_parameter("fc2").add_(0.01)
        return pair

    monkeypatch.setattr(peers, "moe_pair", tampered)
    with pytest.raises(AssertionError, match="the MoE MLP differs from HF Mixtral's by"):
        peers.moe_rows(1, smoke=True)


def test_swin_rows_smoke() -> None:
    """The Swin section at toy width: specvit's preset against timm's Swin-T on converted weights."""
    from benchmarks.peers import swin_rows

    rows = swin_rows(1, smoke=True)
    assert [(r.section, r.peer_name) for r in rows] == [
        ("Swin-T forward (windowed attention), eval [smoke size]", "timm swin_tiny_patch4_window7_224")
    ]
    assert _finite(rows) and rows[0].flops
    assert rows[0].what.startswith("width 16, heads 1/2/4/8, 2 blocks a stage, batch 2, 224 pixels")
    assert float(rows[0].what.rsplit(" ", 1)[1]) < 1e-4
    assert f": {rows[0].section} no slower than timm: ratio {rows[0].ratio()}" in _verdicts(1)[0]


def test_swin_rows_refuse_to_time_a_different_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: specvit's first relative position bias table changed, the row's equality assert fires."""
    from benchmarks import peers

    original = peers.swin_pair

    def tampered(smoke: bool) -> tuple[nn.Module, nn.Module, Any]:
        ours, peer, spec = original(smoke)
        with torch.no_grad():
            table = next(p for n, p in ours.named_parameters() if "relative_position_bias_table" in n)
            # noise, not a constant: a bias the same for every key would leave the softmax as it was
            table.add_(torch.randn(table.shape, generator=torch.Generator().manual_seed(0)))
        return ours, peer, spec

    monkeypatch.setattr(peers, "swin_pair", tampered)
    with pytest.raises(AssertionError, match="Swin-T differs from timm's by"):
        peers.swin_rows(1, smoke=True)


def test_pairs_alternate_and_their_spread() -> None:
    calls: list[str] = []
    ta, tb = timeit_pairs(lambda: calls.append("a"), lambda: calls.append("b"), repeat=3)
    assert calls == ["a", "b"] * 4 and len(ta) == len(tb) == 3  # one warm-up pair, then three timed
    assert (
        pair_spread([1.0, 2.2, 3.0], [1.0, 2.0, 3.2]) == "0.94-1.10"
    )  # the ratios of pairs, not of extremes
    assert pair_spread([1.0, 3.0], [3.0, 1.0]) == "0.33-3.00"
    with pytest.raises(ValueError):  # a pair missing its other half is an error, not a shorter list
        pair_spread([1.0, 2.0], [1.0])
