"""The names people bring from timm, HF transformers, x-transformers and PyTorch, as data: each foreign key
with the specvit key it is and where that goes, and the foreign values of a key (``pool: gap``) with
specvit's. :mod:`specvit.spec.messages` turns them into hints for unknown keys and values."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specvit.spec.navigate import holders
from specvit.spec.yamlread import KeyPath, dotted

__all__ = ["FOREIGN_KEYS", "FOREIGN_VALUES", "Foreign", "foreign_key_hint", "foreign_value_hint"]


@dataclass(frozen=True)
class Foreign:
    """Another library's name for a specvit key.

    Args:
        target: the specvit key, dotted from the section holding its first part (``width``, ``mlp.ratio``).
        source: who names it so, for the message (``timm``, ``HF``, ``x-transformers``, ``PyTorch``).
        values: the library's values as specvit's (``{True: "pre"}``); a value not listed is shown as given
            if it is a number or a boolean, else as ``example``.
        example: the value to show when the one given cannot be.
        also: keys written beside the target (``{"kind": "rope"}`` for a RoPE base).
        note: said after the fix.
    """

    target: str
    source: str
    values: Mapping[Any, Any] = field(default_factory=dict)
    example: str = "..."
    also: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""


_NORMS = {"LayerNorm": "layernorm", "nn.LayerNorm": "layernorm", "RMSNorm": "rmsnorm", "RmsNorm": "rmsnorm"}
_ACTS = {"GELU": "gelu", "nn.GELU": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_ACTS |= {"SiLU": "silu", "nn.SiLU": "silu", "swish": "silu", "ReLU": "relu", "nn.ReLU": "relu"}
_POOLS = {"avg": "mean", "token": "cls", "map": "attention"}
_GATED = "a gated MLP (Llama's) is swiglu"
_PLACEMENT = {True: "pre", False: "post"}

FOREIGN_KEYS: dict[str, Foreign] = {
    # timm
    "embed_dim": Foreign("width", "timm"),
    "num_heads": Foreign("heads", "timm"),
    "mlp_ratio": Foreign("mlp.ratio", "timm"),
    "norm_layer": Foreign("norm.kind", "timm", _NORMS, "layernorm"),
    "act_layer": Foreign("mlp.activation", "timm", _ACTS, "gelu"),
    "img_size": Foreign("input.size", "timm"),
    "patch_size": Foreign("input.patch", "timm"),
    "in_chans": Foreign("input.channels", "timm"),
    "num_classes": Foreign("head.classes", "timm"),
    "global_pool": Foreign("head.pool", "timm", _POOLS, "mean"),
    "class_token": Foreign("prefix.cls", "timm"),
    "reg_tokens": Foreign("prefix.registers", "timm"),
    "init_values": Foreign("layer_scale", "timm"),
    "drop_path_rate": Foreign("drop_path", "timm"),
    "drop_rate": Foreign("head.dropout", "timm"),
    "pos_drop_rate": Foreign("dropout.embedding", "timm"),
    "attn_drop_rate": Foreign("dropout.attention", "timm"),
    "proj_drop_rate": Foreign("dropout.projection", "timm"),
    "fc_norm": Foreign("head.norm", "timm"),
    "window_size": Foreign("window.size", "timm"),
    # HF transformers
    "hidden_size": Foreign("width", "HF"),
    "d_model": Foreign("width", "HF and PyTorch"),
    "n_embd": Foreign("width", "HF GPT-2"),
    "num_hidden_layers": Foreign("depth", "HF"),
    "num_layers": Foreign("depth", "HF"),
    "n_layer": Foreign("depth", "HF GPT-2"),
    "num_attention_heads": Foreign("heads", "HF"),
    "n_head": Foreign("heads", "HF GPT-2"),
    "num_key_value_heads": Foreign("kv_heads", "HF"),
    "intermediate_size": Foreign("mlp.hidden", "HF"),
    "d_ff": Foreign("mlp.hidden", "HF T5"),
    "n_inner": Foreign("mlp.hidden", "HF GPT-2"),
    "hidden_act": Foreign("mlp.activation", "HF", _ACTS, "gelu", note=_GATED),
    "layer_norm_eps": Foreign("norm.eps", "HF"),
    "layer_norm_epsilon": Foreign("norm.eps", "HF"),
    "rms_norm_eps": Foreign("norm.eps", "HF"),
    "vocab_size": Foreign("input.vocab", "HF"),
    "type_vocab_size": Foreign("input.type_vocab", "HF"),
    "pad_token_id": Foreign("input.padding_idx", "HF"),
    "image_size": Foreign("input.size", "HF"),
    "num_channels": Foreign("input.channels", "HF"),
    "num_labels": Foreign("head.classes", "HF"),
    "tie_word_embeddings": Foreign("head.tied", "HF"),
    "rope_theta": Foreign("position.base", "HF", also={"kind": "rope"}),
    "attention_probs_dropout_prob": Foreign("dropout.attention", "HF"),
    "num_local_experts": Foreign("mlp.moe.experts", "HF"),
    "num_experts_per_tok": Foreign("mlp.moe.top_k", "HF"),
    # x-transformers
    "dim": Foreign("width", "x-transformers"),
    "dim_head": Foreign("head_dim", "x-transformers"),
    "attn_dim_head": Foreign("head_dim", "x-transformers"),
    "attn_kv_heads": Foreign("kv_heads", "x-transformers"),
    "ff_mult": Foreign("mlp.ratio", "x-transformers"),
    "ff_glu": Foreign("mlp.activation", "x-transformers", {True: "geglu", False: "gelu"}, "geglu"),
    "num_tokens": Foreign("input.vocab", "x-transformers"),
    "use_rmsnorm": Foreign("norm.kind", "x-transformers", {True: "rmsnorm", False: "layernorm"}, "rmsnorm"),
    "pre_norm": Foreign("norm.placement", "x-transformers", _PLACEMENT, "pre"),
    "sandwich_norm": Foreign("norm.placement", "x-transformers", {True: "sandwich"}, "sandwich"),
    "rotary_pos_emb": Foreign("position", "x-transformers", {True: "rope"}, "rope"),
    "alibi_pos_bias": Foreign("position", "x-transformers", {True: "alibi"}, "alibi"),
    "emb_dropout": Foreign("dropout.embedding", "x-transformers"),
    "attn_dropout": Foreign("dropout.attention", "x-transformers"),
    "ff_dropout": Foreign("dropout.mlp", "x-transformers"),
    # PyTorch nn.Transformer
    "nhead": Foreign("heads", "PyTorch"),
    "dim_feedforward": Foreign("mlp.hidden", "PyTorch"),
    "norm_first": Foreign("norm.placement", "PyTorch", _PLACEMENT, "pre"),
}
"""Foreign key -> what it is in specvit. Only names that are no specvit key: a specvit key in the wrong
section is placed by its own name (``depth belongs under encoder``)."""

FOREIGN_VALUES: dict[str, dict[str, tuple[str, str]]] = {
    "pool": {
        "gap": ("mean", "global average pooling"),
        "avg": ("mean", "timm's global average pool"),
        "average": ("mean", "average pooling"),
        "token": ("cls", "timm's class-token pool"),
        "cls_token": ("cls", "the class-token pool"),
        "first": ("cls", "the first token's pool"),
        "map": ("attention", "timm's attention pool (SigLIP's head)"),
        "attn": ("attention", "the attention pool"),
    },
}
"""Key -> foreign value -> (specvit's value, what the foreign one is called)."""


def foreign_value_hint(key: Any, value: Any) -> str:
    """The fix for another library's value of ``key`` (``pool: gap`` -> ``write pool: mean``), or ``""``.

    Args:
        key: the key the value was given for.
        value: the value.
    """
    known = FOREIGN_VALUES.get(str(key), {})
    if not isinstance(value, str) or value.lower() not in known:
        return ""
    ours, what = known[value.lower()]
    return f"{value} is {what}: write {key}: {ours}"


def foreign_key_hint(key: Any, value: Any, parent: KeyPath, data: Any) -> tuple[str, KeyPath] | None:
    """The fix for another library's key written at ``parent``, and the specvit key path it stands for.

    ``embed_dim: 192`` under ``encoder`` gives ``("timm's embed_dim is encoder.width: write width: 192",
    ("encoder", "width"))``: the path lets the caller drop a "missing key" problem for the same key.

    Args:
        key: the unknown key.
        value: its value in the spec.
        parent: the key path of the section it was written in.
        data: the spec's data.
    """
    entry = FOREIGN_KEYS.get(str(key))
    if entry is None:
        return None
    first, *rest = entry.target.split(".")
    places = holders(first, parent, data)
    if not places:
        return None
    shown = _value(entry, value)
    meant: KeyPath = (*places[0], first, *rest)
    full = " or ".join(dotted((*p, first, *rest)) for p in places)
    whose = f"{entry.source}'" if entry.source.endswith("s") else f"{entry.source}'s"
    hint = f"{whose} {key} is {full}: write "
    if len(places) > 1:
        hint += f"{_nested([first, *rest], shown, entry.also)} under {' or '.join(map(dotted, places))}"
    else:
        depth = _deepest_mapping(data, meant)  # the sections of the target the spec has already
        hint += _nested(list(meant[depth:]), shown, entry.also)
        if meant[:depth] != parent:
            hint += f" under {dotted(meant[:depth]) or 'the top level'}"
    return hint + (f" ({entry.note})" if entry.note else ""), meant


def _value(entry: Foreign, value: Any) -> str:
    """The value to write, as YAML: mapped, or as given if a number, a boolean or a plain word (``silu``),
    else the example."""
    if isinstance(value, str | bool | int | float) and value in entry.values:
        value = entry.values[value]
    if isinstance(value, bool | int | float):
        return _scalar(value)
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][\w.-]{0,63}", value):
        return value
    return entry.example


def _scalar(value: bool | int | float) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    if e and "." not in mantissa:  # YAML reads 1e-06 as a string, 1.0e-06 as a number
        text = f"{mantissa}.0e{exponent}"
    return text


def _nested(parts: list[str | int], value: str, also: Mapping[str, Any]) -> str:
    """``mlp: {ratio: 4}`` for the parts ``mlp, ratio`` and the value ``4``; ``also`` beside the last key."""
    items = ", ".join([*(f"{k}: {v}" for k, v in also.items()), f"{parts[-1]}: {value}"])
    if len(parts) == 1:
        return items
    text = f"{{{items}}}"
    for part in reversed(parts[1:-1]):
        text = f"{{{part}: {text}}}"
    return f"{parts[0]}: {text}"


def _deepest_mapping(data: Any, path: KeyPath) -> int:
    """How many leading parts of ``path`` (not its last) lead to mappings the data has."""
    depth, node = 0, data
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            break
        depth += 1
    return depth
