"""Tests of the PyTorch building blocks in specvit.nn against independent references."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from specvit.nn.attention import CrossAttention, KVCache, SelfAttention
from specvit.nn.embed import PatchEmbed, PrefixTokens, TokenEmbed
from specvit.nn.functional import cls_pool, mean_pool
from specvit.nn.layers import DropPath, LayerScale
from specvit.nn.mlp import GluMlp, Mlp, build_mlp
from specvit.nn.position import (
    LearnedPosition,
    Rope,
    SinCos2dPosition,
    SinCosPosition,
    apply_rope,
    rope_tables,
    sincos_1d,
    sincos_2d,
)
from specvit.nn.rope2d import Rope2d


def assert_close(actual: Tensor, expected: Tensor, atol: float = 1e-5) -> None:
    """fp32 by default: a module against a reference doing the same maths in another order, on values of
    magnitude 0.4-14, where one fp32 ulp is 3e-8 to 1e-6. Seen on AMD EPYC: at most 4.8e-7 with one torch
    thread, 1.4e-6 with two (another split of the sums), so 1e-5 leaves 7x. Exactness claims compare in
    float64 and pass ``atol`` <= 1e-10."""
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def randomize(module: nn.Module) -> nn.Module:
    """Give every parameter (including norm weights/biases) non-trivial values."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module


# ----------------------------------------------------------------------------------------------- layers


def test_drop_path_identity_in_eval_and_at_zero() -> None:
    x = torch.randn(8, 5, 4)
    dp = DropPath(0.5).eval()
    assert torch.equal(dp(x), x)
    assert torch.equal(DropPath(0.0).train()(x), x)


def test_drop_path_drops_whole_samples_and_rescales() -> None:
    x = torch.randn(4000, 3, 2)
    out = DropPath(0.25).train()(x)
    flat_out, flat_x = out.reshape(4000, -1), x.reshape(4000, -1)
    dropped = (flat_out == 0).all(dim=1)
    kept = ~dropped
    assert_close(flat_out[kept], flat_x[kept] / 0.75)
    assert abs(dropped.float().mean().item() - 0.25) < 0.03
    with pytest.raises(ValueError):
        DropPath(1.0)


def test_layer_scale() -> None:
    ls = LayerScale(6, init_value=0.1)
    assert ls.gamma.shape == (6,)
    x = torch.randn(2, 3, 6)
    assert_close(ls(x), x * 0.1)
    with torch.no_grad():
        ls.gamma.copy_(torch.arange(6.0))
    assert_close(ls(x), x * torch.arange(6.0))
    ls.reset_parameters()
    assert torch.equal(ls.gamma.detach(), torch.full((6,), 0.1))


# ------------------------------------------------------------------------------------------------- mlp


@pytest.mark.parametrize(
    ("activation", "fn"),
    [
        ("gelu", lambda h: 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))),
        # GPT-2's gelu: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        (
            "gelu_tanh",
            lambda h: 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3))),
        ),
        ("relu", lambda h: h.clamp(min=0.0)),
        ("silu", lambda h: h * torch.sigmoid(h)),
    ],
)
def test_mlp_matches_manual(activation: str, fn: object) -> None:
    mlp = build_mlp(8, 20, activation, bias=True, dropout=0.0)  # type: ignore[arg-type]
    assert isinstance(mlp, Mlp)
    assert [name for name, _ in mlp.named_children()] == ["fc1", "act", "drop1", "fc2", "drop2"]
    x = torch.randn(2, 5, 8)
    h = x @ mlp.fc1.weight.T + mlp.fc1.bias
    expected = fn(h) @ mlp.fc2.weight.T + mlp.fc2.bias  # type: ignore[operator]
    assert_close(mlp(x), expected)


def test_swiglu_matches_hf_llama_mlp() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    ref = LlamaMLP(
        LlamaConfig(hidden_size=16, num_attention_heads=4, intermediate_size=24, hidden_act="silu")
    )
    mlp = build_mlp(16, 24, "swiglu", bias=False)
    assert isinstance(mlp, GluMlp)
    with torch.no_grad():
        mlp.fc1.weight.copy_(torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))  # [gate; value]
        mlp.fc2.weight.copy_(ref.down_proj.weight)
    x = torch.randn(3, 7, 16)
    assert_close(mlp(x), ref(x))


def test_geglu_matches_manual() -> None:
    mlp = GluMlp(8, 12, "geglu", bias=True)
    x = torch.randn(2, 3, 8)
    h = x @ mlp.fc1.weight.T + mlp.fc1.bias
    gate, value = h[..., :12], h[..., 12:]
    expected = (
        0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * value
    ) @ mlp.fc2.weight.T + mlp.fc2.bias
    assert_close(mlp(x), expected)


def test_mlp_dropout_and_bad_activation() -> None:
    mlp = Mlp(8, 16, "gelu", dropout=0.5)
    assert isinstance(mlp.drop1, nn.Dropout) and isinstance(mlp.drop2, nn.Dropout)
    assert isinstance(Mlp(8, 16, "gelu").drop1, nn.Identity)
    x = torch.randn(4, 8)
    assert torch.equal(mlp.eval()(x), mlp(x))
    with pytest.raises(ValueError):
        build_mlp(8, 16, "tanh", bias=True, dropout=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Mlp(8, 16, "swiglu")  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------- position


def tutorial_positional_encoding(d_model: int, max_len: int) -> Tensor:
    """The PyTorch tutorial's ``PositionalEncoding`` table (max_len, d_model)."""
    position = torch.arange(max_len).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


def test_sincos_1d_matches_pytorch_tutorial() -> None:
    assert_close(sincos_1d(torch.arange(50), 32), tutorial_positional_encoding(32, 50))
    assert_close(sincos_1d(torch.arange(50.0), 32), tutorial_positional_encoding(32, 50))


def mae_1d(embed_dim: int, pos: np.ndarray) -> np.ndarray:
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000**omega
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def mae_2d(embed_dim: int, grid_h: int, grid_w: int) -> np.ndarray:
    """MAE's get_2d_sincos_pos_embed, generalised to a grid_h x grid_w grid."""
    mesh = np.meshgrid(
        np.arange(grid_w, dtype=np.float64), np.arange(grid_h, dtype=np.float64)
    )  # w goes first
    grid = np.stack(mesh, axis=0).reshape([2, 1, grid_h, grid_w])
    emb_h = mae_1d(embed_dim // 2, grid[0])  # MAE's naming: it is really the w coordinate
    emb_w = mae_1d(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=1)


@pytest.mark.parametrize(("gh", "gw", "dim"), [(4, 4, 32), (3, 5, 16), (14, 14, 64)])
def test_sincos_2d_matches_mae(gh: int, gw: int, dim: int) -> None:
    expected = torch.from_numpy(mae_2d(dim, gh, gw)).float()
    table = sincos_2d(gh, gw, dim)
    assert table.shape == (gh * gw, dim) and table.dtype == torch.float32
    assert_close(table, expected)
    # row-major tokens, first half encodes the column: token (r, c) = r * gw + c
    r, c = gh - 1, 1
    assert_close(table[r * gw + c, : dim // 2], table[c, : dim // 2])
    assert_close(table[r * gw + c, dim // 2 :], table[r * gw, dim // 2 :])
    with pytest.raises(ValueError):
        sincos_2d(2, 2, 18)


def test_learned_position() -> None:
    pos = LearnedPosition(10, 6)
    assert pos.weight.shape == (1, 10, 6)
    assert pos.weight.abs().max() <= 0.04
    x = torch.randn(2, 4, 6)
    assert_close(pos(x), x + pos.weight[:, :4])
    assert_close(pos(x, offset=6), x + pos.weight[:, 6:10])
    with pytest.raises(ValueError, match="10 positions"):
        pos(x, offset=7)


def test_sincos_position_modules() -> None:
    x = torch.randn(2, 5, 8)
    assert_close(SinCosPosition(8)(x, offset=3), x + tutorial_positional_encoding(8, 8)[3:8])
    grid_x = torch.randn(2, 6, 16)
    assert_close(SinCos2dPosition(16, (2, 3))(grid_x), grid_x + torch.from_numpy(mae_2d(16, 2, 3)).float())
    with pytest.raises(ValueError, match="2x3"):
        SinCos2dPosition(16, (2, 3))(torch.randn(2, 7, 16))


def test_rope_matches_hf_llama() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hd, base = 16, 500.0
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=hd,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    positions = torch.tensor([0, 1, 2, 7, 100, 3000])
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])  # (1, N, hd)
    cos, sin = rope_tables(positions, hd, base)
    assert cos.shape == sin.shape == (6, hd)
    assert_close(cos, ref_cos[0])
    assert_close(sin, ref_sin[0])
    q, k = torch.randn(2, 4, 6, hd), torch.randn(2, 2, 6, hd)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    assert_close(apply_rope(q, cos, sin), ref_q)
    assert_close(apply_rope(k, cos, sin), ref_k)


def croco_rope2d(tokens: Tensor, positions: Tensor, base: float) -> Tensor:
    """CroCo's pytorch RoPE2D.forward: tokens (B, H, N, hd), positions (B, N, 2) as (y, x)."""

    def rotate_half(x: Tensor) -> Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    d = tokens.size(3) // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    t = torch.arange(int(positions.max()) + 1, dtype=inv_freq.dtype)
    freqs = torch.einsum("i,j->ij", t, inv_freq)
    freqs = torch.cat((freqs, freqs), dim=-1)
    cos_table, sin_table = freqs.cos(), freqs.sin()

    def rope1d(x: Tensor, pos1d: Tensor) -> Tensor:
        cos = F.embedding(pos1d, cos_table)[:, None, :, :]
        sin = F.embedding(pos1d, sin_table)[:, None, :, :]
        return x * cos + rotate_half(x) * sin

    y, x = tokens.chunk(2, dim=-1)
    return torch.cat((rope1d(y, positions[:, :, 0]), rope1d(x, positions[:, :, 1])), dim=-1)


def croco_positions(b: int, h: int, w: int) -> Tensor:
    """CroCo's PositionGetter: (B, h*w, 2) (y, x) positions, row-major."""
    return torch.cartesian_prod(torch.arange(h), torch.arange(w)).view(1, h * w, 2).expand(b, -1, 2)


@pytest.mark.parametrize("num_prefix", [0, 3])
def test_rope2d_matches_croco(num_prefix: int) -> None:
    gh, gw, hd = 3, 5, 16
    cos, sin = Rope2d(hd, (gh, gw), num_prefix=num_prefix)(torch.zeros(1, num_prefix + gh * gw, 1))
    assert cos.shape == sin.shape == (num_prefix + gh * gw, 2, hd // 2)
    x = torch.randn(2, 4, num_prefix + gh * gw, hd)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[:, :, :num_prefix], x[:, :, :num_prefix])  # prefix tokens: identity rotation
    expected = croco_rope2d(x[:, :, num_prefix:], croco_positions(2, gh, gw), base=100.0)
    assert_close(out[:, :, num_prefix:], expected)
    with pytest.raises(ValueError):
        Rope2d(18, (2, 2))


def test_rope_is_relative() -> None:
    """q.k after RoPE only depends on the position difference."""
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(pq: int, pk: int) -> Tensor:
        cq, sq = rope_tables(torch.tensor([pq]), 8, 10000.0)
        ck, sk = rope_tables(torch.tensor([pk]), 8, 10000.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    assert_close(score(5, 2), score(13, 10))
    assert_close(score(0, 0), (q * k).sum())


@pytest.mark.parametrize("rotary", [16, 8])  # all of a head's 16 channels, or the first 8
def test_queries_and_keys_rotated_in_one_call_equal_one_call_each(rotary: int) -> None:
    """The core rotates its queries and keys in one RoPE call where it can (``rope_together``): exactly the
    values of a call for each, with GQA; the control, the one call with another position's tables, differs."""
    attn = SelfAttention(64, 4, num_kv_heads=2, causal=True).eval()
    assert attn.rope_together
    x, tables = torch.randn(2, 6, 64), rope_tables(torch.arange(6), rotary, 10000.0)
    together = attn(x, rope=tables)
    attn.rope_together = False
    each = attn(x, rope=tables)
    assert torch.equal(together, each)
    attn.rope_together = True
    assert not torch.equal(attn(x, rope=rope_tables(torch.arange(1, 7), rotary, 10000.0)), each)


# ----------------------------------------------------------------------------------------------- embed


@pytest.mark.parametrize("patch", [(4, 4), (2, 3)])
def test_patch_embed_conv_linear_and_manual(patch: tuple[int, int]) -> None:
    img, c, d = (8, 12), 3, 10
    conv = PatchEmbed(img, patch, c, d, projection="conv")
    lin = PatchEmbed(img, patch, c, d, projection="linear")
    assert conv.grid == lin.grid == (8 // patch[0], 12 // patch[1])
    assert conv.num_patches == conv.grid[0] * conv.grid[1]
    assert isinstance(conv.proj, nn.Conv2d) and isinstance(lin.proj, nn.Linear)
    with torch.no_grad():
        lin.proj.weight.copy_(conv.proj.weight.reshape(d, -1))
        assert lin.proj.bias is not None and conv.proj.bias is not None
        lin.proj.bias.copy_(conv.proj.bias)
    x = torch.randn(2, c, *img)
    out = conv(x)
    assert out.shape == (2, conv.num_patches, d)
    assert_close(lin(x), out)
    # row-major: token r * gw + c is the patch at row r, column c
    ph, pw = patch
    gw = conv.grid[1]
    for r, col in [(0, 0), (0, gw - 1), (conv.grid[0] - 1, 1)]:
        piece = x[:, :, r * ph : (r + 1) * ph, col * pw : (col + 1) * pw].reshape(2, -1)
        expected = piece @ conv.proj.weight.reshape(d, -1).T + conv.proj.bias
        assert_close(out[:, r * gw + col], expected)


def test_patch_embed_errors() -> None:
    pe = PatchEmbed((8, 8), (4, 4), 3, 6)
    with pytest.raises(ValueError, match=r"\(8, 8\)"):
        pe(torch.randn(1, 3, 8, 12))
    with pytest.raises(ValueError, match="divisible"):
        PatchEmbed((10, 8), (4, 4), 3, 6)


def test_token_embed() -> None:
    emb = TokenEmbed(11, 16, padding_idx=0, scale=True)
    assert list(emb.state_dict()) == ["weight"]
    ids = torch.tensor([[0, 3, 10]])
    out = emb(ids)
    assert_close(out, emb.weight[ids] * 4.0)
    assert torch.equal(out[0, 0], torch.zeros(16))
    plain = TokenEmbed(11, 16)
    assert plain.padding_idx is None
    assert torch.equal(plain(ids), F.embedding(ids, plain.weight))


def test_prefix_tokens() -> None:
    pt = PrefixTokens(8, cls=True, registers=2)
    assert pt.num_prefix == 3
    assert {k: tuple(v.shape) for k, v in pt.state_dict().items()} == {
        "cls_token": (1, 1, 8),
        "reg_token": (1, 2, 8),
    }
    x = torch.randn(2, 4, 8)
    out = pt(x)
    assert out.shape == (2, 7, 8)
    assert pt.cls_token is not None and pt.reg_token is not None
    assert torch.equal(out[:, :1], pt.cls_token.expand(2, -1, -1))
    assert torch.equal(out[:, 1:3], pt.reg_token.expand(2, -1, -1))
    assert torch.equal(out[:, 3:], x)
    regs_only = PrefixTokens(8, cls=False, registers=4)
    assert list(regs_only.state_dict()) == ["reg_token"] and regs_only.num_prefix == 4
    empty = PrefixTokens(8, cls=False, registers=0)
    assert empty.num_prefix == 0 and not list(empty.parameters())
    assert empty(x) is x


# ------------------------------------------------------------------------------------------- attention


def ref_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None = None) -> Tensor:
    """Textbook softmax(q k^T / sqrt(hd)) v; q, k, v (B, H, *, hd)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(dim=-1) @ v


def self_attention_pair(
    d: int = 32, h: int = 4, causal: bool = False
) -> tuple[SelfAttention, nn.MultiheadAttention]:
    mha = randomize(nn.MultiheadAttention(d, h, batch_first=True))
    assert isinstance(mha, nn.MultiheadAttention)
    ours = SelfAttention(d, h, causal=causal)
    with torch.no_grad():
        ours.qkv.weight.copy_(mha.in_proj_weight)
        ours.qkv.bias.copy_(mha.in_proj_bias)
        ours.proj.weight.copy_(mha.out_proj.weight)
        ours.proj.bias.copy_(mha.out_proj.bias)
    return ours, mha


@pytest.mark.parametrize("case", ["none", "causal", "padding", "causal+padding"])
def test_self_attention_matches_multihead_attention(case: str) -> None:
    b, n, d = 3, 7, 32
    causal, padded = "causal" in case, "padding" in case
    ours, mha = self_attention_pair(d, causal=causal)
    x = torch.randn(b, n, d)
    kpm = None
    float_kpm = None
    if padded:
        kpm = torch.arange(n)[None, :] >= torch.tensor([n, n - 3, 2])[:, None]  # (B, N), right padding
        float_kpm = torch.zeros(b, n).masked_fill(kpm, float("-inf"))
    attn_mask = nn.Transformer.generate_square_subsequent_mask(n) if causal else None
    expected, _ = mha(x, x, x, key_padding_mask=float_kpm, attn_mask=attn_mask, need_weights=False)
    assert_close(ours(x, mask=kpm), expected)


@pytest.mark.parametrize("memory_dim", [None, 24])
def test_cross_attention_matches_multihead_attention(memory_dim: int | None) -> None:
    b, n, m, d, h = 2, 5, 6, 32, 4
    dm = memory_dim or d
    mha = randomize(nn.MultiheadAttention(d, h, batch_first=True, kdim=dm, vdim=dm))
    assert isinstance(mha, nn.MultiheadAttention)
    ours = CrossAttention(d, h, memory_dim=memory_dim)
    with torch.no_grad():
        if memory_dim is None:
            ours.q.weight.copy_(mha.in_proj_weight[:d])
            ours.kv.weight.copy_(mha.in_proj_weight[d:])
        else:
            ours.q.weight.copy_(mha.q_proj_weight)
            ours.kv.weight.copy_(torch.cat([mha.k_proj_weight, mha.v_proj_weight]))
        ours.q.bias.copy_(mha.in_proj_bias[:d])
        ours.kv.bias.copy_(mha.in_proj_bias[d:])
        ours.proj.weight.copy_(mha.out_proj.weight)
        ours.proj.bias.copy_(mha.out_proj.bias)
    x, memory = torch.randn(b, n, d), torch.randn(b, m, dm)
    expected, _ = mha(x, memory, memory, need_weights=False)
    assert_close(ours(x, memory=memory), expected)
    mpm = torch.arange(m)[None, :] >= torch.tensor([m, 2])[:, None]  # (B, M)
    expected, _ = mha(x, memory, memory, key_padding_mask=mpm, need_weights=False)
    assert_close(ours(x, memory=memory, memory_mask=mpm), expected)


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_gqa_equals_mha_with_repeated_kv_heads(num_kv_heads: int) -> None:
    d, h, hd = 32, 4, 8
    gqa = randomize(SelfAttention(d, h, num_kv_heads=num_kv_heads, causal=True))
    assert isinstance(gqa, SelfAttention)
    assert gqa.qkv.weight.shape == ((h + 2 * num_kv_heads) * hd, d)
    mha = SelfAttention(d, h, causal=True)

    def repeat(w: Tensor) -> Tensor:  # kv head j serves query heads j*g .. j*g + g - 1
        heads = w.reshape(num_kv_heads, hd, *w.shape[1:])  # (Hkv, hd[, D])
        return heads.repeat_interleave(h // num_kv_heads, dim=0).reshape(h * hd, *w.shape[1:])

    with torch.no_grad():
        for name in ("weight", "bias"):
            wq, wk, wv = getattr(gqa.qkv, name).split([h * hd, num_kv_heads * hd, num_kv_heads * hd])
            getattr(mha.qkv, name).copy_(torch.cat([wq, repeat(wk), repeat(wv)]))
        mha.proj.load_state_dict(gqa.proj.state_dict())
    x = torch.randn(2, 6, d)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    assert_close(gqa(x), mha(x))
    assert_close(gqa(x, mask=kpm), mha(x, mask=kpm))


@pytest.mark.parametrize("qk_norm", [None, "layernorm", "rmsnorm"])
@pytest.mark.parametrize("rope_kind", ["rope", "rope2d"])
def test_self_attention_qk_norm_rope_gqa_vs_manual(qk_norm: str | None, rope_kind: str) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, d, h, hkv, hd = 2, 32, 4, 2, 8
    attn = randomize(SelfAttention(d, h, num_kv_heads=hkv, qk_norm=qk_norm, norm_eps=1e-6)).double()  # type: ignore[arg-type]
    assert isinstance(attn, SelfAttention)
    prefix, grid = 1, (2, 3)
    n = prefix + grid[0] * grid[1]
    x = torch.randn(b, n, d, dtype=torch.float64)
    if rope_kind == "rope":
        rope = rope_tables(torch.arange(n), hd, 50.0)
    else:
        rope = Rope2d(hd, grid, num_prefix=prefix)(x)

    qkv = x @ attn.qkv.weight.T + attn.qkv.bias
    q = qkv[..., : h * hd].reshape(b, n, h, hd).transpose(1, 2)
    k = qkv[..., h * hd : (h + hkv) * hd].reshape(b, n, hkv, hd).transpose(1, 2)
    v = qkv[..., (h + hkv) * hd :].reshape(b, n, hkv, hd).transpose(1, 2)
    if qk_norm == "layernorm":
        assert isinstance(attn.q_norm, nn.LayerNorm) and isinstance(attn.k_norm, nn.LayerNorm)
        q = F.layer_norm(q, (hd,), attn.q_norm.weight, attn.q_norm.bias, eps=1e-6)
        k = F.layer_norm(k, (hd,), attn.k_norm.weight, attn.k_norm.bias, eps=1e-6)
    elif qk_norm == "rmsnorm":
        assert isinstance(attn.q_norm, nn.RMSNorm) and isinstance(attn.k_norm, nn.RMSNorm)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.q_norm.weight
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.k_norm.weight
    if rope_kind == "rope":
        q, k = apply_rotary_pos_emb(q, k, rope[0][None], rope[1][None])
    else:
        pos = croco_positions(b, *grid)
        q = torch.cat([q[:, :, :prefix], croco_rope2d(q[:, :, prefix:], pos, 100.0)], dim=2)
        k = torch.cat([k[:, :, :prefix], croco_rope2d(k[:, :, prefix:], pos, 100.0)], dim=2)
    out = ref_attention(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1))
    expected = out.transpose(1, 2).reshape(b, n, h * hd) @ attn.proj.weight.T + attn.proj.bias
    # float64: 4.4e-15 seen. In fp32 the two orders of the same sums differed by 2.9e-6 on outputs near 10.
    assert_close(attn(x, rope=rope), expected, atol=1e-10)


def test_kv_cache_decoding_equals_full_causal_forward() -> None:
    """Exact in float64 (<= 1e-12): the cached path computes the same sums in another order, so in fp32
    the two differ by rounding alone (1.4e-6 seen on AMD EPYC, less on Intel AMX)."""
    d, hd = 32, 8
    attn = randomize(SelfAttention(d, 4, num_kv_heads=2, qk_norm="layernorm", causal=True)).double().eval()
    x = torch.randn(2, 7, d, dtype=torch.float64)

    def rope(start: int, stop: int) -> tuple[Tensor, Tensor]:
        return rope_tables(torch.arange(start, stop), hd, 10000.0)

    full = attn(x, rope=rope(0, 7))
    cache = KVCache()
    outs, pos = [], 0
    for step in (3, 1, 1, 2):
        outs.append(attn(x[:, pos : pos + step], rope=rope(pos, pos + step), cache=cache))
        pos += step
    assert cache.length(0) == 7 and cache.keys[0].shape == (2, 2, 7, hd)
    assert_close(torch.cat(outs, dim=1), full, atol=1e-12)

    # left padding: the padding mask covers every key (cached + new)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, :2] = True
    full = attn(x, mask=kpm, rope=rope(0, 7))
    cache, outs = KVCache(), []
    for pos in range(7):
        outs.append(attn(x[:, pos : pos + 1], mask=kpm[:, : pos + 1], rope=rope(pos, pos + 1), cache=cache))
    assert_close(torch.cat(outs, dim=1), full, atol=1e-12)
    assert torch.isfinite(full).all()


def test_causal_outputs_ignore_future_tokens() -> None:
    attn = randomize(SelfAttention(16, 2, causal=True)).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    t = 4
    y = x.clone()
    y[:, t + 1 :] = torch.randn(2, 9 - t - 1, 16, dtype=torch.float64)
    out_x, out_y = attn(x), attn(y)
    assert_close(out_y[:, : t + 1], out_x[:, : t + 1], atol=1e-12)  # exact in float64
    assert (out_y[:, t + 1 :] - out_x[:, t + 1 :]).abs().max() > 1e-2
    noncausal = SelfAttention(16, 2).double()
    noncausal.load_state_dict(attn.state_dict())
    assert (noncausal(y)[:, :t] - noncausal(x)[:, :t]).abs().max() > 1e-2


def test_fully_masked_rows_are_finite() -> None:
    attn = randomize(SelfAttention(16, 2, causal=True))
    assert isinstance(attn, SelfAttention)
    x = torch.randn(2, 5, 16, requires_grad=True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0] = True  # sample 0 is all padding
    out = attn(x, mask=kpm)
    assert torch.isfinite(out).all()
    assert attn.proj.bias is not None
    assert_close(out[0], attn.proj.bias.expand(5, -1))  # attention output 0 -> proj bias
    assert_close(out[1], attn(x[1:]).squeeze(0))
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())

    cross = randomize(CrossAttention(16, 2, memory_dim=8))
    assert isinstance(cross, CrossAttention)
    mpm = torch.zeros(2, 3, dtype=torch.bool)
    mpm[1] = True
    memory = torch.randn(2, 3, 8)
    out = cross(x, memory=memory, memory_mask=mpm)
    assert torch.isfinite(out).all()
    assert_close(out[1], cross.proj.bias.expand(5, -1))
    assert_close(out[0], cross(x[:1], memory=memory[:1]).squeeze(0))


def test_cross_kv_cache_reuses_memory_projection() -> None:
    cross = randomize(CrossAttention(16, 4, memory_dim=12, num_kv_heads=2, qk_norm="rmsnorm"))
    assert isinstance(cross, CrossAttention)
    calls: list[int] = []
    cross.kv.register_forward_hook(lambda *_: calls.append(1))
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 12)
    reference = cross(x, memory=memory)
    cache = KVCache()
    first = cross(x, memory=memory, cache=cache)
    assert cache.memory[0][0].shape == (2, 2, 5, 4)
    second = cross(x[:, :1], memory=torch.zeros_like(memory), cache=cache)  # memory ignored once cached
    assert len(calls) == 2  # reference + first; the cached call did not project
    assert_close(first, reference)
    assert_close(second, reference[:, :1])


def test_attention_dropout_only_in_training() -> None:
    attn = randomize(SelfAttention(16, 2, attn_drop=0.5))
    plain = SelfAttention(16, 2)
    plain.load_state_dict(attn.state_dict())
    x = torch.randn(2, 6, 16)
    assert_close(attn.eval()(x), plain(x))
    assert (attn.train()(x) - plain(x)).abs().max() > 1e-3


def test_attention_shape_errors() -> None:
    with pytest.raises(ValueError, match="multiple"):
        SelfAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="divisible"):
        SelfAttention(30, 4)
    assert SelfAttention(30, 4, head_dim=8).qkv.weight.shape == (96, 30)
    with pytest.raises(ValueError, match="mask must have shape"):
        SelfAttention(16, 2)(torch.randn(2, 5, 16), mask=torch.zeros(2, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------- heads


def test_pool() -> None:
    x = torch.randn(3, 6, 8)
    assert torch.equal(cls_pool(x), x[:, 0])
    assert_close(mean_pool(x, 2), x[:, 2:].mean(dim=1))
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    kpm[2, 2:] = True  # only prefix tokens left
    out = mean_pool(x, 2, kpm)
    assert_close(out[0], x[0, 2:].mean(dim=0))
    assert_close(out[1], x[1, 2:4].mean(dim=0))
    assert torch.equal(out[2], torch.zeros(8))


# ------------------------------------------------------------------------------- FLOPs, meta, dtypes


def count_flops(fn: object) -> int:
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:  # CPU's fused SDPA kernel is not counted by FlopCounterMode
        fn()  # type: ignore[operator]
    return counter.get_total_flops()


def test_flops_are_only_the_real_matmuls() -> None:
    b, n, d, h, hkv, hd = 2, 6, 32, 4, 2, 8
    attn = SelfAttention(d, h, num_kv_heads=hkv, qk_norm="rmsnorm", causal=True)
    x = torch.randn(b, n, d)
    kpm = torch.zeros(b, n, dtype=torch.bool)
    kpm[1, 5] = True
    expected = 2 * b * n * d * (h + 2 * hkv) * hd + 4 * b * h * n * n * hd + 2 * b * n * h * hd * d
    assert count_flops(lambda: attn(x, rope=rope_tables(torch.arange(n), hd, 10000.0))) == expected
    assert count_flops(lambda: attn(x, mask=kpm)) == expected

    m, dm = 5, 12
    cross = CrossAttention(d, h, memory_dim=dm, num_kv_heads=hkv)
    memory = torch.randn(b, m, dm)
    expected = (
        2 * b * n * d * h * hd
        + 2 * b * m * dm * 2 * hkv * hd
        + 4 * b * h * n * m * hd
        + 2 * b * n * h * hd * d
    )
    assert count_flops(lambda: cross(x, memory=memory)) == expected

    assert count_flops(lambda: Mlp(d, 64, "gelu")(x)) == 2 * 2 * b * n * d * 64
    assert count_flops(lambda: GluMlp(d, 64, "swiglu")(x)) == 2 * b * n * d * 128 + 2 * b * n * 64 * d
    img = torch.randn(b, 3, 8, 8)
    for projection in ("conv", "linear"):
        patch = PatchEmbed((8, 8), (4, 4), 3, d, projection=projection)
        assert count_flops(lambda: patch(img)) == 2 * b * 4 * 3 * 16 * d  # noqa: B023

    def tables() -> None:
        SinCosPosition(d)(x, offset=3)
        SinCos2dPosition(d, (2, 3))(x)
        apply_rope(x[:, None], *Rope2d(d, (2, 3))(x))
        apply_rope(x[:, None], *Rope(d)(x))

    assert count_flops(tables) == 0


def test_meta_build_then_to_empty_and_reset() -> None:
    modules: list[tuple[nn.Module, tuple[Any, ...]]] = [
        (SelfAttention(16, 4, num_kv_heads=2, qk_norm="layernorm", device="meta"), (torch.randn(2, 5, 16),)),
        (
            CrossAttention(16, 2, memory_dim=8, qk_norm="rmsnorm", device="meta"),
            (torch.randn(2, 5, 16), {"memory": torch.randn(2, 3, 8)}),
        ),
        (GluMlp(16, 32, device="meta"), (torch.randn(2, 5, 16),)),
        (Mlp(16, 32, device="meta"), (torch.randn(2, 5, 16),)),
        (PatchEmbed((8, 8), (4, 4), 3, 16, device="meta"), (torch.randn(2, 3, 8, 8),)),
        (PrefixTokens(16, cls=True, registers=2, device="meta"), (torch.randn(2, 5, 16),)),
        (LearnedPosition(10, 16, device="meta"), (torch.randn(2, 5, 16),)),
        (LayerScale(16, 0.5, device="meta"), (torch.randn(2, 5, 16),)),
        (TokenEmbed(20, 16, padding_idx=1, device="meta"), (torch.tensor([[1, 2, 3]]),)),
    ]
    for module, inputs in modules:
        assert all(p.is_meta for p in module.parameters())
        module.to_empty(device="cpu")
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if reset is not None:
                reset()
        assert all(torch.isfinite(p).all() for p in module.parameters())
        args = [i for i in inputs if not isinstance(i, dict)]
        kwargs = next((i for i in inputs if isinstance(i, dict)), {})
        assert torch.isfinite(module(*args, **kwargs)).all()
    layer_scale = modules[7][0]
    assert isinstance(layer_scale, LayerScale)
    assert torch.equal(layer_scale.gamma.detach(), torch.full((16,), 0.5))


def test_dtype_factory_kwargs() -> None:
    attn = SelfAttention(16, 2, qk_norm="rmsnorm", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in attn.parameters())
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    assert attn(x, rope=Rope(8)(x)).dtype == torch.float64
    assert LearnedPosition(4, 16, dtype=torch.float64).weight.dtype == torch.float64
    assert PrefixTokens(16, True, 1, dtype=torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16
