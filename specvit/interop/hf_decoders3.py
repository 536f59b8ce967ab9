"""More families of the Llama-like decoder layout (:data:`~specvit.interop.hf_llama.LLAMA`), each a table of
what it changes: Ministral, Helium, InternLM 3, EXAONE and IQuest-Coder (Llama's classes under model types of
their own), Seed-OSS, ERNIE 4.5, Arcee, GLM, GLM-4, Nemotron, Persimmon and Granite.

ERNIE 4.5, Helium and GLM rotate interleaved pairs of channels (GPT-J's layout); Arcee, Nemotron and
Persimmon have an MLP of one ``up_proj`` and a squared ReLU; GLM-4 norms each branch's output too
(``sandwich``); Granite scales the queries by ``attention_multiplier`` and the logits by ``1 /
logits_scaling``, and its embedding and residual multipliers are refused unless 1 (specvit has no such
scale).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.hf_llama import GATED, LLAMA, head_dim, rope, sliding
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.table import D, F, Only, count, lm, register
from specvit.interop.variants import per_head_qkv, variant

__all__ = ["PLAIN", "first_of"]

PLAIN = {**ACTIVATIONS, "relu2": "relu2"}
"""transformers' activations of an MLP without a gate, squared ReLU (``relu2``) included."""

_LAYER = "layers.{i}."
_LAYERS = r"(?:model\.)?layers\.\d+\."
_TP = ("pretraining_tp",)
_NO_BIAS = {
    "decoder.block.qkv_bias": False,
    "decoder.block.proj_bias": False,
    "decoder.block.mlp.bias": False,
}
_UP = {
    "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.up_proj",
    "decoder.blocks.{i}.mlp.fc2": _LAYER + "mlp.down_proj",
}
"""An MLP without a gate: ``up_proj`` then ``down_proj`` (Arcee, Nemotron)."""
_NO_CLASSIFIERS = ("ForSequenceClassification", "ForTokenClassification")


def first_of(
    names: tuple[str, ...], default: Any, kind: type | None = None, map: Mapping[Any, Any] | None = None
) -> D:
    """A value a config names by one of several fields (a config class's ``attribute_map``: InternLM 3's
    ``qkv_bias`` for ``attention_bias``), read from the first one present as :class:`F` reads it.

    Args:
        names: the fields, the class's own first.
        default: the class's default.
        kind: the field's type where the default does not say it.
        map: the field's values -> the spec's, as :class:`F`'s.
    """

    def read(c: Config, spec: Mapping[str, Any]) -> Any:
        name = next((n for n in names if c.values.get(n) is not None), names[0])
        return F(name, default, kind, map).read(c)

    def write(value: Any, get: Callable[[str], Any]) -> dict[str, Any]:
        return F(names[0], default, kind, map).write(value)

    return D(read, names, write)


MINISTRAL = register(
    LLAMA.but(
        "Ministral",
        ("ministral",),
        {
            "decoder.block.kv_heads": F("num_key_value_heads", 8),
            "decoder.block.mlp.hidden": F("intermediate_size", 14336),
            **_NO_BIAS,
            **sliding(4096, lambda c, i: True),  # every layer slides where a config names a window
        },
        drop=_TP,
    )
)


def _whole_width(fixed: int) -> D:
    """``head_dim`` where the attention's output projection is ``hidden_size`` wide whatever it says (Helium's
    ``o_proj``): head_dim times the heads must be the width, else HF's model cannot run."""
    inner = head_dim(fixed)

    def read(c: Config, spec: Mapping[str, Any]) -> int | None:
        value = inner.read(c, spec)
        if value is not None and value * spec["decoder.block.heads"] != spec["decoder.width"]:
            raise c.refuse(
                "head_dim",
                value,
                f"{c.model_type}'s o_proj takes hidden_size {spec['decoder.width']} channels, not "
                f"{spec['decoder.block.heads']} heads of {value}",
                "give head_dim = hidden_size / num_attention_heads",
            )
        return value

    return D(read, inner.fields, inner.inverse)


HELIUM = register(
    LLAMA.but(
        "Helium",
        ("helium",),
        {
            "decoder.input.vocab": F("vocab_size", 48000),
            "decoder.position": rope(100000.0, layout="interleaved"),
            "decoder.width": F("hidden_size", 2560),
            "decoder.depth": F("num_hidden_layers", 24),
            "decoder.block.heads": count("num_attention_heads", 20),
            "decoder.block.kv_heads": F("num_key_value_heads", 20),
            "decoder.block.head_dim": _whole_width(128),
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-8),
            "decoder.block.mlp.hidden": F("intermediate_size", 7040),
            "decoder.block.proj_bias": False,  # o_proj has no bias whatever attention_bias says
        },
        drop=_TP,
    )
)


def _same_biases(c: Config, spec: Mapping[str, Any]) -> bool:
    """InternLM 3's biases: one setting for q, k, v, o and the MLP (transformers refuses two)."""
    attention = first_of(("attention_bias", "qkv_bias"), False).read(c, spec)
    mlp = first_of(("mlp_bias", "bias"), False).read(c, spec)
    if attention != mlp:
        raise c.refuse(
            "mlp_bias",
            mlp,
            f"the attention's biases are {attention}: InternLM 3 has one setting",
            f"use {attention}",
        )
    return attention


_INTERNLM_BIASES = {
    "decoder.block.qkv_bias": D(_same_biases, ("attention_bias", "qkv_bias", "mlp_bias", "bias")),
    "decoder.block.proj_bias": first_of(("attention_bias", "qkv_bias"), False),
    "decoder.block.mlp.bias": first_of(("mlp_bias", "bias"), False),
}

INTERNLM3 = register(
    LLAMA.but(
        "Llama",  # transformers builds InternLM 3 as LlamaForCausalLM
        ("internlm3",),
        {
            "decoder.input.vocab": F("vocab_size", 128512),
            "decoder.depth": F("num_hidden_layers", 48),
            "decoder.block.kv_heads": F("num_key_value_heads", 2),
            "decoder.block.head_dim": head_dim(128),
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.block.mlp.hidden": F("intermediate_size", 10240),
            **_INTERNLM_BIASES,
        },
        drop=_TP,
    )
)

EXAONE = register(
    LLAMA.but(
        "Llama",  # transformers builds EXAONE 3 as LlamaForCausalLM
        ("exaone",),
        {
            "decoder.input.vocab": F("vocab_size", 102400),
            "decoder.position": rope(500000.0),
            "decoder.depth": first_of(("num_hidden_layers", "num_layers"), 32),
            "decoder.block.kv_heads": F("num_key_value_heads", 8),
            "decoder.block.norm.eps": first_of(("rms_norm_eps", "layer_norm_epsilon"), 1e-5),
            "decoder.block.mlp.hidden": F("intermediate_size", 14336),
            "decoder.block.mlp.activation": first_of(
                ("hidden_act", "activation_function"), "silu", map=GATED
            ),
        },
        drop=_TP,
    )
)

IQUESTCODER = register(
    LLAMA.but(
        "Llama",  # transformers builds IQuest-Coder as LlamaForCausalLM
        ("iquestcoder",),
        {
            "decoder.input.vocab": F("vocab_size", 76800),
            "decoder.width": F("hidden_size", 5120),
            "decoder.depth": F("num_hidden_layers", 80),
            "decoder.block.heads": count("num_attention_heads", 40),
            "decoder.block.kv_heads": F("num_key_value_heads", 8),
            "decoder.block.head_dim": head_dim(128),
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.block.mlp.hidden": F("intermediate_size", 27648),
        },
        drop=_TP,
    )
)

SEED_OSS = register(
    LLAMA.but(
        "SeedOss",
        ("seed_oss",),
        {
            "decoder.input.vocab": F("vocab_size", 155136),
            "decoder.depth": F("num_hidden_layers", 64),
            "decoder.block.heads": count("num_attention_heads", 80),
            "decoder.block.kv_heads": F("num_key_value_heads", 8),
            "decoder.block.head_dim": head_dim(128),
            "decoder.block.mlp.hidden": F("intermediate_size", 27648),
            "decoder.block.qkv_bias": F("attention_bias", True),
            "decoder.block.proj_bias": F("attention_out_bias", False),
            "decoder.dropout.attention": F("attention_dropout", 0.1),
            # after the attention's projection and after the MLP; specvit's MLP dropout also drops inside it
            "decoder.dropout.projection": F("residual_dropout", 0.1),
            "decoder.dropout.mlp": F("residual_dropout", 0.1),
        },
    )
)

ERNIE = register(
    LLAMA.but(
        "Ernie4_5",
        ("ernie4_5",),
        {
            "decoder.input.vocab": F("vocab_size", 103424),
            "decoder.position": rope(500000.0, layout="interleaved"),
            "decoder.width": F("hidden_size", 1024),
            "decoder.depth": F("num_hidden_layers", 18),
            "decoder.block.heads": count("num_attention_heads", 16),
            "decoder.block.kv_heads": F("num_key_value_heads", 2),
            "decoder.block.head_dim": head_dim(128),
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.block.mlp.hidden": F("intermediate_size", 3072),
            "decoder.block.qkv_bias": F("use_bias", False),
            "decoder.block.proj_bias": F("use_bias", False),
            "decoder.block.mlp.bias": F("use_bias", False),
        },
        drop=(*_TP, "decoder.dropout.attention", *_NO_CLASSIFIERS),  # ERNIE's attention drops nothing
        classes={"ForCausalLM": lm(tied=True)},
    )
)

ARCEE = register(
    LLAMA.but(
        "Arcee",
        ("arcee",),
        {
            "decoder.width": F("hidden_size", 2560),
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-5),
            "decoder.block.mlp.hidden": F("intermediate_size", 18432),
            "decoder.block.mlp.activation": F("hidden_act", "relu2", map=PLAIN),
        },
        drop=_TP,
        keys=_LAYERS + r"mlp\.up_proj\.",
        names=_UP,
    )
)

GLM = register(
    LLAMA.but(
        "Glm",
        ("glm",),
        {
            "decoder.input.vocab": F("vocab_size", 151552),
            "decoder.position": rope(fraction=0.5, layout="interleaved"),
            "decoder.depth": F("num_hidden_layers", 40),
            "decoder.block.kv_heads": F("num_key_value_heads", 2),
            "decoder.block.head_dim": head_dim(128),
            "decoder.block.norm.eps": F("rms_norm_eps", 1.5625e-07),
            "decoder.block.mlp.hidden": F("intermediate_size", 13696),
            **_NO_BIAS,
            "decoder.block.qkv_bias": F("attention_bias", True),  # o_proj has no bias
        },
        drop=_TP,
        keys=_LAYERS + r"mlp\.gate_up_proj\.",
        names={
            "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.gate_up_proj"
        },  # [gate; up], as specvit packs them
    )
)

GLM4 = register(
    GLM.but(
        "Glm4",
        ("glm4",),
        {"decoder.block.norm.placement": "sandwich"},  # x + norm(f(norm(x))), for both branches
        keys=_LAYERS + r"post_self_attn_layernorm\.",
        names={
            "decoder.blocks.{i}.post_norm1": _LAYER + "post_self_attn_layernorm",
            "decoder.blocks.{i}.norm2": _LAYER + "post_attention_layernorm",
            "decoder.blocks.{i}.post_norm2": _LAYER + "post_mlp_layernorm",
        },
    )
)

NEMOTRON = register(
    LLAMA.but(
        "Nemotron",
        ("nemotron",),
        {
            "decoder.input.vocab": F("vocab_size", 256000),
            "decoder.position": rope(fraction=0.5),
            "decoder.width": F("hidden_size", 6144),
            "decoder.block.heads": count("num_attention_heads", 48),
            "decoder.block.head_dim": head_dim(128),
            "decoder.block.norm.kind": "layernorm",
            "decoder.block.norm.unit_offset": True,  # LayerNorm1P: the weight plus one
            "decoder.block.norm.eps": F("norm_eps", 1e-5),
            "decoder.block.mlp.hidden": F("intermediate_size", 24576),
            "decoder.block.mlp.activation": F("hidden_act", "relu2", map=PLAIN),
        },
        drop=_TP,
        keys=_LAYERS + r"mlp\.up_proj\.",
        names=_UP,
    )
)


def _qk_layernorm(c: Config, spec: Mapping[str, Any]) -> str | None:
    """Persimmon's ``qk_layernorm``: one LayerNorm (the block's kind, eps) over each head's channels."""
    return "head" if c.get("qk_layernorm", True) else None


PERSIMMON = register(
    variant(
        LLAMA.but(
            "Persimmon",
            ("persimmon",),
            {
                "decoder.input.vocab": F("vocab_size", 262144),
                "decoder.position": rope(fraction=0.5),
                "decoder.depth": F("num_hidden_layers", 36),
                "decoder.block.heads": count("num_attention_heads", 64),
                "decoder.block.norm.kind": "layernorm",
                "decoder.block.norm.eps": F("layer_norm_eps", 1e-5),
                "decoder.block.qk_norm": D(_qk_layernorm, ("qk_layernorm",)),
                "decoder.block.mlp.hidden": F("intermediate_size", 16384),
                "decoder.block.mlp.activation": F("hidden_act", "relu2", map=PLAIN),
                "decoder.block.mlp.bias": True,
                "decoder.block.qkv_bias": True,
                "decoder.block.proj_bias": True,
                # after the MLP only; specvit's MLP dropout also drops after its activation (training only)
                "decoder.dropout.mlp": F("hidden_dropout", 0.0),
            },
            drop=(*_TP, "decoder.block.kv_heads", "decoder.block.head_dim"),
            keys=_LAYERS + r"self_attn\.query_key_value\.",
            names={
                "decoder.blocks.{i}.attn.proj": _LAYER + "self_attn.dense",
                "decoder.blocks.{i}.attn.q_norm": _LAYER + "self_attn.q_layernorm",
                "decoder.blocks.{i}.attn.k_norm": _LAYER + "self_attn.k_layernorm",
                "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.dense_h_to_4h",
                "decoder.blocks.{i}.mlp.fc2": _LAYER + "mlp.dense_4h_to_h",
                "decoder.norm": "final_layernorm",
            },
        ),
        per_head_qkv(_LAYER + "self_attn.query_key_value"),
    )
)


def _logits_scale(c: Config, spec: Mapping[str, Any]) -> float | None:
    """Granite divides the logits by ``logits_scaling``: the tokens times its inverse before the head."""
    scaling = c.get("logits_scaling", 1.0)
    if scaling <= 0:
        raise c.refuse("logits_scaling", scaling, "the logits are divided by it", "give a positive number")
    return None if scaling == 1.0 else 1.0 / scaling


def _one(name: str, what: str) -> Only:
    return Only(name, 1.0, (1.0,), f"specvit has no constant scale of {what}")


GRANITE = register(
    LLAMA.but(
        "Granite",
        ("granite",),
        {
            "decoder.block.attention_scale": F("attention_multiplier", 1.0),  # in place of 1/sqrt(head_dim)
        },
        drop=(*_TP, "decoder.block.head_dim", *_NO_CLASSIFIERS),
        only=(
            _one("embedding_multiplier", "the embeddings"),
            _one("residual_multiplier", "the residual branches"),
        ),
        classes={
            "ForCausalLM": lm(
                scale=D(
                    _logits_scale, ("logits_scaling",), lambda v, get: {"logits_scaling": 1.0 / (v or 1.0)}
                )
            )
        },
    )
)
