"""timm's ``SwinTransformerV2`` (Liu et al. 2022): Swin's stages and shifted windows (read by
:func:`~specvit.interop.timm_swin.swin_common`), with the residual post-norm, cosine attention, the
continuous position bias MLP, q and v biases without a k bias, and patch merging's norm after its linear."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Layout, check_blocks
from specvit.interop.timm import Reader, TimmFamily, timm_family
from specvit.interop.timm_swin import swin_common, swin_table
from specvit.spec.schema import Spec

__all__ = ["swinv2_layout"]


def _attention(r: Reader, blocks: list[str]) -> dict[str, Any]:
    """The window's V2 fields and the block's qkv biases, read off every block's attention."""
    for b in blocks:
        cpb = r.at(f"{b}.attn.cpb_mlp")
        if len(cpb) != 3 or cpb[0].in_features != 2 or cpb[0].bias is None or cpb[2].bias is not None:
            raise r.refuse(f"{b}.attn.cpb_mlp", cpb, "specvit's bias MLP is timm's 2 -> hidden -> heads", "")
        r.only(f"{b}.attn.qkv_bias_separate", [False], "specvit adds the biases inside the projection")
    hidden = r.same(blocks, lambda b: r.at(f"{b}.attn.cpb_mlp.0").out_features, "cpb_mlp width")
    qv = r.same(blocks, lambda b: r.at(f"{b}.attn.q_bias") is not None, "qkv bias")
    stages = sorted({b.rsplit(".blocks.", 1)[0] for b in blocks}, key=lambda s: int(s.split(".")[1]))
    pretrained = []
    for s in stages:
        mine = [b for b in blocks if b.startswith(f"{s}.blocks.")]
        side = r.same(mine, lambda b: tuple(r.at(f"{b}.attn.pretrained_window_size")), "pretrained window")
        if side[0] != side[1]:
            raise r.refuse(
                f"{mine[0]}.attn.pretrained_window_size", side, "specvit's windows are square", "one int"
            )
        pretrained.append(int(side[0]))
    window: dict[str, Any] = {"bias": "cpb", "cosine": True, "cpb_hidden": hidden}
    if any(pretrained):
        window["pretrained"] = pretrained
    return {"window": window, "qkv_bias": [True, False, True] if qv else False}


def _head(r: Reader) -> dict[str, Any]:
    m = r.model
    classes = m.num_classes or None  # 0: the pooled features
    return {"kind": "classifier", "pool": "mean", "classes": classes, "dropout": r.dropout("head.drop")}


def _swinv2(r: Reader) -> dict[str, Any]:
    blocks, stack = swin_common(r)
    block = stack["block"]
    v2 = _attention(r, blocks)
    block["window"].update(v2["window"])
    block["qkv_bias"] = v2["qkv_bias"]
    norm = r.same(blocks, lambda b: r.norm(f"{b}.norm1"), "norm")
    block["norm"] = {**norm, "placement": "res_post"}
    stack["merge_norm"] = "post"
    return {
        "specvit": 1,
        "name": "timm_swin_transformer_v2",
        "description": "timm SwinTransformerV2, imported by specvit.from_timm.",
        "model": "encoder",
        "encoder": stack,
        "head": _head(r),
    }


def swinv2_layout(spec: Spec, keys: Sequence[str]) -> Layout:
    """timm ``SwinTransformerV2`` keys."""
    name = "timm SwinTransformerV2"
    stack = check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "res_post")
    own = ("attn.cpb_mlp.0.{p}", "attn.cpb_mlp.2.{p}", "attn.q_bias", "attn.v_bias", "attn.logit_scale")
    table = swin_table(stack, own)
    # buffers some timm versions save: derived from the window size, recomputed by specvit
    ignore = (
        r"layers\.\d+\.blocks\.\d+\.attn\.(relative_position_index|relative_coords_table|k_bias)",
        r"layers\.\d+\.blocks\.\d+\.attn_mask",
    )
    return Layout(name, table, ignore)


timm_family(
    TimmFamily(
        classes=("SwinTransformerV2",),
        modules=frozenset(
            {"PatchEmbed", "SwinTransformerV2Stage", "SwinTransformerV2Block", "WindowAttention"}
            | {"PatchMerging", "Mlp", "GELU", "ReLU", "Softmax", "ClassifierHead", "SelectAdaptivePool2d"}
            | {"FastAdaptiveAvgPool"}
        ),
        keys=r"layers\.\d+\.blocks\.\d+\.attn\.cpb_mlp\.",
        spec=_swinv2,
        layout=swinv2_layout,
    )
)
