"""Llama and Mistral (``LlamaForCausalLM``, ``MistralForCausalLM``): RMSNorm, SwiGLU, RoPE, GQA; Mistral
adds a sliding window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Layout, cat, one
from specvit.interop.registry import Config, Family, activation, family

__all__: list[str] = []

_ACT = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh"}


def rope_theta(c: Config, default: float = 10000.0) -> float:
    """RoPE's theta from ``rope_parameters`` (transformers 5) or ``rope_theta``; scaled RoPE is refused."""
    key = "rope_parameters" if c.get("rope_parameters", kind=dict) else "rope_scaling"
    params = c.sub(key)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise c.refuse(
            key, params.values, f"{kind} RoPE scaling has no specvit position kind", "use plain RoPE"
        )
    return params.get("rope_theta", c.get("rope_theta", default))


def _spec(c: Config) -> dict[str, Any]:
    width, heads = c.get("hidden_size", 4096), c.size("num_attention_heads", 32)
    c.only("pretraining_tp", 1, [1], "tensor-parallel slicing of the projections changes the sums")
    bias = bool(c.get("attention_bias", False))
    block: dict[str, Any] = {
        "heads": heads,
        "layers": ["masked_self_attention", "mlp"],
        "norm": {"kind": "rmsnorm", "eps": c.get("rms_norm_eps", 1e-6)},
        "mlp": {
            "hidden": c.get("intermediate_size", 11008),
            "activation": activation(c, _ACT, default="silu"),
            "bias": bool(c.get("mlp_bias", False)),
        },
        "qkv_bias": bias,
        "proj_bias": bias,
    }
    kv = c.get("num_key_value_heads", heads)
    if kv != heads:
        block["kv_heads"] = kv
    head_dim = c.get("head_dim", width // heads)
    if head_dim * heads != width or width % heads:
        block["head_dim"] = head_dim
    if c.model_type == "mistral" and c.get("sliding_window", kind=int) is not None:
        block["sliding_window"] = c.get("sliding_window")
    name = {"llama": "Llama", "mistral": "Mistral"}[c.model_type]
    return {
        "specvit": 1,
        "name": f"{c.model_type}_from_hf",
        "description": f"{name} ({name}ForCausalLM), imported from its transformers config.",
        "model": "decoder",
        "decoder": {
            "input": {"kind": "tokens", "vocab": c.get("vocab_size", 32000)},
            "position": {"kind": "rope", "base": rope_theta(c)},
            "width": width,
            "depth": c.get("num_hidden_layers", 32),
            "block": block,
        },
        "head": {"kind": "lm", "tied": bool(c.get("tie_word_embeddings", False))},
    }


def _layout(spec: Any, keys: Sequence[str]) -> Layout:
    layer, block = "model.layers.{i}.", "decoder.blocks.{i}."
    attn = tuple(layer + f"self_attn.{n}_proj" + ".{p}" for n in "qkv")
    table = {
        "decoder.tok_embed.weight": one("model.embed_tokens.weight"),
        block + "norm1.weight": one(layer + "input_layernorm.weight"),
        block + "attn.qkv.{p}": (attn, cat),
        block + "attn.proj.{p}": one(layer + "self_attn.o_proj.{p}"),
        block + "norm2.weight": one(layer + "post_attention_layernorm.weight"),
        block + "mlp.fc1.{p}": ((layer + "mlp.gate_proj.{p}", layer + "mlp.up_proj.{p}"), cat),
        block + "mlp.fc2.{p}": one(layer + "mlp.down_proj.{p}"),
        "decoder.norm.weight": one("model.norm.weight"),
        "head.fc.weight": one("lm_head.weight"),
    }
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if spec.head.tied else {}
    if tied:
        del table["head.fc.weight"]
    return Layout(
        "HF LlamaForCausalLM / MistralForCausalLM", table, ignore=(r".*rotary_emb\.inv_freq",), tied=tied
    )


family(
    Family("LlamaForCausalLM", ("llama", "mistral"), r"model\.layers\.\d+\.mlp\.gate_proj\.", _spec, _layout)
)
