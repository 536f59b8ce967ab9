"""More families of the Llama-like decoder layout (:data:`~specvit.interop.hf_llama.LLAMA`), each a table of
what it changes: StableLM, Cohere and Phi, the three with LayerNorm and partial or interleaved rotary, and
blocks whose attention and MLP read one norm in parallel.

A parallel block with one norm (``input_layernorm`` feeding both branches) is specvit's parallel block
whose two norms hold the same HF weights: ``norm1`` and ``norm2`` both name ``input_layernorm``.

QK-norms with weights of their own for each head (StableLM's ``qk_layernorm``, Cohere's ``use_qk_norm``)
are refused: specvit's ``qk_norm`` shares one norm across the heads (``head``) or normalises all heads at
once (``all``). Phi's ``qk_layernorm`` is one LayerNorm over each head's channels: ``qk_norm: head``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specvit.interop.hf_llama import LLAMA, rope
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.table import D, F, Name, Only, count, lm, register
from specvit.interop.variants import variant

__all__ = ["full_rope"]

_LAYER = "layers.{i}."
_LAYERS = r"(?:model\.)?layers\.\d+\."
_ONE_NORM = {"decoder.blocks.{i}.norm2": _LAYER + "input_layernorm"}
"""A parallel block's one norm: specvit's second norm holds the same weights as its first."""
_LLAMA_ONLY = ("pretraining_tp", "decoder.block.head_dim")


def _one_norm_if_parallel(spec: Any, keys: Sequence[str]) -> Mapping[str, Name]:
    """StableLM's blocks: sequential with two norms, or parallel with ``input_layernorm`` alone."""
    return _ONE_NORM if spec.decoder.block.parallel else {}


def _per_head_norm(name: str) -> Only:
    return Only(
        name,
        False,
        (False,),
        "a QK LayerNorm with weights of its own for each head has no spec key (specvit's qk_norm shares "
        "one norm across the heads)",
    )


STABLELM = register(
    variant(LLAMA, _one_norm_if_parallel).but(
        "StableLm",
        ("stablelm",),
        {
            "decoder.input.vocab": F("vocab_size", 50304),
            "decoder.position": rope(fraction=0.25),
            "decoder.width": F("hidden_size", 2560),
            "decoder.block.heads": count("num_attention_heads", 32),
            "decoder.block.kv_heads": F("num_key_value_heads", 32),
            "decoder.block.norm.kind": "layernorm",
            "decoder.block.norm.eps": F("layer_norm_eps", 1e-5),
            "decoder.block.parallel": F("use_parallel_residual", False),
            "decoder.block.mlp.hidden": F("intermediate_size", 6912),
            "decoder.block.mlp.bias": False,
            "decoder.block.qkv_bias": F("use_qkv_bias", False),
            "decoder.block.proj_bias": False,
            # after the MLP only; specvit's MLP dropout also drops after its activation (training only)
            "decoder.dropout.mlp": F("hidden_dropout", 0.0),
        },
        drop=_LLAMA_ONLY,  # the attention is width / heads wide whatever head_dim says: refused as unknown
        only=(_per_head_norm("qk_layernorm"),),
    )
)


def full_rope(default_theta: float, layout: str | None = None) -> D:
    """RoPE over every channel of each head at the config's theta: Cohere's and Falcon's HF classes compute
    their frequencies over the whole head whatever ``partial_rotary_factor`` says.

    Args:
        default_theta: the family's default theta.
        layout: the pairs' layout when not rotate-half (``interleaved``: Cohere).
    """
    inner = rope(default_theta, layout=layout)

    def read(c: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
        position = inner.read(c, spec)
        position.pop("fraction", None)
        return position

    return D(read, inner.fields, inner.inverse)


COHERE = register(
    LLAMA.but(
        "Cohere",
        ("cohere",),
        {
            "decoder.input.vocab": F("vocab_size", 256000),
            "decoder.position": full_rope(500000.0, "interleaved"),
            "decoder.width": F("hidden_size", 8192),
            "decoder.depth": F("num_hidden_layers", 40),
            "decoder.block.heads": count("num_attention_heads", 64),
            "decoder.block.norm.kind": "layernorm",
            "decoder.block.norm.bias": False,  # CohereLayerNorm: a weight, no bias
            "decoder.block.norm.eps": F("layer_norm_eps", 1e-5),
            "decoder.block.parallel": True,
            "decoder.block.mlp.hidden": F("intermediate_size", 22528),
            "decoder.block.mlp.bias": False,
        },
        drop=("pretraining_tp", "ForSequenceClassification", "ForTokenClassification"),  # no such HF classes
        only=(_per_head_norm("use_qk_norm"),),
        # the logits times logit_scale: for a head without a bias, the tokens times it before the head
        classes={"ForCausalLM": lm(tied=True, scale=F("logit_scale", 0.0625))},
        names=_ONE_NORM,
    )
)


def _qk_layernorm(c: Config, spec: Mapping[str, Any]) -> str | None:
    """Phi's ``qk_layernorm``: one LayerNorm (the block's kind, bias and eps) over each head's channels."""
    return "head" if c.get("qk_layernorm", False) else None


PHI = register(
    LLAMA.but(
        "Phi",
        ("phi",),
        {
            "decoder.input.vocab": F("vocab_size", 51200),
            "decoder.position": rope(fraction=0.5),
            "decoder.width": F("hidden_size", 2048),
            "decoder.depth": F("num_hidden_layers", 24),
            "decoder.block.norm.kind": "layernorm",
            "decoder.block.norm.eps": F("layer_norm_eps", 1e-5),
            "decoder.block.parallel": True,
            "decoder.block.qk_norm": D(_qk_layernorm, ("qk_layernorm",)),
            "decoder.block.mlp.hidden": F("intermediate_size", 8192),
            "decoder.block.mlp.activation": F("hidden_act", "gelu_new", map=ACTIVATIONS),
            "decoder.block.mlp.bias": True,
            "decoder.block.qkv_bias": True,
            "decoder.block.proj_bias": True,
            "decoder.dropout.embedding": F("embd_pdrop", 0.0),
            "decoder.dropout.projection": F("resid_pdrop", 0.0),
            # after the MLP only; specvit's MLP dropout also drops after its activation (training only)
            "decoder.dropout.mlp": F("resid_pdrop", 0.0),
        },
        drop=("pretraining_tp",),
        classes={"ForCausalLM": lm(bias=True)},
        keys=_LAYERS + r"self_attn\.dense\.",
        names={
            **_ONE_NORM,
            "decoder.blocks.{i}.attn.proj": _LAYER + "self_attn.dense",
            "decoder.blocks.{i}.attn.q_norm": _LAYER + "self_attn.q_layernorm",
            "decoder.blocks.{i}.attn.k_norm": _LAYER + "self_attn.k_layernorm",
            "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.fc1",
            "decoder.blocks.{i}.mlp.fc2": _LAYER + "mlp.fc2",
            "decoder.norm": "final_layernorm",
        },
    )
)
