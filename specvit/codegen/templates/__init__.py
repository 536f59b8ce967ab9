"""The plain layers ``specvit eject`` writes in place of the compiled model's (:mod:`specvit.codegen.eject`).

The compiled model's layers (:mod:`specvit.nn`) serve every spec and carry what running fast takes (oneDNN
linears, packed weights, export layouts). An ejected file should read as if a person wrote it for one
model, so each common layer has a plain counterpart here: a class with ``nn.Linear``, ``nn.LayerNorm``,
``nn.Dropout`` and ``F.scaled_dot_product_attention``, whose features are flags the ejector folds away, or
a torch module itself (``Linear`` is ``nn.Linear``). A counterpart takes a layer only when it computes the
same outputs, bit for bit, for the layer's arguments: :meth:`Template.adapt` says which arguments it
takes, and a layer using anything else is ejected from its own source, specialised.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from torch import nn

from specvit.codegen.templates.attention import Attention, CrossAttention
from specvit.codegen.templates.decoding import DecoderGenerate, EncoderDecoderGenerate, KVCache, next_token
from specvit.codegen.templates.layers import (
    GluMlp,
    LearnedPosition,
    Mlp,
    PatchEmbed,
    PrefixTokens,
    TokenEmbed,
)

__all__ = [
    "DecoderGenerate",
    "EncoderDecoderGenerate",
    "KVCache",
    "Template",
    "next_token",
    "template_for",
]

Adapt = Callable[[dict[str, Any]], dict[str, Any] | None]


@dataclass(frozen=True)
class Template:
    """A plain stand-in for one library class.

    Args:
        target: the library class (``"specvit.nn.mlp:Mlp"``).
        cls: the plain class (a template to specialise, or a torch module used as it is).
        adapt: the library constructor's arguments -> the plain class's, or None when it cannot stand in.
    """

    target: str
    cls: type
    adapt: Adapt


@cache
def _library_defaults(target: str) -> dict[str, Any]:
    from specvit.codegen.build import resolve

    params = inspect.signature(resolve(target)).parameters.values()
    return {p.name: p.default for p in params if p.default is not p.empty}


def _take(
    kwargs: dict[str, Any], cls: type, target: str, rename: dict[str, str] | None = None
) -> dict | None:
    """The arguments of ``cls`` from the library's ``kwargs`` (renamed by ``rename``), every one it lacks at the
    library's default; None when an argument it lacks is set otherwise (a feature it does not compute)."""
    rename = rename or {}
    params = inspect.signature(cls).parameters
    defaults = _library_defaults(target)
    out = {}
    for key, value in kwargs.items():
        name = rename.get(key, key)
        if name in params:
            out[name] = value
        elif key not in defaults or not _same(defaults[key], value):
            return None
    for name, param in params.items():  # what the library does not say is the plain class's default
        if param.default is not param.empty and param.kind is not param.VAR_KEYWORD:
            out.setdefault(name, param.default)
    return out


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def _heads(kw: dict[str, Any]) -> dict[str, Any]:
    """Head widths and counts the plain attention derives left unsaid (None)."""
    if kw.get("num_kv_heads") == kw["num_heads"]:
        kw["num_kv_heads"] = None
    if kw.get("head_dim") is not None and kw["dim"] % kw["num_heads"] == 0:
        kw["head_dim"] = None if kw["head_dim"] == kw["dim"] // kw["num_heads"] else kw["head_dim"]
    return kw


def _attention(cross: bool) -> Adapt:
    def adapt(kwargs: dict[str, Any]) -> dict[str, Any] | None:
        kw = dict(kwargs)
        if (kw.get("memory_dim") is not None) != cross:
            return None
        bias = kw.get("qkv_bias", True)
        if isinstance(bias, tuple):
            if len(set(bias)) == 1:
                kw["qkv_bias"] = bias[0]
            elif tuple(bias) == (True, False, True) and not cross:  # BEiT, EVA-02, Whisper
                kw["qkv_bias"], kw["qv_bias"] = False, True
            else:
                return None
        if not cross:
            kw.pop("memory_dim", None)
        cls = CrossAttention if cross else Attention
        return _take(_heads(kw), cls, "specvit.nn.attention:Attention")

    return adapt


def _mlp(cls: type, target: str, activations: tuple[str, ...]) -> Adapt:
    def adapt(kwargs: dict[str, Any]) -> dict[str, Any] | None:
        if kwargs.get("activation", "gelu" if cls is Mlp else "swiglu") not in activations:
            return None
        return _take(kwargs, cls, target)

    return adapt


def _patch_embed(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    kw = {k: v for k, v in kwargs.items() if k != "img_size"}  # the grid follows from the image
    return _take(kw, PatchEmbed, "specvit.nn.embed:PatchEmbed")


def _token_embed(scaled: bool) -> Adapt:
    def adapt(kwargs: dict[str, Any]) -> dict[str, Any] | None:
        if bool(kwargs.get("scale", False)) != scaled:
            return None
        kw = {k: v for k, v in kwargs.items() if k != "scale"}
        if scaled:
            return _take(kw, TokenEmbed, "specvit.nn.embed:TokenEmbed")
        return _take(
            kw,
            nn.Embedding,
            "specvit.nn.embed:TokenEmbed",
            {"vocab": "num_embeddings", "dim": "embedding_dim"},
        )

    return adapt


def _same_names(cls: type, target: str) -> Adapt:
    return lambda kwargs: _take(kwargs, cls, target)


TEMPLATES: tuple[Template, ...] = (
    Template("specvit.nn.attention:Attention", Attention, _attention(False)),
    Template("specvit.nn.attention:Attention", CrossAttention, _attention(True)),
    Template(
        "specvit.nn.mlp:Mlp", Mlp, _mlp(Mlp, "specvit.nn.mlp:Mlp", ("gelu", "gelu_tanh", "relu", "silu"))
    ),
    Template(
        "specvit.nn.mlp:GluMlp",
        GluMlp,
        _mlp(GluMlp, "specvit.nn.mlp:GluMlp", ("swiglu", "geglu", "geglu_tanh")),
    ),
    Template("specvit.nn.embed:PatchEmbed", PatchEmbed, _patch_embed),
    Template(
        "specvit.nn.embed:PrefixTokens",
        PrefixTokens,
        _same_names(PrefixTokens, "specvit.nn.embed:PrefixTokens"),
    ),
    Template(
        "specvit.nn.position:LearnedPosition",
        LearnedPosition,
        _same_names(LearnedPosition, "specvit.nn.position:LearnedPosition"),
    ),
    Template("specvit.nn.embed:TokenEmbed", TokenEmbed, _token_embed(True)),
    Template("specvit.nn.embed:TokenEmbed", nn.Embedding, _token_embed(False)),
    Template("specvit.nn.linear:Linear", nn.Linear, _same_names(nn.Linear, "specvit.nn.linear:Linear")),
    Template("specvit.nn.layers:Dropout", nn.Dropout, _same_names(nn.Dropout, "specvit.nn.layers:Dropout")),
)
"""Every plain stand-in, by the library class it replaces (first match wins)."""


def template_for(target: str, kwargs: dict[str, Any]) -> tuple[type, dict[str, Any]] | None:
    """The plain class standing in for library class ``target`` built with ``kwargs``, and its arguments;
    None when none computes that layer.

    Args:
        target: ``"module:Class"`` of the library class.
        kwargs: the arguments the compiled model builds it with.
    """
    for t in TEMPLATES:
        if t.target == target and (args := t.adapt(kwargs)) is not None:
            return t.cls, args
    return None
