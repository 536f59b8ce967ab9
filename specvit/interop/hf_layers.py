"""Families of the Llama-like decoder layout whose layers differ along the depth, each a table of what it
changes: SmolLM3 (rotary positions left out of every ``no_rope_layer_interval``-th layer), OLMo 3 and Gemma 3
(windows in most layers, a theta per layer type) and Command R7B / Cohere 2 (windows with rotary positions in
three layers of four, global layers without positions).

A layer's differences are spec ``overrides`` of those layers: ``rope: false`` for a layer without rotary
positions, ``sliding_window`` and a ``rope`` base of its own for a sliding layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.hf_decoders import GEMMA2, OLMO2
from specvit.interop.hf_decoders2 import COHERE, full_rope
from specvit.interop.hf_llama import LLAMA, rope, sliding
from specvit.interop.registry import Config, listable
from specvit.interop.table import BARE, SEQUENCE, D, F, Only, count, lm, register

__all__ = ["layer_types", "overrides", "per_type"]

Part = Callable[[Config, Mapping[str, Any]], list[dict[str, Any]] | None]


def overrides(*parts: Part | D, fields: tuple[str, ...] = ()) -> D:
    """The spec's ``overrides``: those of each part in turn (windows, then layers without rotary positions).

    Args:
        parts: (config, the spec read so far) -> overrides, or a :class:`D` of them.
        fields: the config fields the parts read.
    """

    def read(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        out = [o for p in parts for o in ((p.read(c, spec) if isinstance(p, D) else p(c, spec)) or [])]
        return out or None

    def write(value: list[dict[str, Any]] | None, get: Callable[[str], Any]) -> dict[str, Any]:
        """The config fields each part's inverse writes of the spec's overrides."""
        out: dict[str, Any] = {}
        for p in parts:
            if isinstance(p, D) and p.inverse is not None:
                out |= p.inverse(value, get)
        return out

    named = [f for p in parts if isinstance(p, D) for f in p.fields]
    return D(read, tuple(dict.fromkeys(named + list(fields))), write)


def layer_types(c: Config, depth: int, pattern: Callable[[Config, int], bool]) -> list[str]:
    """The config's ``layer_types`` (``full_attention`` or ``sliding_attention`` per layer), or those the class
    derives where a config leaves them out.

    Args:
        c: the config.
        depth: the stack's depth.
        pattern: (config, layer) -> whether the layer slides, as the class derives its layer types.
    """
    types = c.get("layer_types", kind=list)
    if types is None:
        return ["sliding_attention" if pattern(c, i) else "full_attention" for i in range(depth)]
    if len(types) != depth or not all(t in ("full_attention", "sliding_attention") for t in types):
        raise c.refuse(
            "layer_types",
            types,
            f"expected full_attention or sliding_attention for each of the {depth} layers",
            "give one type per layer",
        )
    return types


# -- SmolLM3 ---------------------------------------------------------------------------------------------


def _smol_rope(c: Config, depth: int) -> list[bool]:
    """Whether each layer rotates: ``no_rope_layers`` (1: rotary positions, 0: none), or one layer in every
    ``no_rope_layer_interval`` without."""
    flags = c.get("no_rope_layers", kind=list)
    if flags is None:
        interval = c.size("no_rope_layer_interval", 4)
        return [(i + 1) % interval != 0 for i in range(depth)]
    if len(flags) != depth or not all(f in (0, 1) for f in flags):
        raise c.refuse(
            "no_rope_layers", flags, f"expected 0 or 1 for each of the {depth} layers", "give one a layer"
        )
    return [bool(f) for f in flags]


def _smol_slides(c: Config, i: int) -> bool:
    """SmolLM3's default layer types: a window in the layers without rotary positions, if it has one."""
    depth = c.get("num_hidden_layers", 36)
    window = c.get("use_sliding_window", False) and c.get("sliding_window", None, int) is not None
    return bool(window) and not _smol_rope(c, depth)[i]


def _no_rope(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    depth = spec["decoder.depth"]
    if not listable(depth):
        return None
    layers = [i for i, rotates in enumerate(_smol_rope(c, depth)) if not rotates]
    return [{"layers": layers, "block": {"rope": False}}] if layers else None


def _write_no_rope(value: list[dict[str, Any]] | None, get: Callable[[str], Any]) -> dict[str, Any]:
    """``no_rope_layers`` of the overrides without rotary positions."""
    depth = get("decoder.depth")
    layers = {i % depth for o in value or [] if o["block"].get("rope") is False for i in o["layers"]}
    return {"no_rope_layers": [0 if i in layers else 1 for i in range(depth)]}


_SMOL_WINDOWS = sliding(
    None, _smol_slides, fields=("use_sliding_window", "no_rope_layers", "no_rope_layer_interval")
)

SMOLLM3 = register(
    LLAMA.but(
        "SmolLM3",
        ("smollm3",),
        {
            "decoder.input.vocab": F("vocab_size", 128256),
            "decoder.position": rope(2000000.0),
            "decoder.width": F("hidden_size", 2048),
            "decoder.depth": F("num_hidden_layers", 36),
            "decoder.block.heads": count("num_attention_heads", 16),
            "decoder.block.kv_heads": F("num_key_value_heads", 4),
            "decoder.block.mlp.hidden": F("intermediate_size", 11008),
            **_SMOL_WINDOWS,
            "decoder.overrides": overrides(
                _SMOL_WINDOWS["decoder.overrides"], D(_no_rope, ("no_rope_layers",), _write_no_rope)
            ),
        },
        drop=("pretraining_tp",),
        classes={"ForCausalLM": lm(tied=True)},
    )
)


# -- OLMo 3 ----------------------------------------------------------------------------------------------


def _theta(c: Config, layer_type: str, default: float) -> float:
    """The theta of one layer type's entry in ``rope_parameters`` (plain RoPE only)."""
    params = c.sub("rope_parameters")
    if params.values and not set(params.values) <= {"full_attention", "sliding_attention"}:
        raise c.refuse(
            "rope_parameters",
            params.values,
            f"{c.model_type} reads an entry per layer type (full_attention, sliding_attention)",
            "give rope_parameters by layer type",
        )
    entry = params.sub(layer_type)
    kind = entry.get("rope_type", "default")
    if kind != "default":
        raise c.refuse(
            f"rope_parameters.{layer_type}",
            entry.values,
            f"{kind} RoPE scaling has no specvit position kind",
            "use plain RoPE",
        )
    return float(entry.get("rope_theta", default))


def per_type(
    slides: Callable[[Config, int], bool], full: float, local: float, window: int, depth: tuple[str, int]
) -> dict[str, D]:
    """The entries of decoders with a theta per layer type (OLMo 3, Gemma 3): RoPE at the full layers' theta,
    and the sliding layers' window and theta as overrides (the block's, where every layer slides).

    Args:
        slides: (config, layer) -> whether it slides, the class's ``layer_types`` where a config has none.
        full: the class's default theta of the full layers.
        local: its default theta of the sliding layers.
        window: its default ``sliding_window``.
        depth: the depth's field and default (the position is read before the depth).
    """

    def types(c: Config, depth: int) -> list[str]:
        return layer_types(c, depth, slides)

    def position(c: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
        n = c.get(*depth)
        kinds = types(c, n) if listable(n) else ["full_attention"]
        kind = "full_attention" if "full_attention" in kinds else "sliding_attention"
        return {"kind": "rope", "base": _theta(c, kind, full if kind == "full_attention" else local)}

    def block(c: Config, spec: Mapping[str, Any]) -> int | None:
        n = spec["decoder.depth"]
        if not listable(n) or "full_attention" in types(c, n):
            return None
        return c.get("sliding_window", window, int)

    def layers(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        n = spec["decoder.depth"]
        if not listable(n):
            return None
        indexes = [i for i, t in enumerate(types(c, n)) if t == "sliding_attention"]
        if not indexes or len(indexes) == n:
            return None
        out: dict[str, Any] = {}
        if (w := c.get("sliding_window", window, int)) is not None:
            out["sliding_window"] = w
        if (theta := _theta(c, "sliding_attention", local)) != spec["decoder.position"]["base"]:
            out["rope"] = {"base": theta}
        return [{"layers": indexes, "block": out}] if out else None

    fields = ("sliding_window", "layer_types", "rope_parameters")
    return {
        "decoder.position": D(position, ("rope_parameters", "layer_types")),
        "decoder.block.sliding_window": D(block, fields),
        "decoder.overrides": D(layers, fields, _per_type_write),
    }


def _per_type_write(value: list[dict[str, Any]] | None, get: Callable[[str], Any]) -> dict[str, Any]:
    """The window, layer types and thetas of the spec's sliding layers: every layer where the block has the
    window, else those of the override naming a window or a theta."""
    depth, base = get("decoder.depth"), get("decoder.position")["base"]
    window, theta, layers = get("decoder.block.sliding_window"), base, set(range(depth))
    if window is None:
        local = [o for o in value or [] if {"sliding_window", "rope"} & set(o["block"])]
        layers = {i % depth for o in local for i in o["layers"]}
        window = next((o["block"]["sliding_window"] for o in local if "sliding_window" in o["block"]), None)
        theta = next((o["block"]["rope"]["base"] for o in local if "rope" in o["block"]), base)
    params = {
        t: {"rope_type": "default", "rope_theta": v}
        for t, v in (("full_attention", base), ("sliding_attention", theta))
    }
    types = ["sliding_attention" if i in layers else "full_attention" for i in range(depth)]
    return {"sliding_window": window, "layer_types": types, "rope_parameters": params}


OLMO3 = register(
    OLMO2.but(
        "Olmo3",
        ("olmo3",),
        per_type(lambda c, i: (i + 1) % 4 != 0, 500000.0, 500000.0, 4096, ("num_hidden_layers", 32)),
    )
)


def _gemma3_slides(c: Config, i: int) -> bool:
    """Gemma 3's default layer types: one full layer in every ``sliding_window_pattern``."""
    pattern = c.size("sliding_window_pattern", c.get("_sliding_window_pattern", 6))
    return bool((i + 1) % pattern)


GEMMA3 = register(
    GEMMA2.but(
        "Gemma3",
        ("gemma3_text",),
        {
            "decoder.input.vocab": F("vocab_size", 262208),
            "decoder.block.qk_norm": "head",  # Gemma's RMSNorm over each head's channels, shared by the heads
            "decoder.block.attention_softcap": None,
            **per_type(_gemma3_slides, 1000000.0, 10000.0, 4096, ("num_hidden_layers", 26)),
        },
        drop=("Model", "ForSequenceClassification", "ForTokenClassification"),
        only=(
            Only(
                "attn_logit_softcapping",
                None,
                (None,),
                "transformers' default (SDPA) attention leaves it out and its eager attention applies it: no one "
                "model to state",
            ),
        ),
        inert=("sliding_window_pattern", "_sliding_window_pattern"),  # read for layer_types a config lacks
        classes={
            "TextModel": BARE,
            "ForCausalLM": lm(tied=True, softcap=F("final_logit_softcapping", None, float)),
            "TextForSequenceClassification": SEQUENCE,
        },
    )
)


# -- Cohere 2 --------------------------------------------------------------------------------------------


def _cohere2_slides(c: Config, i: int) -> bool:
    return bool((i + 1) % c.size("sliding_window_pattern", 4))


def _cohere2_no_rope(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Cohere 2 rotates in its sliding layers only (none at all without a window)."""
    depth = spec["decoder.depth"]
    if not listable(depth):
        return None
    types = layer_types(c, depth, _cohere2_slides)
    window = c.get("sliding_window", 4096, int)
    layers = [i for i, t in enumerate(types) if t == "full_attention" or window is None]
    return [{"layers": layers, "block": {"rope": False}}] if layers else None


_COHERE2_WINDOWS = sliding(4096, _cohere2_slides, fields=("sliding_window_pattern",))

COHERE2 = register(
    COHERE.but(
        "Cohere2",
        ("cohere2",),
        {
            "decoder.position": full_rope(10000.0, "interleaved"),
            "decoder.block.kv_heads": F("num_key_value_heads", None, int),
            **_COHERE2_WINDOWS,
            "decoder.overrides": overrides(_COHERE2_WINDOWS["decoder.overrides"], _cohere2_no_rope),
        },
        drop=("use_qk_norm",),
    )
)
