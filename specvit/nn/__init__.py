"""PyTorch building blocks of specvit models (no dependency on ``specvit.spec``, ``specvit.ops`` or
``specvit.graph``): each forward takes its main input positionally and everything else by keyword."""

from specvit.nn.attention import Attention, CrossAttention, KVCache, SelfAttention
from specvit.nn.embed import PatchEmbed, PrefixTokens, QueryEmbed, TokenEmbed, TypeEmbed
from specvit.nn.functional import cls_pool, extend_mask, mean_pool, merge_2x2
from specvit.nn.heads import BoxMlp
from specvit.nn.layers import DropPath, LayerScale, Shared, TiedLinear
from specvit.nn.mlp import GluMlp, Mlp, build_mlp
from specvit.nn.position import (
    LearnedPosition,
    Rope,
    SinCos2dPosition,
    SinCosPosition,
    Sine2dPosition,
    apply_rope,
    rope_tables,
    sincos_1d,
    sincos_1d_concat,
    sincos_2d,
    sine_2d,
)
from specvit.nn.rope2d import Rope2d, RopeMixed
from specvit.nn.window import WindowAttention

__all__ = [
    "Attention",
    "BoxMlp",
    "CrossAttention",
    "DropPath",
    "GluMlp",
    "KVCache",
    "LayerScale",
    "LearnedPosition",
    "Mlp",
    "PatchEmbed",
    "PrefixTokens",
    "QueryEmbed",
    "Rope",
    "Rope2d",
    "RopeMixed",
    "SelfAttention",
    "Shared",
    "SinCos2dPosition",
    "SinCosPosition",
    "Sine2dPosition",
    "TiedLinear",
    "TokenEmbed",
    "TypeEmbed",
    "WindowAttention",
    "apply_rope",
    "build_mlp",
    "cls_pool",
    "extend_mask",
    "mean_pool",
    "merge_2x2",
    "rope_tables",
    "sincos_1d",
    "sincos_1d_concat",
    "sincos_2d",
    "sine_2d",
]
