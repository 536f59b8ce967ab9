"""The Llama-like decoder layout: ``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
RMSNorm, RoPE. Llama and Mistral are its first tables; the families of ``hf_decoders.py`` change a few
entries of :data:`LLAMA`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.registry import Config, listable
from specvit.interop.table import BARE, LM, SEQUENCE, D, F, Only, Table, count, per_token, register

__all__ = ["GATED", "LLAMA", "head_dim", "rope", "rope_params", "sliding"]

GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh"}
"""transformers' activation of a gated MLP (``act(gate) * up``) -> specvit's gated activation."""


def rope_params(c: Config, default: float) -> tuple[str, Config, str, float]:
    """Where the RoPE parameters are (transformers 5's ``rope_parameters``, 4's and the Hub's older
    ``rope_scaling`` with a top-level ``rope_theta``), them, their kind and theta.

    Args:
        c: the config.
        default: the family's default theta.
    """
    key = "rope_parameters" if c.get("rope_parameters", kind=dict) else "rope_scaling"
    params = c.sub(key)
    kind = params.get("rope_type", params.get("type", "default"))
    return key, params, kind, params.get("rope_theta", c.get("rope_theta", default))


def _theta(c: Config, default: float) -> tuple[Config, float]:
    """The RoPE parameters and theta; scaled RoPE is refused."""
    key, params, kind, theta = rope_params(c, default)
    if kind != "default":
        raise c.refuse(
            key, params.values, f"{kind} RoPE scaling has no specvit position kind", "use plain RoPE"
        )
    return params, theta


def rope(default_theta: float = 10000.0, fraction: float | None = None, layout: str | None = None) -> D:
    """The spec's ``position``: RoPE at the config's theta, over the config's fraction of each head where the
    family rotates part of a head.

    Args:
        default_theta: the family's default theta.
        fraction: the family's default rotary fraction (``partial_rotary_factor``); None for a family that
            rotates whole heads (Llama's ``apply_rotary_pos_emb`` has no pass-through part), whose configs
            are refused a fraction other than 1.
        layout: the pairs' layout when not rotate-half (``interleaved``: Cohere, GPT-J).
    """

    def read(c: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
        params, theta = _theta(c, default_theta)
        key = "partial_rotary_factor"
        share = params.get(key, c.get(key, 1.0 if fraction is None else fraction))
        if fraction is None and share != 1.0:
            where = f"{params.prefix}{key}" if key in params.values else key
            raise c.refuse(where, share, f"{c.model_type} rotates whole heads", "use 1.0")
        position: dict[str, Any] = {"kind": "rope", "base": theta}
        if share != 1.0:
            position["fraction"] = share
        if layout is not None:
            position["layout"] = layout
        return position

    def write(position: Any, get: Callable[[str], Any]) -> dict[str, Any]:
        if not isinstance(position, dict) or position.get("kind") != "rope":
            return {}
        params = {"rope_type": "default", "rope_theta": position.get("base", default_theta)}
        if position.get("fraction", 1.0) != 1.0:
            params["partial_rotary_factor"] = position["fraction"]
        return {"rope_parameters": params}

    return D(read, ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"), write)


def head_dim(fixed: int | None = None) -> D:
    """``head_dim`` where it is not width / heads (given apart, or heads not dividing the width).

    Args:
        fixed: the class's default head_dim, where it is a number (Gemma's 256) and not width / heads.
    """

    def read(c: Config, spec: Mapping[str, Any]) -> int | None:
        width, heads = spec["decoder.width"], spec["decoder.block.heads"]
        hd = c.get("head_dim", fixed, int)
        if hd is None:
            return None
        return hd if hd * heads != width or width % heads else None

    def write(value: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
        return {"head_dim": value or get("decoder.width") // get("decoder.block.heads")}

    return D(read, ("head_dim",), write)


def sliding(
    default: int | None,
    pattern: Callable[[Config, int], bool],
    *,
    switch: tuple[str, bool] | None = None,
    fields: tuple[str, ...] = (),
) -> dict[str, D]:
    """The spec entries of windows that slide in some layers: those of type ``sliding_attention`` in the
    config's ``layer_types`` (Qwen2, Gemma 2), written as overrides of those layers (or as the block's
    window when every layer slides).

    Args:
        default: the class's default ``sliding_window``.
        pattern: (config, layer) -> whether it slides, as the class computes ``layer_types`` when a config
            leaves them out.
        switch: a field that turns the window off, and its default (Qwen2's ``use_sliding_window``).
        fields: the fields ``pattern`` reads.
    """

    def read(c: Config, depth: int) -> tuple[int | None, list[int]]:
        window = c.get("sliding_window", default, int)
        if switch is not None and not c.get(*switch):
            window = None
        if not listable(depth):  # the spec refuses the depth; nothing is made per layer of it
            return window, []
        types = c.get("layer_types", kind=list)
        if types is None:
            types = ["sliding_attention" if pattern(c, i) else "full_attention" for i in range(depth)]
        if len(types) != depth or not all(t in ("full_attention", "sliding_attention") for t in types):
            raise c.refuse(
                "layer_types",
                types,
                f"expected full_attention or sliding_attention for each of the {depth} layers",
                "give one type per layer",
            )
        return window, [i for i, t in enumerate(types) if t == "sliding_attention"]

    def block(c: Config, spec: Mapping[str, Any]) -> int | None:
        window, layers = read(c, spec["decoder.depth"])
        return window if len(layers) == spec["decoder.depth"] else None

    def overrides(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        window, layers = read(c, spec["decoder.depth"])
        if window is None or not layers or len(layers) == spec["decoder.depth"]:
            return None
        return [{"layers": layers, "block": {"sliding_window": window}}]

    def write(window: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
        """``sliding_window`` and ``layer_types`` of the block's window and the overrides of windows only."""
        depth = get("decoder.depth")
        layers = set(range(depth)) if window else set()
        for o in get("decoder.overrides") or []:
            if set(o["block"]) == {"sliding_window"} and o["block"]["sliding_window"] and o["layers"]:
                window, layers = o["block"]["sliding_window"], layers | {i % depth for i in o["layers"]}
        types = ["sliding_attention" if i in layers else "full_attention" for i in range(depth)]
        return {"sliding_window": window, "layer_types": types} | (
            {switch[0]: bool(layers)} if switch else {}
        )

    read_fields = ("sliding_window", "layer_types", *(switch[:1] if switch else ()), *fields)
    return {
        "decoder.block.sliding_window": D(block, read_fields, write),
        "decoder.overrides": D(overrides, read_fields),
    }


_LAYER = "layers.{i}."

LLAMA = register(
    Table(
        name="Llama",
        model_types=("llama",),
        role="decoder",
        keys=r"(?:model\.)?layers\.\d+\.mlp\.gate_proj\.",
        spec={
            "decoder.input.kind": "tokens",
            "decoder.input.vocab": F("vocab_size", 32000),
            "decoder.position": rope(),
            "decoder.width": F("hidden_size", 4096),
            "decoder.depth": F("num_hidden_layers", 32),
            "decoder.block.layers": ["masked_self_attention", "mlp"],
            "decoder.block.heads": count("num_attention_heads", 32),
            "decoder.block.kv_heads": F("num_key_value_heads", None, int),
            "decoder.block.head_dim": head_dim(),
            "decoder.block.norm.kind": "rmsnorm",
            "decoder.block.norm.eps": F("rms_norm_eps", 1e-6),
            "decoder.block.mlp.hidden": F("intermediate_size", 11008),
            "decoder.block.mlp.activation": F("hidden_act", "silu", map=GATED),
            "decoder.block.mlp.bias": F("mlp_bias", False),
            "decoder.block.qkv_bias": F("attention_bias", False),
            "decoder.block.proj_bias": F("attention_bias", False),
            "decoder.dropout.attention": F("attention_dropout", 0.0),
        },
        only=(
            Only("pretraining_tp", 1, (1,), "tensor-parallel slicing of the projections changes the sums"),
        ),
        names={
            "decoder.tok_embed": "embed_tokens",
            "decoder.blocks.{i}.norm1": _LAYER + "input_layernorm",
            "decoder.blocks.{i}.attn.qkv": tuple(_LAYER + f"self_attn.{n}_proj" for n in "qkv"),
            "decoder.blocks.{i}.attn.proj": _LAYER + "self_attn.o_proj",
            "decoder.blocks.{i}.attn.q_norm": _LAYER + "self_attn.q_norm",
            "decoder.blocks.{i}.attn.k_norm": _LAYER + "self_attn.k_norm",
            "decoder.blocks.{i}.norm2": _LAYER + "post_attention_layernorm",
            "decoder.blocks.{i}.mlp.fc1": (_LAYER + "mlp.gate_proj", _LAYER + "mlp.up_proj"),
            "decoder.blocks.{i}.mlp.fc2": _LAYER + "mlp.down_proj",
            "decoder.norm": "norm",
        },
        classes={
            "Model": BARE,
            "ForCausalLM": LM,
            "ForSequenceClassification": SEQUENCE,
            "ForTokenClassification": per_token(
                "score"
            ),  # GenericForTokenClassification: a bias, every token
        },
        ignore=(r".*rotary_emb\.inv_freq",),
    )
)

MISTRAL = register(
    LLAMA.but(
        "Mistral",
        ("mistral",),
        {
            "decoder.block.kv_heads": F("num_key_value_heads", 8),
            "decoder.block.mlp.hidden": F("intermediate_size", 14336),
            "decoder.block.mlp.bias": False,
            "decoder.block.qkv_bias": False,
            "decoder.block.proj_bias": False,
            "decoder.block.sliding_window": F("sliding_window", 4096, int),
        },
        drop=("pretraining_tp",),
    )
)
