"""timm's ``VisionTransformerSAM`` (ViTDet, Li et al. 2022; Segment Anything's image encoder, Kirillov et al.
2023): padded windows with global blocks at ``global_attn_indexes``, decomposed relative positions, the neck.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Entry, Layout, check_blocks, one
from specvit.interop.timm import Reader, TimmFamily, timm_family
from specvit.interop.timm_vit import image_input
from specvit.spec.schema import Spec

__all__ = ["sam_layout"]


def _block(r: Reader, path: str) -> dict[str, Any]:
    """The fields of one timm SAM ``Block`` that every block must share (its window is read apart)."""
    for part, name in (("", "Block"), (".attn", "Attention"), (".mlp", "Mlp")):
        if type(r.at(path + part)).__name__ != name:
            raise r.refuse(path + part, type(r.at(path + part)).__name__, f"specvit reads timm's {name}", "")
    attn = f"{path}.attn"
    if r.at(f"{attn}.rope") is not None:
        raise r.refuse(f"{attn}.rope", "RotaryEmbeddingCat", "specvit's ViTDet windows have no rotary", "")
    r.absent(f"{attn}.q_norm", "ViTDet's attention in specvit has no QK-norm (qk_norm)")
    r.absent(f"{path}.mlp.norm", "a norm inside the MLP")
    heads = r.at(f"{attn}.num_heads")
    norm = r.norm(f"{path}.norm1")
    if r.norm(f"{path}.norm2") != norm:
        raise r.refuse(f"{path}.norm2", r.norm(f"{path}.norm2"), "norm2 differs from norm1", "")
    if r.at(f"{attn}.proj").bias is None or (r.at(f"{path}.mlp.fc1").bias is None):
        raise r.refuse(f"{attn}.proj.bias", None, "timm's SAM blocks have these biases", "")
    block: dict[str, Any] = {
        "heads": heads,
        "layers": ["self_attention", "mlp"],
        "norm": {**norm, "placement": "pre"},
        "mlp": {
            "hidden": r.at(f"{path}.mlp.fc1").out_features,
            "activation": r.activation(f"{path}.mlp.act"),
        },
        "qkv_bias": r.at(f"{attn}.qkv").bias is not None,
        "attention_scale": r.scale(attn, r.at(f"{attn}.head_dim")),
        "rel_pos": bool(r.at(f"{attn}.use_rel_pos")),
    }
    ls = r.at(f"{path}.ls1")
    if type(ls).__name__ == "LayerScale":
        block["layer_scale"] = float(ls.init_values)
    return block


def _neck(r: Reader) -> dict[str, Any]:
    """The ``head:`` of the neck and timm's ``ClassifierHead``."""
    m = r.model
    neck = m.neck
    if type(neck).__name__ == "LayerNorm2d":
        head: dict[str, Any] = {"kind": "neck", "channels": None, "eps": float(neck.eps)}
    else:
        if type(neck).__name__ != "Sequential" or [type(x).__name__ for x in neck] != [
            "Conv2d",
            "LayerNorm2d",
            "Conv2d",
            "LayerNorm2d",
        ]:
            raise r.refuse("neck", type(neck).__name__, "specvit reads SAM's conv neck or a LayerNorm2d", "")
        r.same(["neck.1", "neck.3"], lambda p: float(r.at(p).eps), "LayerNorm2d eps")
        head = {"kind": "neck", "channels": neck[0].out_channels, "eps": float(neck[1].eps)}
    pool = r.only("head.global_pool.pool_type", ["avg", ""], "specvit averages the map or returns it")
    head["pool"] = "mean" if pool == "avg" else "none"
    if m.num_classes:
        if pool != "avg":
            raise r.refuse("global_pool", pool, "a classifier reads the averaged map", "global_pool='avg'")
        if r.dropout("head.drop"):
            raise r.refuse("head.drop", r.dropout("head.drop"), "the neck head has no dropout", "drop_rate=0")
        head["classes"] = m.num_classes
    return head


def _global_blocks(indexes: list[int], depth: int) -> dict[str, Any]:
    """The stack keys making blocks ``indexes`` global: a schedule when they are every k-th block ending
    each period (timm's presets: 2, 5, 8, 11), else overrides."""
    if not indexes:
        return {}
    variant = {"global": {"window": None}}
    period = indexes[0] + 1
    if indexes == list(range(period - 1, depth, period)):
        windowed = [{"block": period - 1}] if period > 1 else []
        return {"schedule": [*windowed, "global"], "blocks": variant}
    return {"overrides": [{"layers": indexes, "block": {"window": None}}]}


def _sam(r: Reader) -> dict[str, Any]:
    m = r.model
    blocks = [f"blocks.{i}" for i in range(len(m.blocks))]
    block = r.same(blocks, lambda b: _block(r, b), "block")
    rel_pos = block.pop("rel_pos")
    sizes = [int(r.at(f"{b}.window_size")) for b in blocks]
    windowed = sorted({s for s in sizes if s})
    if len(windowed) > 1:
        raise r.refuse("blocks", windowed, "specvit's ViTDet blocks share one window size", "one window_size")
    depth: dict[str, Any] = {}
    if windowed:
        block["window"] = {"size": windowed[0], "shift": False, "bias": False, "pad": True}
        depth = _global_blocks([i for i, s in enumerate(sizes) if not s], len(blocks))
    positions: list[Any] = (["learned"] if m.pos_embed is not None else []) + (
        ["relative_decomposed"] if rel_pos else []
    )
    pre_norm = type(m.norm_pre).__name__ != "Identity"
    if pre_norm and r.norm("norm_pre") != {k: v for k, v in block["norm"].items() if k != "placement"}:
        raise r.refuse("norm_pre", r.norm("norm_pre"), "specvit's norms outside blocks are the blocks'", "")
    stack = {
        "input": image_input(r),
        "position": positions if len(positions) > 1 else (positions or ["none"])[0],
        "width": m.embed_dim,
        "depth": len(blocks),
        "block": block,
        **depth,
        "dropout": {
            "embedding": r.dropout("pos_drop"),
            "attention": r.dropout("blocks.0.attn.attn_drop"),
            "projection": r.dropout("blocks.0.attn.proj_drop"),
            "mlp": r.dropout("blocks.0.mlp.drop1"),
        },
        "drop_path": r.drop_path(blocks),
        "embed_norm": pre_norm,
        "final_norm": False,
    }
    return {
        "specvit": 1,
        "name": "timm_vision_transformer_sam",
        "description": "timm VisionTransformerSAM (ViTDet, SAM), imported by specvit.from_timm.",
        "model": "encoder",
        "encoder": stack,
        "head": _neck(r),
    }


def sam_layout(spec: Spec, keys: Sequence[str]) -> Layout:
    """timm ``VisionTransformerSAM`` keys: positions as a (1, rows, cols, C) grid, the neck at ``neck``."""
    name = "timm VisionTransformerSAM"
    check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "pre")
    block, layer = "encoder.blocks.{i}.", "blocks.{i}."
    table: dict[str, Entry] = {
        "encoder.patch_embed.proj.{p}": one("patch_embed.proj.{p}"),
        "encoder.pos_embed.weight": one("pos_embed", lambda ts: ts[0].flatten(1, 2)),  # (1, gh*gw, C)
        "encoder.embed_norm.{p}": one("norm_pre.{p}"),
        "head.fc.{p}": one("head.fc.{p}"),
    }
    for part in ("norm1", "attn.qkv", "attn.proj", "ls1", "norm2", "mlp.fc1", "mlp.fc2", "ls2"):
        table[block + part + ".{p}"] = one(layer + part + ".{p}")
    for table_name in ("rel_pos_h", "rel_pos_w"):
        table[block + "attn." + table_name] = one(layer + "attn." + table_name)
    if "neck.weight" in keys:  # neck_chans=None: one LayerNorm2d
        table["head.neck.0.{p}"] = one("neck.{p}")
    else:
        for k in range(4):
            table[f"head.neck.{k}.{{p}}"] = one(f"neck.{k}.{{p}}")
    return Layout(name, table)


timm_family(
    TimmFamily(
        classes=("VisionTransformerSAM",),
        modules=frozenset(
            {"PatchEmbed", "Block", "Attention", "Mlp", "LayerScale", "LayerNorm2d"}
            | {"GELU", "GELUTanh", "QuickGELU", "SiLU", "ReLU"}
            | {"ClassifierHead", "SelectAdaptivePool2d", "AdaptiveAvgPool2d", "Flatten"}
        ),
        keys=r"neck\.|blocks\.\d+\.attn\.rel_pos_h",
        spec=_sam,
        layout=sam_layout,
    )
)
