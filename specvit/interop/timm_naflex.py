"""timm's ``NaFlexVit`` (Beyer et al. 2023's NaViT recipe in timm): a ViT whose one learned position table,
kept at its own grid (16 x 16), is resampled to the patch grid of each image size.

Read for an image input of a fixed size (the model's ``pretrained_cfg`` input size: timm's standard
``(B, C, H, W)`` path). The NaFlex path (pre-patchified sequences of mixed sizes with ``patch_coord`` and
``patch_valid``) is a batching of many sizes at once, not another architecture. The patches are flattened
as timm's ``batch_patchify`` flattens them: (row, col, channel) with ``channels_last``, else (channel, row,
col); the layout turns the first into the convolution specvit's patch embedding is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from specvit.interop.layout import Layout, Undoable, one
from specvit.interop.timm import Reader, TimmFamily, timm_family
from specvit.interop.timm_vit import VIT_MODULES, vit_block, vit_head, vit_layout, vit_stack
from specvit.spec.schema import ImageInput, Spec

__all__ = ["naflex_layout", "naflex_spec"]


def _input(r: Reader) -> dict[str, Any]:
    """The ``input:`` of NaFlexEmbeds at the model's pretrained input size."""
    e = "embeds"
    for flag, why in (
        ("dynamic_img_pad", "specvit pads nothing"),
        ("enable_patch_interpolator", "a patch size that changes per call"),
    ):
        r.only(f"{e}.{flag}", [False], why)
    r.absent(f"{e}.norm_input", "a norm of the pixels of each patch has no spec")
    r.absent(f"{e}.norm", "a norm between the patch projection and the positions has no spec")
    channels, height, width = r.model.pretrained_cfg["input_size"]
    patch = tuple(r.at(f"{e}.patch_size"))
    proj = r.at(f"{e}.proj")
    linear = r.at(f"{e}.is_linear")
    if not linear and tuple(proj.stride) != patch:
        raise r.refuse(f"{e}.proj.stride", proj.stride, "overlapping patches", "stride = patch size")
    return {
        "kind": "image",
        "size": height if height == width else [height, width],
        "patch": patch[0] if patch[0] == patch[1] else list(patch),
        "channels": channels,
        "bias": proj.bias is not None,
        # (channel, row, col) flattening is specvit's linear projection; (row, col, channel) is turned into
        # the convolution by the layout
        **({"projection": "linear"} if linear and not r.at(f"{e}.channels_last") else {}),
    }


def _position(r: Reader) -> Any:
    """The learned table at its own grid, resampled as ``NaFlexEmbeds._apply_learned_pos_embed`` does."""
    e = "embeds"
    kind = r.at(f"{e}.pos_embed_type")
    if kind == "none":
        return "none"
    r.only(f"{e}.pos_embed_type", ["learned", "none"], "specvit resamples one 2D table, not two 1D ones")
    r.only(f"{e}.pos_embed_align_corners", [False], "specvit resamples without aligned corners")
    r.only(f"{e}.pos_embed_interp_mode", ["bicubic", "bilinear"], "specvit resamples bicubic or bilinear")
    table = r.at(f"{e}.pos_embed")
    grid = [int(table.shape[1]), int(table.shape[2])]
    _, height, width = r.model.pretrained_cfg["input_size"]
    ph, pw = tuple(r.at(f"{e}.patch_size"))
    if r.at(f"{e}.pos_embed_ar_preserving") and height // ph != width // pw:  # timm crops a square table
        raise r.refuse(
            f"{e}.pos_embed_ar_preserving", True, "a square resampling cropped to a non-square grid", ""
        )
    return {
        "kind": "learned",
        "include_prefix": False,  # added to the patches before the class and register tokens
        "grid": {
            "size": grid,
            "mode": r.at(f"{e}.pos_embed_interp_mode"),
            "antialias": bool(r.at(f"{e}.pos_embed_antialias")),
        },
    }


def naflex_spec(r: Reader) -> dict[str, Any]:
    """The spec fields of a timm ``NaFlexVit`` of standard blocks."""
    m = r.model
    r.only("global_pool", ["token", "avg", "map", ""], "specvit pools by the class token, mean or a probe")
    if m.global_pool == "map" and m.num_prefix_tokens:  # the probe then reads the patches only
        r.only("pool_include_prefix", [True], "specvit's probe reads every token, the prefix too")
    elif m.global_pool == "avg":  # the class token's pool reads token 0 whatever the flag
        r.only("pool_include_prefix", [False], "specvit's mean pool leaves the prefix tokens out")
    blocks = [f"blocks.{i}" for i in range(len(m.blocks))]
    block = r.same(blocks, lambda b: vit_block(r, b), "block")
    return {
        "specvit": 1,
        "name": "timm_naflexvit",
        "description": "timm NaFlexVit at a fixed image size, imported by specvit.from_timm.",
        "model": "encoder",
        "encoder": {
            "input": _input(r),
            "prefix": {"cls": m.has_class_token, "registers": m.num_reg_tokens},
            "position": _position(r),
            **vit_stack(r, blocks, block, "embeds.pos_drop"),
        },
        "head": vit_head(r, block),
    }


def _patches(patch: tuple[int, int]) -> Undoable:
    """NaFlex's linear patch weight, its inputs flattened (row, col, channel), as specvit's convolution."""
    ph, pw = patch

    def forward(t: Tensor) -> Tensor:
        if t.ndim != 2:
            return t  # a bias, or timm's own convolution
        return t.reshape(t.shape[0], ph, pw, -1).permute(0, 3, 1, 2)  # (D, ph*pw*C) -> (D, C, ph, pw)

    def backward(t: Tensor) -> Tensor:
        return t.permute(0, 2, 3, 1).flatten(1) if t.ndim == 4 else t  # (D, C, ph, pw) -> (D, ph*pw*C)

    return Undoable(forward, backward)


def naflex_layout(spec: Spec, keys: Sequence[str]) -> Layout:
    """timm ``NaFlexVit`` keys: ViT's blocks and head, with the embedding under ``embeds.``."""
    table = dict(vit_layout(spec, keys).table)
    image = spec.stacks[spec.output_stack].input
    assert isinstance(image, ImageInput)  # vit_layout refuses any other
    assert image.patch is not None  # a timm ViT has patches
    linear = image.projection == "linear"  # (channel, row, col) flattened as specvit's linear projection
    table |= {
        "encoder.patch_embed.proj.{p}": one("embeds.proj.{p}", *(() if linear else (_patches(image.patch),))),
        "encoder.prefix.cls_token": one("embeds.cls_token"),
        "encoder.prefix.reg_token": one("embeds.reg_token"),
        "encoder.pos_embed.weight": one("embeds.pos_embed"),
    }
    return Layout("timm NaFlexVit", table)


timm_family(
    TimmFamily(
        classes=("NaFlexVit",),
        modules=VIT_MODULES | {"NaFlexEmbeds"},
        keys=r"embeds\.proj\.",
        spec=naflex_spec,
        layout=naflex_layout,
    )
)
