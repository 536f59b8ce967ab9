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


# --- SAGAN as a configuration of the one attention core ---------------------------------------------------

FIXTURES = ROOT / "tests" / "fixtures"
AT = "encoder.blocks.0.attn"

PRE_CORE_KEYS = {  # the preset's state dict as specvit.nn.sagan.SaganAttention (before the core) wrote it
    f"{AT}.gamma": (1,),
    f"{AT}.query.weight": (16, 128, 1, 1),
    f"{AT}.query.bias": (16,),
    f"{AT}.key.weight": (16, 128, 1, 1),
    f"{AT}.key.bias": (16,),
    f"{AT}.value.weight": (128, 128, 1, 1),
    f"{AT}.value.bias": (128,),
}


def _heykeetae(sd: dict[str, Tensor], channels: int) -> Self_Attn:
    """The reference layer in float64 holding the SAGAN weights of ``sd`` (specvit's keys)."""
    names = {"query": "query_conv", "key": "key_conv", "value": "value_conv", "gamma": "gamma"}
    ref = Self_Attn(channels).double().eval()
    weights = {}
    for k, v in sd.items():
        head, _, tail = k.removeprefix(f"{AT}.").partition(".")
        weights[names[head] + (f".{tail}" if tail else "")] = v
    ref.load_state_dict(weights, strict=True)
    return ref


def test_the_layer_is_the_attention_core_with_the_pre_core_state_dict() -> None:
    from specvit.nn.attention import Attention

    model = specvit.build_model(PRESET)
    assert type(model.encoder.blocks[0].attn) is Attention
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == PRE_CORE_KEYS
    graph = specvit.build_graph(specvit.load_spec(PRESET))
    assert graph[AT]["op"] == "sagan_attention"
    assert type(graph.op(AT)).__qualname__ == "Attention"


def test_a_checkpoint_saved_before_the_core_loads_and_computes_the_same() -> None:
    """tests/fixtures/sagan_pre_core: ``save_pretrained`` of a model built with specvit.nn.sagan's layer
    (specvit d2a6f80), and that code's float64 output on a fixed input (tests/fixtures/README.md)."""
    from safetensors.torch import load_file

    model = specvit.load_pretrained(FIXTURES / "sagan_pre_core").double()  # strict: keys, shapes, dtypes
    io = load_file(str(FIXTURES / "sagan_pre_core_io.safetensors"))
    x, before = io["input"], io["output"]
    sd = model.state_dict()
    assert abs(sd[f"{AT}.gamma"].item()) > 1e-3  # the gate is open: the attention shows in the output
    with torch.no_grad():
        y = model(x)
        assert (y - x).abs().max().item() > 1e-3
        assert (y - before).abs().max().item() <= 1e-10
        assert (y - sagan_equations(x, sd, AT)).abs().max().item() <= 1e-10
        assert (y - _heykeetae(sd, 32)(x)).abs().max().item() <= 1e-10


def _core_difference(model: nn.Module, x: Tensor, **change: Any) -> float:
    """Max |x + the attention core built from the node's arguments (with ``change``) - the paper's
    equations|, the core holding the model's weights (a part ``change`` adds keeps its init, one it
    removes drops its weight)."""
    from specvit.nn.attention import Attention

    graph = model.graph  # type: ignore[attr-defined]
    layer = Attention(**{**graph.op(AT).ctor(graph[AT]["p"]), **change}).double().eval()
    sd = {k.removeprefix(f"{AT}."): v for k, v in model.state_dict().items()}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert set(missing) <= {"proj.weight", "proj.bias"} and set(unexpected) <= {"gamma"}
    with torch.no_grad():
        return (x + layer(x) - sagan_equations(x, model.state_dict(), AT)).abs().max().item()


def test_the_cores_sagan_configuration_equals_the_paper_and_heykeetae_in_float64() -> None:
    torch.manual_seed(0)
    model = perturbed(specvit.build_model(_small()).double(), seed=5)
    x = torch.randn(2, 32, 5, 7, dtype=torch.float64)
    sd = model.state_dict()
    with torch.no_grad():
        y = model(x)
        assert (y - sagan_equations(x, sd, AT)).abs().max().item() <= 1e-10
        assert (y - _heykeetae(sd, 32)(x)).abs().max().item() <= 1e-10
    assert _core_difference(model, x) <= 1e-10
    # controls: each part of SAGAN's configuration switched the other way fails the same assertion
    for change in ({"output_gate": False}, {"proj": True}, {"scale": None}):
        assert _core_difference(model, x, **change) > 1e-3, change


# --- the parts SAGAN added to the core, in every projection layout ------------------------------------------

PART_CASES = {  # 4 heads of q/k width 3 and value width 5 over 20-wide tokens
    "packed-sdpa-no-proj-gate": {"proj": False, "output_gate": True},
    "packed-sdpa-proj": {},
    "packed-math-gqa-no-proj-gate": {"kv_heads": 2, "softcap": 4.0, "proj": False, "output_gate": True},
    "split-no-proj-gate": {"projection": "split", "proj": False, "output_gate": True},
    "split-gqa-proj-gate": {"projection": "split", "kv_heads": 1, "output_gate": True},
    "cross-no-proj": {"memory_dim": 6, "proj": False},
}


def _part_params(**change: Any) -> Any:
    from specvit.ops.core import AttentionParams

    return AttentionParams(**{"dim": 20, "heads": 4, "kv_heads": 4, "head_dim": 3, "v_head_dim": 5, **change})


def _explicit(layer: nn.Module, x: Tensor, memory: Tensor | None, p: Any, gate: bool = True) -> Tensor:
    """The layer's output written head by head: q_i = x W_q,i, k_j and v_j (of head j = i // (H / Hkv)) from
    x or the memory, softmax(cap * tanh(q_i k_j^T / sqrt(hd) / cap)) v_j, concatenated, then the output
    projection and the gate ``gamma`` if the layer has them (``gate=False``: the gate left out)."""
    sd = layer.state_dict()
    h, hkv, hd, vd = p.heads, p.kv_heads, p.head_dim, p.v_head_dim
    if "qkv.weight" in sd:
        q, k, v = (x @ sd["qkv.weight"].T + sd["qkv.bias"]).split((h * hd, hkv * hd, hkv * vd), -1)
    else:
        q = x @ sd["q.weight"].T + sd["q.bias"]
        if "kv.weight" in sd:
            assert memory is not None
            k, v = (memory @ sd["kv.weight"].T + sd["kv.bias"]).split((hkv * hd, hkv * vd), -1)
        else:
            k, v = x @ sd["k.weight"].T + sd["k.bias"], x @ sd["v.weight"].T + sd["v.bias"]
    heads = []
    for i in range(h):
        j = i // (h // hkv)
        s = q[..., i * hd : (i + 1) * hd] @ k[..., j * hd : (j + 1) * hd].transpose(-1, -2) / hd**0.5
        if p.softcap is not None:
            s = p.softcap * torch.tanh(s / p.softcap)
        heads.append(torch.softmax(s, dim=-1) @ v[..., j * vd : (j + 1) * vd])  # (B, N, vd)
    out = torch.cat(heads, dim=-1)  # (B, N, H * vd)
    if p.proj:
        out = out @ sd["proj.weight"].T + sd["proj.bias"]
    return sd["gamma"] * out if p.output_gate and gate else out


@pytest.mark.parametrize("case", PART_CASES, ids=str)
def test_value_width_output_projection_and_gate_in_every_layout(case: str) -> None:
    """Values wider than queries and keys, no output projection, the output gate: the core's output equals
    the heads written out in float64, for packed, split and memory projections, SDPA and the math path
    (GQA), and its parameters and FLOPs are the op's; control: leaving out the gate fails the same check."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specvit.nn.attention import Attention
    from specvit.ops import OPS

    p = _part_params(**PART_CASES[case])
    op = OPS["self_attention"]
    layer = perturbed(Attention(**op.ctor(p)).double(), seed=6)
    assert ("gamma" in dict(layer.named_parameters())) == p.output_gate
    assert isinstance(layer.proj, nn.Linear) == p.proj
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 20, dtype=torch.float64, generator=gen)
    memory = torch.randn(2, 9, 6, dtype=torch.float64, generator=gen) if p.memory_dim else None
    kwargs = {"memory": memory} if memory is not None else {}
    with torch.no_grad():
        y = layer(x, **kwargs)
        assert y.shape == (2, 7, 20)
        assert (y - _explicit(layer, x, memory, p)).abs().max().item() <= 1e-10
        if p.output_gate:  # control
            assert (y - _explicit(layer, x, memory, p, gate=False)).abs().max().item() > 1e-3
    assert op.params(p) == sum(t.numel() for t in layer.parameters())
    inputs = {"x": (2, 7, 20), **({"memory": (2, 9, 6)} if memory is not None else {})}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        layer(x, **kwargs)
    assert op.flops(p, inputs) == counter.get_total_flops()


def test_ejected_layers_keep_the_map_parts_only_where_used() -> None:
    def attention(text: str) -> str:
        start = text.index("\nclass Attention")
        return text[start : text.index("\nclass ", start + 1)]

    sagan = attention(specvit.eject(PRESET))
    for kept in ("b, _, _ = to_tokens(x).shape", "self.gamma * out", "to_map(out", "self.query"):
        assert kept in sagan, kept
    vit = attention(specvit.eject(ROOT / "specs" / "vit_tiny_patch16_224.yaml"))
    assert "b, n, _ = x.shape\n" in vit  # the plain attention of a token sequence
    for gone in ("to_tokens(", "to_map(", "gamma *", "self.query", "nn.Conv2d("):
        assert gone not in vit, gone
