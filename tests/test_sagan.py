"""SAGAN (Zhang et al., 2019): self-attention over a (B, C, H, W) feature map, scaled by a learned gamma.

Two references: the paper's equations (Sec. 3) written with explicit sums in float64, and the layer of
the widely used PyTorch implementation (heykeetae/Self-Attention-GAN, sagan_models.Self_Attn), written
out here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from reference import perturbed
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import specvit
from specvit.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "specs" / "sagan_attn1_64.yaml"


def sagan_equations(x: Tensor, sd: dict[str, Tensor], at: str) -> Tensor:
    """y = gamma * o + x, from the paper: f(x) = W_f x, g(x) = W_g x, h(x) = W_h x (1x1 convs),
    s_ij = f(x_i)^T g(x_j), beta_ji = exp(s_ij) / sum_i exp(s_ij), o_j = sum_i beta_ji h(x_i)."""
    b, c, hh, ww = x.shape
    xs = x.reshape(b, c, hh * ww)  # (B, C, N): x_i is column i

    def conv1x1(name: str) -> Tensor:
        w, bias = sd[f"{at}.{name}.weight"][:, :, 0, 0], sd[f"{at}.{name}.bias"]
        return torch.einsum("oc,bcn->bon", w, xs) + bias[None, :, None]

    f, g, h = conv1x1("key"), conv1x1("query"), conv1x1("value")
    s = torch.einsum("bki,bkj->bij", f, g)  # s[b, i, j] = f(x_i) . g(x_j)
    beta = torch.exp(s - s.amax(dim=1, keepdim=True))
    beta = beta / beta.sum(dim=1, keepdim=True)  # normalised over i, for each j
    o = torch.einsum("bij,bci->bcj", beta, h)  # o_j = sum_i beta_ji h(x_i)
    return sd[f"{at}.gamma"] * o.reshape(b, c, hh, ww) + x


class Self_Attn(nn.Module):  # the reference's name
    """heykeetae/Self-Attention-GAN's Self_Attn layer (its attention map output dropped)."""

    def __init__(self, in_dim: int) -> None:
        super().__init__()
        self.query_conv = nn.Conv2d(in_dim, in_dim // 8, kernel_size=1)
        self.key_conv = nn.Conv2d(in_dim, in_dim // 8, kernel_size=1)
        self.value_conv = nn.Conv2d(in_dim, in_dim, kernel_size=1)
        self.gamma = nn.Parameter(torch.zeros(1))
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        m_batchsize, C, width, height = x.size()
        proj_query = self.query_conv(x).view(m_batchsize, -1, width * height).permute(0, 2, 1)
        proj_key = self.key_conv(x).view(m_batchsize, -1, width * height)
        energy = torch.bmm(proj_query, proj_key)
        attention = self.softmax(energy)
        proj_value = self.value_conv(x).view(m_batchsize, -1, width * height)
        out = torch.bmm(proj_value, attention.permute(0, 2, 1))
        out = out.view(m_batchsize, C, width, height)
        return self.gamma * out + x


def _small(**overrides: Any) -> specvit.Spec:
    base = {"encoder.input.channels": 32, "encoder.input.size": [5, 7], "encoder.width": 32}
    return specvit.load_spec(PRESET, overrides={**base, **overrides})


def test_identity_at_init_and_the_papers_equations_after_moving_gamma() -> None:
    torch.manual_seed(0)
    model = specvit.build_model(_small()).double().eval()
    attn = model.encoder.blocks[0].attn
    assert attn.gamma.item() == 0.0
    x = torch.randn(2, 32, 5, 7, dtype=torch.float64)
    assert torch.equal(model(x), x)  # gamma = 0: the block starts as the identity
    at = "encoder.blocks.0.attn"
    assert (model(x) - sagan_equations(x, model.state_dict(), at)).abs().max().item() < 1e-12
    perturbed(model, seed=3)  # every weight, gamma too, moved off its init
    assert abs(attn.gamma.item()) > 1e-3
    y = model(x)
    assert y.shape == (2, 32, 5, 7)
    assert (y - x).abs().max().item() > 1e-3
    assert (y - sagan_equations(x, model.state_dict(), at)).abs().max().item() < 1e-12


def test_matches_the_widely_used_implementation() -> None:
    torch.manual_seed(0)
    ref = perturbed(Self_Attn(128), seed=4)
    model = specvit.build_model(PRESET).eval()
    mapping = {"query_conv": "query", "key_conv": "key", "value_conv": "value"}
    sd = {}
    for k, v in ref.state_dict().items():
        head, _, rest = k.partition(".")
        sd["encoder.blocks.0.attn." + (f"{mapping[head]}.{rest}" if rest else head)] = v
    model.load_state_dict(sd, strict=True)
    x = torch.randn(2, 128, 16, 16)
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max().item() <= 1e-5


def test_preset_parameters_and_flops() -> None:
    graph = specvit.build_graph(specvit.load_spec(PRESET), batch=2)
    c, qk, n = 128, 16, 256
    assert graph.total_params == 2 * (c * qk + qk) + c * c + c + 1 == 20_641
    assert graph.total_params == sum(p.numel() for p in Self_Attn(128).parameters())
    expected = 2 * 2 * n * c * (2 * qk + c) + 2 * 2 * n * n * qk + 2 * 2 * c * n * n
    assert graph["encoder.blocks.0.attn"]["flops"] == graph.total_flops == expected
    with FlopCounterMode(display=False) as counter:
        Self_Attn(128)(torch.randn(2, 128, 16, 16))
    assert counter.get_total_flops() == expected
    assert [graph[n]["shape"] for n in graph] == [("B", 128, 16, 16)] * 4


def test_diagram_shows_the_feature_map_and_gamma() -> None:
    from specvit.diagram import to_dot

    dot = to_dot(specvit.build_graph(specvit.load_spec(PRESET)))
    for text in (
        "feature map 128x16x16",
        "q/k 128→16 · v 128→128",
        "gamma (init 0)",
        "B x 128 x 16 x 16 · 20.6K params",
    ):
        assert text in dot, text


def test_head_dim_sets_the_query_and_key_channels() -> None:
    graph = specvit.build_graph(_small(**{"encoder.block.head_dim": 8}))
    assert graph["encoder.blocks.0.attn"]["p"].qk_channels == 8
    assert graph["encoder.blocks.0.attn"]["params"] == 32 * (2 * 8 + 32) + (2 * 8 + 32) + 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"encoder.width": 64}, "encoder.width: a feature map of 128 channels is 128 wide"),
        ({"encoder.final_norm": True}, "encoder.final_norm: a feature map has no token positions"),
        ({"encoder.position": "learned"}, "encoder.position: a feature map has no token positions"),
        ({"encoder.block.heads": 2}, "encoder.block.heads: SAGAN's attention has one head"),
        (
            {"encoder.block.graph": [{"name": "n", "op": "norm", "inputs": ["x"]}]},
            "encoder.block.graph.0.op: norm acts on tokens, not on a feature map",
        ),
        (
            {"encoder.block.graph": None, "encoder.block.layers": ["sagan_attention"]},
            "encoder.block.layers: a feature map's block is written as a graph (no norms)",
        ),
        (
            {"encoder.input": {"kind": "features", "dim": 128}},
            "encoder.block.graph.0.op: sagan_attention attends among the positions of a (B, C, H, W) feature map",
        ),
    ],
)
def test_misuse_is_refused_with_a_fix(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError) as info:
        specvit.load_spec(PRESET, overrides=overrides)
    assert message in str(info.value)
