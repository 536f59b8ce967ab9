"""timm's ``Cait`` (Touvron et al. 2021, "Going deeper with Image Transformers").

A CaiT is a stack of ``depth`` talking-heads self-attention blocks over the patch tokens, then
``depth_token_only`` class-attention blocks that update a class token entering only there. In a spec: a
base block with ``talking_heads: true``, a ``class`` variant with ``layers: [class_attention, mlp]``,
``schedule: [{block: depth}, {class: depth_token_only}]`` and ``prefix: {cls: true, at: depth}``; the
class-attention blocks are ``encoder.blocks.{depth + j}`` (timm's ``blocks_token_only.{j}``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specvit.interop.layout import Entry, Layout, one, patches, same
from specvit.interop.timm import Reader, TimmFamily, timm_family
from specvit.interop.timm_vit import image_input, mlp_spec
from specvit.spec.schema import ImageInput, Spec

__all__ = ["cait_layout"]

_SA_CLASS, _CA_CLASS = "LayerScaleBlock", "LayerScaleBlockClassAttn"


def _block(r: Reader, path: str, kind: str, attn: str) -> dict[str, Any]:
    """The spec of one CaiT block: ``kind`` is its timm class, ``attn`` its attention's class."""
    if type(r.at(path)).__name__ != kind:
        raise r.refuse(path, type(r.at(path)).__name__, f"specvit reads CaiT's {kind} here", f"use {kind}")
    if type(r.at(f"{path}.attn")).__name__ != attn:
        raise r.refuse(f"{path}.attn", type(r.at(f"{path}.attn")).__name__, f"CaiT's {kind} has a {attn}", "")
    if r.norm(f"{path}.norm2") != r.norm(f"{path}.norm1"):
        raise r.refuse(f"{path}.norm2", r.norm(f"{path}.norm2"), "norm2 differs from norm1", "")
    gammas = [r.at(f"{path}.gamma_{k}") for k in (1, 2)]
    if any(g.dim() != 1 for g in gammas):
        raise r.refuse(f"{path}.gamma_1", "not per channel", "specvit's layer scale is per channel", "")
    heads = r.at(f"{path}.attn.num_heads")
    projection = r.at(f"{path}.attn.qkv" if attn == "TalkingHeadAttn" else f"{path}.attn.q")
    head_dim = r.at(f"{path}.attn.proj").in_features // heads
    rate = float(getattr(r.at(f"{path}.drop_path"), "drop_prob", 0.0))
    if rate:
        raise r.refuse(
            f"{path}.drop_path.drop_prob",
            rate,
            "CaiT's stochastic depth is one rate for every self-attention block; specvit's rises from 0",
            "build the model with drop_path_rate=0",
        )
    return {
        "heads": heads,
        "head_dim": head_dim,
        "norm": {**r.norm(f"{path}.norm1"), "placement": "pre"},
        "mlp": mlp_spec(r, f"{path}.mlp"),
        "qkv_bias": projection.bias is not None,
        "proj_bias": r.at(f"{path}.attn.proj").bias is not None,
        "attention_scale": r.scale(f"{path}.attn", head_dim),
    }


def _layer_scale(r: Reader, blocks: Sequence[str]) -> float:
    """The layer scale's init value: every gamma's value while they are all one value (an untrained model),
    else 1e-5 (timm's CaiT-24 init_values): trained weights do not say it, and it changes no output."""
    values = {
        float(v) for b in blocks for k in (1, 2) for v in r.at(f"{b}.gamma_{k}").detach().flatten().tolist()
    }
    return float(f"{values.pop():.7g}") if len(values) == 1 else 1e-5  # as written, not its float32


def _cait(r: Reader) -> dict[str, Any]:
    m = r.model
    r.only("global_pool", ["token", "avg"], "specvit pools by the class token or the mean of the patches")
    sa = [f"blocks.{i}" for i in range(len(m.blocks))]
    ca = [f"blocks_token_only.{i}" for i in range(len(m.blocks_token_only))]
    block = r.same(sa, lambda b: _block(r, b, _SA_CLASS, "TalkingHeadAttn"), "block")
    block |= {"talking_heads": True, "layer_scale": _layer_scale(r, sa + ca)}
    variant: dict[str, Any] = {}
    if ca:
        cls_block = r.same(ca, lambda b: _block(r, b, _CA_CLASS, "ClassAttn"), "block")
        if (cls_block["heads"], cls_block["head_dim"]) != (block["heads"], block["head_dim"]):
            raise r.refuse(ca[0] + ".attn.num_heads", cls_block["heads"], "heads differ between stages", "")
        variant = {k: v for k, v in cls_block.items() if block.get(k) != v and k not in ("heads", "head_dim")}
        variant |= {"layers": ["class_attention", "mlp"], "talking_heads": False}
    if block["head_dim"] * block["heads"] == m.embed_dim:
        block["head_dim"] = None  # the default: width / heads
    if r.norm("norm") != {k: v for k, v in block["norm"].items() if k != "placement"}:
        raise r.refuse("norm", r.norm("norm"), "specvit's final norm is the blocks' norm", "")
    stack: dict[str, Any] = {
        "input": image_input(r),
        "prefix": {"cls": True, "at": len(sa)},
        "position": {"kind": "learned", "include_prefix": False},
        "width": m.embed_dim,
        "depth": len(sa) + len(ca),
        "block": block,
        "dropout": {
            "embedding": r.dropout("pos_drop"),
            "attention": r.dropout("blocks.0.attn.attn_drop"),
            "projection": r.dropout("blocks.0.attn.proj_drop"),
            "mlp": r.dropout("blocks.0.mlp.drop1"),
        },
    }
    if ca:
        stack["blocks"] = {"class": variant}
        stack["schedule"] = [{"block": len(sa)}, {"class": len(ca)}]
    return {
        "specvit": 1,
        "name": "timm_cait",
        "description": "timm Cait, imported by specvit.from_timm.",
        "model": "encoder",
        "encoder": stack,
        "head": {
            "kind": "classifier",
            **r.classifier(),
            "pool": {"token": "cls", "avg": "mean"}[m.global_pool],
            "dropout": r.dropout("head_drop"),
        },
    }


@dataclass
class CaitLayout(Layout):
    """timm's names: ``blocks.{i}`` for the self-attention blocks, ``blocks_token_only.{j}`` for the
    class-attention blocks specvit numbers ``blocks.{depth + j}``.

    Args:
        depth: the number of self-attention blocks (the stack's ``prefix.at``).
    """

    depth: int = 0

    def sources(self, target: str) -> Entry | None:
        match = re.search(r"\.blocks\.(\d+)\.", target)
        if match is None or int(match.group(1)) < self.depth:
            return super().sources(target)
        j = int(match.group(1)) - self.depth
        rest = target[match.end() :]
        part, _, param = rest.rpartition(".")
        for ours, theirs in (("ls1", "gamma_1"), ("ls2", "gamma_2")):
            if part == ours:
                return (f"blocks_token_only.{j}.{theirs}",), same
        return (f"blocks_token_only.{j}.{part}.{param}",), same


def cait_layout(spec: Spec, keys: Sequence[str]) -> Layout:
    """timm ``Cait`` keys: ``cls_token``, ``pos_embed`` over the patches, ``blocks.{i}`` (talking heads:
    ``attn.proj_l`` / ``attn.proj_w``; layer scale: ``gamma_1`` / ``gamma_2``), ``blocks_token_only.{j}``."""
    stack = spec.stacks[spec.output_stack]
    if spec.model != "encoder" or not isinstance(stack.input, ImageInput):
        raise ValueError(
            f"source 'timm' converts Cait state dicts (image encoders); {spec.name!r} is not one"
        )
    depth = stack.facts.prefix_at
    block, layer = "encoder.blocks.{i}.", "blocks.{i}."
    table: dict[str, Entry] = {
        "encoder.patch_embed.proj.{p}": one(
            "patch_embed.proj.{p}", patches if stack.input.projection == "linear" else same
        ),
        "encoder.prefix.cls_token": one("cls_token"),
        "encoder.pos_embed.weight": one("pos_embed"),
        "encoder.norm.{p}": one("norm.{p}"),
        "head.fc.{p}": one("head.{p}"),
        block + "ls1.gamma": one(layer + "gamma_1"),
        block + "ls2.gamma": one(layer + "gamma_2"),
    }
    for part in (
        "norm1",
        "attn.qkv",
        "attn.proj",
        "attn.proj_l",
        "attn.proj_w",
        "norm2",
        "mlp.fc1",
        "mlp.fc2",
    ):
        table[block + part + ".{p}"] = one(layer + part + ".{p}")
    return CaitLayout("timm Cait", table, depth=depth)


timm_family(
    TimmFamily(
        classes=("Cait",),
        modules=frozenset(
            {"PatchEmbed", _SA_CLASS, _CA_CLASS, "TalkingHeadAttn", "ClassAttn", "Mlp"}
            | {"GELU", "GELUTanh", "QuickGELU", "SiLU", "ReLU"}
        ),
        keys=r"blocks_token_only\.\d+\.|blocks\.\d+\.attn\.proj_l\.",
        spec=_cait,
        layout=cait_layout,
    )
)
