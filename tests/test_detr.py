"""DETR (Carion et al., 2020): learned queries, 2D sine positions in every attention layer, per-query heads.

The reference below follows DETR's transformer.py (post-norm ``forward_post`` layers over
nn.MultiheadAttention: q = k = x + pos, v = x; queries start from zeros with the query embeddings as
their positions; memory keys get the encoder's positions) and models.detr (class_embed, 3-layer
bbox MLP with a sigmoid), written out here so that specvit's model is checked against DETR's data flow.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import specvit
from specvit.nn.position import sine_2d

ROOT = Path(__file__).resolve().parents[1]
DETR = ROOT / "specs" / "detr_resnet50.yaml"


def detr_position_embedding_sine(mask: Tensor, num_pos_feats: int, temperature: float = 10000.0) -> Tensor:
    """DETR's PositionEmbeddingSine(normalize=True) on a (B, H, W) padding mask -> (B, 2*num_pos_feats, H, W)."""
    not_mask = ~mask
    y_embed = not_mask.cumsum(1, dtype=torch.float32)
    x_embed = not_mask.cumsum(2, dtype=torch.float32)
    eps, scale = 1e-6, 2 * math.pi
    y_embed = y_embed / (y_embed[:, -1:, :] + eps) * scale
    x_embed = x_embed / (x_embed[:, :, -1:] + eps) * scale
    dim_t = torch.arange(num_pos_feats, dtype=torch.float32)
    dim_t = temperature ** (2 * (dim_t // 2) / num_pos_feats)
    pos_x = x_embed[:, :, :, None] / dim_t
    pos_y = y_embed[:, :, :, None] / dim_t
    pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
    pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
    return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


def test_sine2d_equals_detr_position_embedding() -> None:
    ours = sine_2d(5, 7, 64)  # (35, 64), row-major
    theirs = detr_position_embedding_sine(torch.zeros(1, 5, 7, dtype=torch.bool), 32)[0]  # (64, 5, 7)
    assert torch.equal(ours, theirs.flatten(1).t())  # the same float32 operations, in the same order


def _small() -> specvit.Spec:
    return specvit.load_spec(
        DETR,
        overrides={
            "encoder.input.dim": 24,
            "encoder.input.grid": [3, 4],
            "encoder.width": 32,
            "encoder.depth": 2,
            "encoder.block.heads": 4,
            "encoder.block.mlp.hidden": 48,
            "decoder.input.count": 5,
            "decoder.width": 32,
            "decoder.depth": 2,
            "decoder.block.heads": 4,
            "decoder.block.mlp.hidden": 48,
            "head.classes": 6,
        },
    )


class _EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.linear1, self.linear2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, src: Tensor, pos: Tensor) -> Tensor:
        q = k = src + pos
        src = self.norm1(src + self.self_attn(q, k, value=src)[0])
        return self.norm2(src + self.linear2(F.relu(self.linear1(src))))


class _DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.multihead_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.linear1, self.linear2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, tgt: Tensor, memory: Tensor, pos: Tensor, query_pos: Tensor) -> Tensor:
        q = k = tgt + query_pos
        tgt = self.norm1(tgt + self.self_attn(q, k, value=tgt)[0])
        tgt = self.norm2(tgt + self.multihead_attn(tgt + query_pos, memory + pos, value=memory)[0])
        return self.norm3(tgt + self.linear2(F.relu(self.linear1(tgt))))


def test_matches_detr_data_flow() -> None:
    spec = _small()
    torch.manual_seed(0)
    model = specvit.build_model(spec).eval()
    d, heads, ff, classes = 32, 4, 48, 6
    enc = nn.ModuleList(_EncoderLayer(d, heads, ff) for _ in range(2))
    dec = nn.ModuleList(_DecoderLayer(d, heads, ff) for _ in range(2))
    sd = model.state_dict()
    with torch.no_grad():
        for stack, layers in (("encoder", enc), ("decoder", dec)):
            for i, layer in enumerate(layers):
                p = f"{stack}.blocks.{i}."
                layer.self_attn.in_proj_weight.copy_(sd[p + "attn.qkv.weight"])
                layer.self_attn.in_proj_bias.copy_(sd[p + "attn.qkv.bias"])
                layer.self_attn.out_proj.weight.copy_(sd[p + "attn.proj.weight"])
                layer.self_attn.out_proj.bias.copy_(sd[p + "attn.proj.bias"])
                if stack == "decoder":
                    cross = layer.multihead_attn
                    cross.in_proj_weight.copy_(
                        torch.cat((sd[p + "cross_attn.q.weight"], sd[p + "cross_attn.kv.weight"]))
                    )
                    cross.in_proj_bias.copy_(
                        torch.cat((sd[p + "cross_attn.q.bias"], sd[p + "cross_attn.kv.bias"]))
                    )
                    cross.out_proj.weight.copy_(sd[p + "cross_attn.proj.weight"])
                    cross.out_proj.bias.copy_(sd[p + "cross_attn.proj.bias"])
                for k in ("norm1", "norm2", "norm3"):
                    if hasattr(layer, k) and p + k + ".weight" in sd:
                        getattr(layer, k).weight.copy_(sd[p + k + ".weight"])
                        getattr(layer, k).bias.copy_(sd[p + k + ".bias"])
                layer.linear1.weight.copy_(sd[p + "mlp.fc1.weight"])
                layer.linear1.bias.copy_(sd[p + "mlp.fc1.bias"])
                layer.linear2.weight.copy_(sd[p + "mlp.fc2.weight"])
                layer.linear2.bias.copy_(sd[p + "mlp.fc2.bias"])
    enc.eval()
    dec.eval()
    features = torch.randn(2, 12, 24)  # a 3 x 4 map of 24-channel backbone features, flattened row-major
    with torch.no_grad():
        src = F.linear(features, sd["encoder.feat_proj.weight"], sd["encoder.feat_proj.bias"])  # input_proj
        pos = (
            detr_position_embedding_sine(torch.zeros(2, 3, 4, dtype=torch.bool), d // 2)
            .flatten(2)
            .transpose(1, 2)
        )
        memory = src
        for layer in enc:
            memory = layer(memory, pos)
        query_pos = sd["decoder.query_embed.weight"][None].repeat(2, 1, 1)
        tgt = torch.zeros_like(query_pos)
        for layer in dec:
            tgt = layer(tgt, memory, pos, query_pos)
        hs = F.layer_norm(tgt, (d,), sd["decoder.norm.weight"], sd["decoder.norm.bias"], 1e-5)
        logits = F.linear(hs, sd["head.class_embed.weight"], sd["head.class_embed.bias"])
        boxes = F.relu(
            F.linear(hs, sd["head.bbox_embed.layers.0.weight"], sd["head.bbox_embed.layers.0.bias"])
        )
        boxes = F.relu(
            F.linear(boxes, sd["head.bbox_embed.layers.1.weight"], sd["head.bbox_embed.layers.1.bias"])
        )
        boxes = F.linear(
            boxes, sd["head.bbox_embed.layers.2.weight"], sd["head.bbox_embed.layers.2.bias"]
        ).sigmoid()
        ours = model(features)
    assert ours["logits"].shape == (2, 5, classes + 1) and ours["boxes"].shape == (2, 5, 4)
    # fp32 parity, the same maths in another order: 1.2e-6 seen (1.4e-6 with two threads) on logits near 2.3
    torch.testing.assert_close(ours["logits"], logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours["boxes"], boxes, atol=1e-5, rtol=0)


def test_preset_parameters_and_shapes() -> None:
    graph = specvit.build_graph(specvit.load_spec(DETR), batch=2)
    d, ff, layers = 256, 2048, 6
    attention = 4 * d * d + 4 * d
    mlp = d * ff + ff + ff * d + d
    encoder = layers * (attention + mlp + 2 * 2 * d)
    decoder = layers * (2 * attention + mlp + 3 * 2 * d) + 2 * d
    heads = (d + 1) * 92 + 2 * (d * d + d) + 4 * d + 4
    expected = (2048 * d + d) + 100 * d + encoder + decoder + heads
    assert graph.total_params == expected == 18_069_856
    assert graph["encoder.input"]["shape"] == ("B", 850, 2048)
    assert graph["head.class_embed"]["shape"] == ("B", 100, 92)
    assert graph["head.bbox_embed"]["shape"] == ("B", 100, 4)
    pos_edges = {(u, p) for u, v, p in graph.nx.edges(data="port") if p in ("pos", "memory_pos")}
    assert pos_edges == {
        ("encoder.pos_embed", "pos"),
        ("encoder.pos_embed", "memory_pos"),
        ("decoder.query_embed", "pos"),
    }


def test_diagram_shows_queries_and_positions() -> None:
    from specvit.diagram import to_dot

    dot = to_dot(specvit.build_graph(specvit.load_spec(DETR)))
    for text in ("decoder.query_embed", "encoder.pos_embed", "head.class_embed", "head.bbox_embed"):
        assert text in dot
