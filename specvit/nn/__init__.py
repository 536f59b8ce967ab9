"""PyTorch building blocks of specvit models (no dependency on ``specvit.spec`` or ``specvit.graph``)."""

from specvit.nn.attention import CrossAttention, CrossKVCache, KVCache, SelfAttention
from specvit.nn.embed import PatchEmbed, PrefixTokens, QueryEmbed, TokenEmbed
from specvit.nn.heads import BoxMlp, Pool
from specvit.nn.layers import DropPath, LayerScale
from specvit.nn.mlp import GluMlp, Mlp, build_mlp
from specvit.nn.position import (
    LearnedPosition,
    Rope,
    Rope2d,
    SinCos2dPosition,
    SinCosPosition,
    Sine2dPosition,
    apply_rope,
    sincos_1d,
    sincos_2d,
    sine_2d,
)

__all__ = [
    "BoxMlp",
    "CrossAttention",
    "CrossKVCache",
    "DropPath",
    "GluMlp",
    "KVCache",
    "LayerScale",
    "LearnedPosition",
    "Mlp",
    "PatchEmbed",
    "Pool",
    "PrefixTokens",
    "QueryEmbed",
    "Rope",
    "Rope2d",
    "SelfAttention",
    "SinCos2dPosition",
    "SinCosPosition",
    "Sine2dPosition",
    "TokenEmbed",
    "apply_rope",
    "build_mlp",
    "sincos_1d",
    "sincos_2d",
    "sine_2d",
]
