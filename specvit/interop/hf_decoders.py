"""Families of the Llama-like decoder layout (:data:`~specvit.interop.hf_llama.LLAMA`), each a table of what
it changes: Qwen2, Qwen3, Gemma, Gemma 2, OLMo, OLMo 2, Phi-3, Starcoder2, Mixtral."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.hf_llama import GATED, LLAMA, head_dim, rope, sliding
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.table import D, F, Only, count, lm, register

__all__: list[str] = []

_LAYER = "layers.{i}."
RES_POST_NAMES = {
    "decoder.blocks.{i}.norm1": _LAYER + "post_attention_layernorm",
    "decoder.blocks.{i}.norm2": _LAYER + "post_feedforward_layernorm",
}
"""HF's names of a block whose norms follow each branch (``placement: res_post``: OLMo 2, EXAONE 4)."""
_LAYERS = r"(?:model\.)?layers\.\d+\."
_NO_BIAS = {
    "decoder.block.qkv_bias": False,
    "decoder.block.proj_bias": False,
    "decoder.block.mlp.bias": False,
}
_LLAMA_ONLY = ("pretraining_tp",)


def _no_dropout(*fields: str) -> tuple[Only, ...]:
    return tuple(Only(f, 0.0, (0.0,), "dropout there has no spec key") for f in fields)


def _qwen_windows() -> dict[str, D]:
    """Qwen's windows: on with ``use_sliding_window``, in the layers from ``max_window_layers`` on."""
    return sliding(
        None,
        lambda c, i: i >= c.get("max_window_layers", 28),
        switch=("use_sliding_window", False),
        fields=("max_window_layers",),
    )


QWEN2 = register(
    LLAMA.but(
        "Qwen2",
        ("qwen2",),
        {
            "decoder.input.vocab": F("vocab_size", 151936),
            "decoder.block.mlp.hidden": F("intermediate_size", 22016),
            **_NO_BIAS,
            "decoder.block.qkv_bias": True,
            **_qwen_windows(),
        },
        drop=_LLAMA_ONLY,
    )
)

QWEN3 = register(
    LLAMA.but(
        "Qwen3",
        ("qwen3",),
        {
            "decoder.input.vocab": F("vocab_size", 151936),
            "decoder.block.mlp.hidden": F("intermediate_size", 22016),
            "decoder.block.head_dim": head_dim(128),
            "decoder.block.mlp.bias": False,
            "decoder.block.qk_norm": "head",
            **_qwen_windows(),
        },
        drop=_LLAMA_ONLY,
    )
)

_GEMMA = {
    "decoder.input.vocab": F("vocab_size", 256000),
    "decoder.input.scale": True,  # the embedding times sqrt(width)
    "decoder.block.norm.unit_offset": True,  # RMSNorm scales by 1 + w
    "decoder.block.mlp.bias": False,
}
_BIDIRECTIONAL = Only("use_bidirectional_attention", False, (False,), "Gemma's decoders attend causally")

GEMMA = register(
    LLAMA.but(
        "Gemma",
        ("gemma",),
        {
            **_GEMMA,
            "decoder.width": F("hidden_size", 3072),
            "decoder.depth": F("num_hidden_layers", 28),
            "decoder.block.heads": count("num_attention_heads", 16),
            "decoder.block.head_dim": head_dim(256),
            "decoder.block.mlp.hidden": F("intermediate_size", 24576),
            "decoder.block.mlp.activation": F("hidden_act", "gelu_pytorch_tanh", map=GATED),
        },
        drop=_LLAMA_ONLY,
        only=(_BIDIRECTIONAL,),
        classes={"ForCausalLM": lm(tied=True)},
    )
)


def _query_scale(c: Config, spec: Mapping[str, Any]) -> float:
    """Gemma 2 scales the queries by ``query_pre_attn_scalar ** -0.5``, not by head_dim's."""
    scalar = c.get("query_pre_attn_scalar", 256, float)
    if scalar <= 0:
        raise c.refuse(
            "query_pre_attn_scalar",
            scalar,
            "the queries are scaled by its -1/2 power",
            "give a positive number",
        )
    return float(scalar) ** -0.5


def _query_scalar(scale: float | None, get: Callable[[str], Any]) -> dict[str, Any]:
    if scale is None:  # 1/sqrt(head_dim): the scalar is head_dim
        head_dim = get("decoder.block.head_dim") or get("decoder.width") // get("decoder.block.heads")
        return {"query_pre_attn_scalar": head_dim}
    scalar = scale**-2
    return {"query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar}


GEMMA2 = register(
    GEMMA.but(
        "Gemma2",
        ("gemma2",),
        {
            "decoder.width": F("hidden_size", 2304),
            "decoder.depth": F("num_hidden_layers", 26),
            "decoder.block.heads": count("num_attention_heads", 8),
            "decoder.block.kv_heads": F("num_key_value_heads", 4),
            "decoder.block.norm.placement": "sandwich",
            "decoder.block.mlp.hidden": F("intermediate_size", 9216),
            "decoder.block.mlp.activation": F("hidden_activation", "gelu_pytorch_tanh", map=GATED),
            "decoder.block.attention_scale": D(_query_scale, ("query_pre_attn_scalar",), _query_scalar),
            "decoder.block.attention_softcap": F("attn_logit_softcapping", 50.0, float),
            **sliding(4096, lambda c, i: bool((i + 1) % 2)),
        },
        classes={"ForCausalLM": lm(tied=True, softcap=F("final_logit_softcapping", 30.0, float))},
        names={
            "decoder.blocks.{i}.post_norm1": _LAYER + "post_attention_layernorm",
            "decoder.blocks.{i}.norm2": _LAYER + "pre_feedforward_layernorm",
            "decoder.blocks.{i}.post_norm2": _LAYER + "post_feedforward_layernorm",
        },
    )
)

OLMO = register(
    LLAMA.but(
        "Olmo",
        ("olmo",),
        {
            "decoder.input.vocab": F("vocab_size", 50304),
            "decoder.block.norm.kind": "layernorm",
            "decoder.block.norm.affine": False,  # OLMo's LayerNorm has neither weight nor bias
            "decoder.block.norm.eps": 1e-5,  # fixed in OlmoLayerNorm
            "decoder.block.mlp.bias": False,
        },
        drop=(*_LLAMA_ONLY, "decoder.block.head_dim", "ForTokenClassification"),  # no such HF class
        only=(Only("clip_qkv", None, (None,), "clipping q, k and v has no spec key"),),
    )
)

OLMO2 = register(
    OLMO.but(
        "Olmo2",
        ("olmo2",),
        {
            "decoder.block.norm.kind": "rmsnorm",
            "decoder.block.norm.affine": True,
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.block.norm.placement": "res_post",  # x + norm(f(x))
            "decoder.block.qk_norm": "all",  # one RMSNorm over all heads' queries (keys)
        },
        drop=("clip_qkv",),
        names=RES_POST_NAMES,
    )
)

PHI3 = register(
    LLAMA.but(
        "Phi3",
        ("phi3",),
        {
            "decoder.input.vocab": F("vocab_size", 32064),
            "decoder.position": rope(fraction=1.0),  # Phi-3 rotates partial_rotary_factor of each head
            "decoder.width": F("hidden_size", 3072),
            "decoder.block.mlp.hidden": F("intermediate_size", 8192),
            **_NO_BIAS,
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.block.sliding_window": F("sliding_window", None, int),
        },
        drop=_LLAMA_ONLY,
        only=_no_dropout("resid_pdrop", "embd_pdrop"),
        keys=_LAYERS + r"mlp\.gate_up_proj\.",
        inert=("original_max_position_embeddings",),  # read by LongRoPE only, which is refused
        names={
            "decoder.blocks.{i}.attn.qkv": _LAYER + "self_attn.qkv_proj",
            "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.gate_up_proj",  # [gate; up], as specvit packs them
        },
    )
)

STARCODER2 = register(
    LLAMA.but(
        "Starcoder2",
        ("starcoder2",),
        {
            "decoder.input.vocab": F("vocab_size", 49152),
            "decoder.width": F("hidden_size", 3072),
            "decoder.depth": F("num_hidden_layers", 30),
            "decoder.block.heads": count("num_attention_heads", 24),
            "decoder.block.kv_heads": F("num_key_value_heads", 2),
            "decoder.block.norm.kind": "layernorm",
            "decoder.block.norm.eps": F("norm_epsilon", 1e-5),
            "decoder.block.mlp.hidden": F("intermediate_size", 12288),
            "decoder.block.mlp.activation": F("hidden_act", "gelu_pytorch_tanh", map=ACTIVATIONS),
            "decoder.block.mlp.bias": F("use_bias", True),
            "decoder.block.qkv_bias": F("use_bias", True),
            "decoder.block.proj_bias": F("use_bias", True),
            "decoder.block.sliding_window": F("sliding_window", None, int),
        },
        drop=_LLAMA_ONLY,
        only=_no_dropout("residual_dropout", "embedding_dropout"),
        classes={"ForCausalLM": lm(tied=True)},
        keys=_LAYERS + r"mlp\.c_fc\.",
        names={
            "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.c_fc",
            "decoder.blocks.{i}.mlp.fc2": _LAYER + "mlp.c_proj",
        },
    )
)

MIXTRAL = register(
    LLAMA.but(
        "Mixtral",
        ("mixtral",),
        {
            "decoder.block.kv_heads": F("num_key_value_heads", 8),
            "decoder.block.mlp.hidden": F("intermediate_size", 14336),
            "decoder.block.mlp.moe.experts": F("num_local_experts", 8),
            "decoder.block.mlp.moe.top_k": F("num_experts_per_tok", 2),
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.position": rope(1e6),
            **_NO_BIAS,
            "decoder.block.sliding_window": F("sliding_window", None, int),
        },
        drop=_LLAMA_ONLY,
        only=(Only("router_jitter_noise", 0.0, (0.0,), "noise on the router's logits has no spec key"),),
        inert=("router_aux_loss_coef", "output_router_logits"),  # the training loop weighs the router loss
        keys=_LAYERS + r"mlp\.experts\.",
        names={
            "decoder.blocks.{i}.router": _LAYER + "mlp.gate",
            "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.experts.gate_up_proj",
            "decoder.blocks.{i}.mlp.fc2": _LAYER + "mlp.experts.down_proj",
        },
    )
)
