"""More families of the Llama-like decoder layout, each a table of what it changes: EXAONE 4 (OLMo 2's norms
after each branch, QK-norms per head, windows in three layers of four and no rotary positions in the others),
VaultGemma (Gemma 2 without the norms after each branch), Qwen3-VL's text model (Qwen3's decoder under
multimodal RoPE, which is plain RoPE for text: its three position streams are then equal) Granite-MoE
(Mixtral's experts under Granite's multipliers; Granite-MoE-Shared with a shared expert), HunYuan dense (Llama's blocks, QK-norms on the rotated
queries and keys) and Apertus (an MLP of one ``up_proj`` and xIELU, QK-norms; its default Llama 3 RoPE scaling
is refused, as every table's).

Granite's ``embedding_multiplier`` and ``residual_multiplier`` scale the embeddings and each branch by a
constant; the spec states neither (``input.scale`` is sqrt(width), ``layer_scale`` a learned vector no
checkpoint holds), so both are refused unless 1, as in Granite's table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.hf_decoders import GEMMA2, MIXTRAL, QWEN3, RES_POST_NAMES
from specvit.interop.hf_decoders3 import GRANITE, PLAIN
from specvit.interop.hf_layers import layer_types, overrides
from specvit.interop.hf_llama import LLAMA, head_dim, rope, rope_params, sliding
from specvit.interop.hf_moe import QWEN3_MOE, qwen_moe
from specvit.interop.registry import Config, listable
from specvit.interop.table import BARE, D, F, count, register

__all__: list[str] = []

_LAYER = "layers.{i}."
_NO_BIAS = {
    "decoder.block.qkv_bias": False,
    "decoder.block.proj_bias": False,
    "decoder.block.mlp.bias": False,
}


# -- EXAONE 4 --------------------------------------------------------------------------------------------


def _no_window(c: Config) -> bool:
    """EXAONE 4's ``sliding_window`` is null (not left out, which is 4096)."""
    return "sliding_window" in c.values and c.values["sliding_window"] is None


def _exaone4_slides(c: Config, i: int) -> bool:
    """EXAONE 4's default layer types: one full layer in every ``sliding_window_pattern`` (none without a
    window; transformers then divides by zero, so a config of HF's always names its layer types)."""
    if _no_window(c):
        return False
    return bool((i + 1) % c.size("sliding_window_pattern", 4))


def _exaone4_no_rope(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """EXAONE 4 rotates every layer without a window, and only its sliding layers with one (global NoPE)."""
    depth = spec["decoder.depth"]
    if not listable(depth):
        return None
    types = layer_types(c, depth, _exaone4_slides)
    if _no_window(c):
        if "sliding_attention" in types:
            raise c.refuse(
                "layer_types",
                types,
                "sliding layers without a sliding_window (transformers cannot build their mask)",
                "give a sliding_window or full_attention layers",
            )
        return None
    layers = [i for i, t in enumerate(types) if t == "full_attention"]
    return [{"layers": layers, "block": {"rope": False}}] if layers else None


_EXAONE4_WINDOWS = sliding(4096, _exaone4_slides, fields=("sliding_window_pattern",))

EXAONE4 = register(
    LLAMA.but(
        "Exaone4",
        ("exaone4",),
        {
            "decoder.input.vocab": F("vocab_size", 102400),
            "decoder.block.kv_heads": F("num_key_value_heads", 32),
            "decoder.block.head_dim": head_dim(),  # read by getattr where a config gives it
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.block.norm.placement": "res_post",  # x + norm(f(x)), OLMo 2's
            "decoder.block.qk_norm": "head",  # before RoPE, over each head's channels
            "decoder.block.mlp.hidden": F("intermediate_size", 16384),
            **_NO_BIAS,
            **_EXAONE4_WINDOWS,
            "decoder.overrides": overrides(_EXAONE4_WINDOWS["decoder.overrides"], _exaone4_no_rope),
        },
        drop=("pretraining_tp",),
        names=RES_POST_NAMES,
    )
)


# -- VaultGemma ------------------------------------------------------------------------------------------

VAULTGEMMA = register(
    GEMMA2.but(
        "VaultGemma",
        ("vaultgemma",),
        {"decoder.block.norm.placement": "pre"},  # Gemma 2's block without its post-branch norms
        drop=("use_bidirectional_attention", "ForSequenceClassification", "ForTokenClassification"),
        names={
            "decoder.blocks.{i}.norm1": _LAYER + "input_layernorm",
            "decoder.blocks.{i}.norm2": _LAYER + "pre_feedforward_layernorm",
        },
    )
)


# -- Qwen3-VL's text model -------------------------------------------------------------------------------

QWEN3_VL_TEXT = register(
    QWEN3.but(
        "Qwen3VLText",
        ("qwen3_vl_text",),
        {
            # mrope_section and mrope_interleaved pick which stream rotates which channels: with text alone
            # the streams are one position, so each channel turns as plain RoPE's
            "decoder.position": rope(500000.0),
            "decoder.width": F("hidden_size", 4096),
            "decoder.block.heads": count("num_attention_heads", 32),
            "decoder.block.kv_heads": F("num_key_value_heads", 32),
            "decoder.block.head_dim": head_dim(128),
            "decoder.block.mlp.hidden": F("intermediate_size", 22016),
            "decoder.block.qkv_bias": F("attention_bias", False),
            "decoder.block.proj_bias": F("attention_bias", False),
        },
        drop=(
            "decoder.block.sliding_window",
            "decoder.overrides",
            "ForCausalLM",  # the text model comes alone as a base model; the LM is the multimodal class's
            "ForSequenceClassification",
            "ForTokenClassification",
        ),
        classes={"Model": BARE},
        default="Model",
    )
)


def _normalized(moe: D) -> D:
    """Qwen3-VL-MoE's experts: Qwen's, their top k weights always rescaled to sum to 1 (no norm_topk_prob)."""

    def read(c: Config, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        value = moe.read(c, spec)
        return None if value is None else value | {"normalize": True}

    def write(value: Any, get: Callable[[str], Any]) -> dict[str, Any]:
        assert moe.inverse is not None
        return {k: v for k, v in moe.inverse(value, get).items() if k != "norm_topk_prob"}

    return D(read, tuple(f for f in moe.fields if f != "norm_topk_prob"), write)


_QWEN3_VL_MLP = qwen_moe(5632, 1408, 60, 4, None)

QWEN3_VL_MOE_TEXT = register(
    QWEN3_MOE.but(
        "Qwen3VLMoeText",
        ("qwen3_vl_moe_text",),
        {
            **QWEN3_VL_TEXT.spec,  # its attention and positions (plain RoPE for text)
            "decoder.width": F("hidden_size", 2048),
            "decoder.depth": F("num_hidden_layers", 24),
            "decoder.block.heads": count("num_attention_heads", 16),
            "decoder.block.kv_heads": F("num_key_value_heads", 16),
            "decoder.block.head_dim": head_dim(),
            **_QWEN3_VL_MLP,
            "decoder.block.mlp.moe": _normalized(_QWEN3_VL_MLP["decoder.block.mlp.moe"]),
        },
        drop=(
            "decoder.block.sliding_window",
            "ForCausalLM",
            "ForSequenceClassification",
            "ForTokenClassification",
        ),
        # the class sets sliding_window to None whatever a config says; the text model has no head to tie
        inert=("sliding_window", "tie_word_embeddings"),
        classes={"Model": BARE},
        default="Model",
    )
)


# -- Granite-MoE -----------------------------------------------------------------------------------------

GRANITE_MOE = register(
    MIXTRAL.but(
        "GraniteMoe",
        ("granitemoe",),
        {
            "decoder.input.vocab": F("vocab_size", 32000),
            "decoder.position": rope(),
            "decoder.block.kv_heads": F("num_key_value_heads", None, int),
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-6),
            "decoder.block.mlp.hidden": F("intermediate_size", 11008),
            # the softmax of the top k logits: Mixtral's top k of the softmax, rescaled to sum to 1
            "decoder.block.mlp.moe.normalize": True,
            "decoder.block.qkv_bias": F("attention_bias", False),
            "decoder.block.proj_bias": F("attention_bias", False),
            "decoder.block.attention_scale": GRANITE.spec["decoder.block.attention_scale"],
        },
        drop=(
            "router_jitter_noise",
            "decoder.block.sliding_window",
            "decoder.block.head_dim",  # as Granite's: width / heads
            "ForSequenceClassification",
            "ForTokenClassification",
        ),
        only=tuple(o for o in GRANITE.only if o.name != "pretraining_tp"),
        classes={"ForCausalLM": GRANITE.classes["ForCausalLM"]},
        keys=r"(?:model\.)?layers\.\d+\.block_sparse_moe\.router\.",
        names={
            "decoder.blocks.{i}.router": _LAYER + "block_sparse_moe.router",
            "decoder.blocks.{i}.mlp.fc1": _LAYER + "block_sparse_moe.experts.gate_up_proj",
            "decoder.blocks.{i}.mlp.fc2": _LAYER + "block_sparse_moe.experts.down_proj",
        },
    )
)


def _shared(c: Config, spec: Mapping[str, Any]) -> int | None:
    """Granite-MoE-Shared's shared expert (a gated MLP every token runs, added to the routed ones): none at
    ``shared_intermediate_size`` 0."""
    return c.get("shared_intermediate_size", 0) or None


GRANITE_MOE_SHARED = register(
    GRANITE_MOE.but(
        "GraniteMoeShared",
        ("granitemoeshared",),
        {
            "decoder.block.mlp.moe.shared_hidden": D(
                _shared, ("shared_intermediate_size",), lambda v, get: {"shared_intermediate_size": v or 0}
            )
        },
        keys=r"(?:model\.)?layers\.\d+\.shared_mlp\.input_linear\.",
        names={
            "decoder.blocks.{i}.mlp.shared.fc1": _LAYER + "shared_mlp.input_linear",  # [gate; up]
            "decoder.blocks.{i}.mlp.shared.fc2": _LAYER + "shared_mlp.output_linear",
        },
    )
)


# -- HunYuan dense ---------------------------------------------------------------------------------------


def _hunyuan_rope(c: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
    """HunYuan's RoPE: plain, or ``dynamic`` with an ``alpha`` (its NTK-alpha RoPE), which only raises the
    base to ``theta * alpha ** (hd / (hd - 2))`` whatever the length: plain RoPE at that base."""
    key, params, kind, theta = rope_params(c, 10000.0)  # the Hub's configs: rope_scaling, rope_theta beside
    if kind != "dynamic" or not params.get("alpha"):
        return _PLAIN_ROPE.read(c, spec)
    alpha, dim = params.get("alpha", 1.0, float), c.get("head_dim", 0, int)
    if alpha <= 0 or dim <= 2:
        why = "its base is rope_theta * alpha ** (head_dim / (head_dim - 2)), from the config's head_dim"
        raise c.refuse(key, params.values, why, "give head_dim > 2 and alpha > 0")
    return {"kind": "rope", "base": float(theta) * alpha ** (dim / (dim - 2))}


_PLAIN_ROPE = rope()

HUNYUAN_DENSE = register(
    LLAMA.but(
        "HunYuanDenseV1",
        ("hunyuan_v1_dense",),
        {
            "decoder.input.vocab": F("vocab_size", 290943),
            "decoder.position": D(
                _hunyuan_rope,
                ("rope_parameters", "rope_scaling", "rope_theta", "head_dim"),
                _PLAIN_ROPE.inverse,
            ),
            "decoder.block.qk_norm": "head",
            "decoder.block.qk_norm_after_rope": True,  # RMSNorm of each rotated head
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.block.mlp.bias": False,
        },
        drop=("ForTokenClassification",),
        inert=("eod_token_id",),  # a token id
        keys=r"(?:model\.)?layers\.\d+\.self_attn\.query_layernorm\.",
        names={
            "decoder.blocks.{i}.attn.q_norm": _LAYER + "self_attn.query_layernorm",
            "decoder.blocks.{i}.attn.k_norm": _LAYER + "self_attn.key_layernorm",
        },
    )
)


# -- Apertus ---------------------------------------------------------------------------------------------

_APERTUS_ROPE = rope(12000000.0)


def _apertus_rope(c: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
    """Apertus's RoPE: a config without RoPE parameters has the class's, Llama 3's scaling, which no spec
    position states (refused as the config's would be)."""
    if c.get("rope_parameters", kind=dict) is None and c.get("rope_scaling", kind=dict) is None:
        raise c.refuse(
            "rope_parameters",
            None,
            "Apertus's class then scales RoPE as Llama 3 (rope_type llama3), which has no specvit position kind",
            "use plain RoPE: rope_parameters: {rope_type: default, rope_theta: 12000000.0}",
        )
    return _APERTUS_ROPE.read(c, spec)


APERTUS = register(
    LLAMA.but(
        "Apertus",
        ("apertus",),
        {
            "decoder.input.vocab": F("vocab_size", 131072),
            "decoder.position": D(_apertus_rope, _APERTUS_ROPE.fields, _APERTUS_ROPE.inverse),
            "decoder.block.qk_norm": "head",
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.block.mlp.hidden": F("intermediate_size", 14336),
            "decoder.block.mlp.activation": F("hidden_act", "xielu", map=PLAIN | {"xielu": "xielu"}),
            "decoder.block.mlp.bias": False,
        },
        drop=("pretraining_tp", "ForSequenceClassification"),
        keys=r"(?:model\.)?layers\.\d+\.attention_layernorm\.",
        names={
            "decoder.blocks.{i}.norm1": _LAYER + "attention_layernorm",
            "decoder.blocks.{i}.norm2": _LAYER + "feedforward_layernorm",
            "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.up_proj",
            "decoder.blocks.{i}.mlp.fc2": _LAYER + "mlp.down_proj",
            "decoder.blocks.{i}.mlp.act": _LAYER + "mlp.act_fn",  # xIELU's alpha_p, alpha_n, beta, eps
        },
    )
)
