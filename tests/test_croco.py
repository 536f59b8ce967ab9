"""CroCo (Weinzaepfel et al., 2022): a siamese RoPE2D ViT encoder and a decoder cross-attending between views.

The reference below follows naver/croco's models/croco.py, models/blocks.py and models/pos_embed.py
(RoPE2D over (y, x) patch positions, applied to q and k of every attention; DecoderBlock:
x = x + attn(norm1(x), xpos); y_ = norm_y(y); x = x + cross_attn(norm2(x), y_, y_, xpos, ypos);
x = x + mlp(norm3(x)); decoder_embed on both encoder outputs; dec_norm; a linear prediction head),
written out here in plain torch so that specvit's model is checked against CroCo's data flow. Masking
(pre-training only) is left out: every patch of both views is encoded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import specvit
from specvit.errors import SpecError
from specvit.ops.rope import RopeParams

ROOT = Path(__file__).resolve().parents[1]
CROCO = ROOT / "specs" / "croco_vit_base.yaml"

# small dims: a 32 x 48 image in 8 x 8 patches is a 4 x 6 grid (not square, so rows and columns differ)
SMALL = {
    "encoder.input.size": [32, 48],
    "encoder.input.patch": 8,
    "encoder.width": 32,
    "encoder.depth": 2,
    "encoder.block.heads": 2,
    "decoder.width": 24,
    "decoder.depth": 2,
    "decoder.block.heads": 2,
}


class RoPE2D(nn.Module):
    """CroCo's RoPE2D: the first half of each head rotated by the row, the second by the column."""

    def __init__(self, freq: float = 100.0):
        super().__init__()
        self.base = freq

    def _cos_sin(self, d: int, seq_len: int) -> tuple[Tensor, Tensor]:
        inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.einsum("i,j->ij", torch.arange(seq_len, dtype=inv_freq.dtype), inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos(), freqs.sin()

    @staticmethod
    def _rotate_half(x: Tensor) -> Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def _rope1d(self, tokens: Tensor, pos1d: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        cos = F.embedding(pos1d, cos)[:, None, :, :]
        sin = F.embedding(pos1d, sin)[:, None, :, :]
        return tokens * cos + self._rotate_half(tokens) * sin

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens (B, H, N, hd); positions (B, N, 2) as (y, x)."""
        d = tokens.size(3) // 2
        cos, sin = self._cos_sin(d, int(positions.max()) + 1)
        y, x = tokens.chunk(2, dim=-1)
        y = self._rope1d(y, positions[:, :, 0], cos, sin)
        x = self._rope1d(x, positions[:, :, 1], cos, sin)
        return torch.cat((y, x), dim=-1)


def _positions(b: int, h: int, w: int) -> Tensor:
    """CroCo's PositionGetter: (B, h*w, 2) (y, x) per patch, row-major."""
    return torch.cartesian_prod(torch.arange(h), torch.arange(w)).view(1, h * w, 2).expand(b, -1, 2)


class Attention(nn.Module):
    def __init__(self, dim: int, rope: RoPE2D, heads: int):
        super().__init__()
        self.heads, self.rope = heads, rope
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor, xpos: Tensor) -> Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).transpose(1, 3)
        q, k, v = (qkv[:, :, i] for i in range(3))
        q, k = self.rope(q, xpos), self.rope(k, xpos)
        attn = ((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class CrossAttention(nn.Module):
    def __init__(self, dim: int, rope: RoPE2D, heads: int):
        super().__init__()
        self.heads, self.rope = heads, rope
        self.projq, self.projk, self.projv = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, qpos: Tensor, kpos: Tensor) -> Tensor:
        b, nq, c = query.shape
        nk, h = key.shape[1], self.heads
        q = self.projq(query).reshape(b, nq, h, c // h).permute(0, 2, 1, 3)
        k = self.projk(key).reshape(b, nk, h, c // h).permute(0, 2, 1, 3)
        v = self.projv(value).reshape(b, nk, h, c // h).permute(0, 2, 1, 3)
        q, k = self.rope(q, qpos), self.rope(k, kpos)
        attn = ((q @ k.transpose(-2, -1)) * (c // h) ** -0.5).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, nq, c))


class Mlp(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, rope: RoPE2D):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn, self.mlp = Attention(dim, rope, heads), Mlp(dim)

    def forward(self, x: Tensor, xpos: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), xpos)
        return x + self.mlp(self.norm2(x))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, rope: RoPE2D):
        super().__init__()
        self.norm1, self.norm2, self.norm3, self.norm_y = (nn.LayerNorm(dim, eps=1e-6) for _ in range(4))
        self.attn, self.cross_attn, self.mlp = (
            Attention(dim, rope, heads),
            CrossAttention(dim, rope, heads),
            Mlp(dim),
        )

    def forward(self, x: Tensor, y: Tensor, xpos: Tensor, ypos: Tensor) -> tuple[Tensor, Tensor]:
        x = x + self.attn(self.norm1(x), xpos)
        y_ = self.norm_y(y)
        x = x + self.cross_attn(self.norm2(x), y_, y_, xpos, ypos)
        return x + self.mlp(self.norm3(x)), y


class CroCo(nn.Module):
    """CroCoNet's forward without masking: predictions (B, N, p*p*3) for img1's patches."""

    def __init__(self, enc: int, dec: int, heads: tuple[int, int], depth: tuple[int, int], patch: int):
        super().__init__()
        self.patch = patch
        self.rope = RoPE2D(100.0)
        self.patch_embed = nn.Conv2d(3, enc, patch, patch)
        self.enc_blocks = nn.ModuleList(Block(enc, heads[0], self.rope) for _ in range(depth[0]))
        self.enc_norm = nn.LayerNorm(enc, eps=1e-6)
        self.decoder_embed = nn.Linear(enc, dec)
        self.dec_blocks = nn.ModuleList(DecoderBlock(dec, heads[1], self.rope) for _ in range(depth[1]))
        self.dec_norm = nn.LayerNorm(dec, eps=1e-6)
        self.prediction_head = nn.Linear(dec, patch * patch * 3)

    def _encode(self, img: Tensor) -> tuple[Tensor, Tensor]:
        x = self.patch_embed(img)  # (B, D, h, w)
        pos = _positions(img.shape[0], x.shape[2], x.shape[3])
        x = x.flatten(2).transpose(1, 2)  # (B, h*w, D)
        for blk in self.enc_blocks:
            x = blk(x, pos)
        return self.enc_norm(x), pos

    def forward(self, img1: Tensor, img2: Tensor) -> Tensor:
        feat1, pos1 = self._encode(img1)
        feat2, pos2 = self._encode(img2)
        out, out2 = self.decoder_embed(feat1), self.decoder_embed(feat2)
        for blk in self.dec_blocks:
            out, out2 = blk(out, out2, pos1, pos2)
        return self.prediction_head(self.dec_norm(out))


def _copy_from(model: specvit.SpecModel, ref: CroCo) -> None:
    """Load specvit's weights into the reference, by CroCo's names."""
    sd = model.state_dict()

    def put(module: nn.Module, key: str) -> None:
        module.weight.copy_(sd[key + ".weight"])  # type: ignore[operator]
        module.bias.copy_(sd[key + ".bias"])  # type: ignore[operator]

    with torch.no_grad():
        put(ref.patch_embed, "encoder.patch_embed.proj")
        put(ref.enc_norm, "encoder.norm")
        put(ref.decoder_embed, "decoder.embed")
        put(ref.dec_norm, "decoder.norm")
        put(ref.prediction_head, "head.fc")
        for stack, blocks in (("encoder", ref.enc_blocks), ("decoder", ref.dec_blocks)):
            for i, blk in enumerate(blocks):
                p = f"{stack}.blocks.{i}."
                put(blk.attn.qkv, p + "attn.qkv")
                put(blk.attn.proj, p + "attn.proj")
                put(blk.mlp.fc1, p + "mlp.fc1")
                put(blk.mlp.fc2, p + "mlp.fc2")
                put(blk.norm1, p + "norm1")
                put(blk.norm2, p + "norm2")
                if isinstance(blk, DecoderBlock):
                    put(blk.norm3, p + "norm3")
                    put(blk.norm_y, p + "memory_norm")
                    cross = blk.cross_attn
                    put(cross.projq, p + "cross_attn.q")
                    put(cross.proj, p + "cross_attn.proj")
                    w, b = sd[p + "cross_attn.kv.weight"], sd[p + "cross_attn.kv.bias"]
                    half = w.shape[0] // 2  # the packed kv projection: keys first, then values
                    cross.projk.weight.copy_(w[:half])
                    cross.projk.bias.copy_(b[:half])
                    cross.projv.weight.copy_(w[half:])
                    cross.projv.bias.copy_(b[half:])


def _small_model() -> specvit.SpecModel:
    torch.manual_seed(0)
    model = specvit.build_model(specvit.load_spec(CROCO, overrides=SMALL)).eval()
    with torch.no_grad():  # xavier init zeroes the biases and sets the norms to 1, 0: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.1 if name.endswith("bias") else 1.0)
    return model


def test_matches_croco_reference() -> None:
    model = _small_model()
    ref = CroCo(32, 24, (2, 2), (2, 2), 8).eval()
    _copy_from(model, ref)
    img1, img2 = torch.randn(2, 3, 32, 48), torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        theirs = ref(img1, img2)  # predictions for img1's patches, cross-attending to img2
        ours = model(img2, img1)  # src = the memory's image, tgt = the decoder's image
    assert ours.shape == theirs.shape == (2, 24, 8 * 8 * 3)
    assert (ours - theirs).abs().max() < 1e-5  # fp32 parity: 6.6e-7 seen on outputs near 1.5


def test_siamese_encoder_weights_are_shared() -> None:
    model = _small_model()
    graph = model.graph
    names = [name for name, _ in model.named_parameters()]
    assert not any(n.startswith(("decoder.encoder", "decoder.memory_embed")) for n in names)
    assert model.decoder.memory_embed.source is model.decoder.embed  # type: ignore[union-attr]
    encoder = sum(p.numel() for p in model.encoder.parameters())
    assert encoder == sum(a["params"] for _, a in graph.nx.nodes(data=True) if a["stack"] == "encoder")
    assert sum(p.numel() for p in model.parameters()) == graph.total_params
    assert graph["decoder.encoder"]["params"] == 0 and graph["decoder.memory_embed"]["params"] == 0
    assert graph["decoder.encoder"]["flops"] == sum(
        a["flops"] for _, a in graph.nx.nodes(data=True) if a["stack"] == "encoder"
    )
    src, tgt = torch.randn(2, 3, 32, 48), torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        base = model(src, tgt)
        assert (model(src, tgt + 1.0) - base).abs().max() > 1e-3  # the second image (the decoder's)
        assert (model(src + 1.0, tgt) - base).abs().max() > 1e-3  # the first image (the memory's)
        memory = model.decoder.memory_embed(model.encoder(tgt))  # type: ignore[operator]
        torch.testing.assert_close(memory, model.decoder.embed(model.encoder(tgt)), atol=0, rtol=0)  # type: ignore[operator]
    assert base.shape == (2, 24, 8 * 8 * 3)


def test_preset_parameters_and_graph() -> None:
    graph = specvit.build_graph(specvit.load_spec(CROCO), batch=2)
    e, d, p, n = 768, 512, 16, 14 * 14
    norm = lambda w: 2 * w  # noqa: E731  (LayerNorm weight and bias)
    attention = lambda w: 4 * w * w + 4 * w  # noqa: E731  (qkv and output projections)
    mlp = lambda w: 2 * 4 * w * w + 4 * w + w  # noqa: E731  (fc1 w -> 4w, fc2 4w -> w)
    encoder = (3 * p * p * e + e) + 12 * (2 * norm(e) + attention(e) + mlp(e)) + norm(e)
    decoder = (e * d + d) + 8 * (4 * norm(d) + 2 * attention(d) + mlp(d)) + norm(d)
    head = d * p * p * 3 + p * p * 3
    assert graph.total_params == encoder + decoder + head == 120_075_776
    assert graph["decoder.input"]["shape"] == ("B", 3, 224, 224)
    assert graph["decoder.encoder"]["shape"] == ("B", n, e)
    assert graph["decoder.memory_embed"]["shape"] == ("B", n, d)
    assert graph["head.fc"]["shape"] == ("B", n, p * p * 3)
    into_cross = {(u, port) for u, v, port in graph.nx.in_edges("decoder.blocks.3.cross_attn", data="port")}
    assert into_cross == {
        ("decoder.blocks.3.norm2", "x"),
        ("decoder.blocks.3.memory_norm", "memory"),
        ("decoder.rope", "rope"),  # the queries and the memory's keys lie on one patch grid
        ("decoder.rope", "memory_rope"),
    }
    assert graph["decoder.rope"]["p"] == RopeParams(head_dim=32, base=100.0, grid=(14, 14), prefix=0)
    memory_in = [u for u, _ in graph.nx.in_edges("decoder.blocks.3.memory_norm")]
    assert memory_in == ["decoder.memory_embed"]


def test_diagram_shows_the_shared_encoder_and_memory_norm() -> None:
    from specvit.diagram import to_dot

    dot = to_dot(specvit.build_graph(specvit.load_spec(CROCO)))
    for text in (
        "decoder.encoder",
        "the encoder again · shared weights",
        "decoder.memory_embed",
        "shared with decoder.embed",
        "memory_norm",
        "rotary 2D · grid 14x14 · base 100",
    ):
        assert text in dot, text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"encoder.input": {"kind": "siamese"}},
            "encoder.input.kind: a siamese input is the encoder's output",
        ),
        ({"encoder.prefix.cls": True}, "encoder.prefix: a siamese decoder's tokens are the encoder's patch"),
        ({"decoder.position": "learned"}, "decoder.position: a siamese decoder reads positioned encoder"),
        ({"decoder.block.layers": ["self_attention", "mlp"]}, "decoder.block.memory_norm: memory_norm"),
        ({"encoder.depth": [2, 2]}, "decoder.input.kind: a siamese decoder runs the encoder on a second"),
    ],
)
def test_misuse_is_refused_with_a_fix(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError) as info:
        specvit.load_spec(CROCO, overrides=overrides)
    assert message in str(info.value)


def test_patches_head_needs_image_patches() -> None:
    tokens = {"decoder.input": {"kind": "tokens", "vocab": 10}, "decoder.position": "rope"}
    with pytest.raises(SpecError) as info:
        specvit.load_spec(CROCO, overrides=tokens)
    assert "head.kind: a patches head predicts pixels per image patch" in str(info.value)
