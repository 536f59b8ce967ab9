"""timm's ``SwinTransformer`` (Liu et al. 2021; timm >= 0.9 layout: patch merging at the start of stages 1..)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Entry, Layout, check_blocks, one
from specvit.interop.timm import Reader, TimmFamily, timm_family
from specvit.ops.grid import block_window
from specvit.spec.schema import Spec, StackSpec

__all__ = ["swin_common", "swin_table"]


def _windows(r: Reader, blocks: list[str], size: int) -> None:
    """Every block's window and shift must be those of specvit's rules (a square window of the stage's
    smaller side when the grid is smaller than the window); timm shrinks each side on its own."""
    for b in blocks:
        block = r.at(b)
        grid = tuple(block.input_resolution)
        m, shift = block_window(size, True, grid, int(b.rsplit(".", 1)[1]))
        if tuple(block.window_size) != (m, m) or tuple(block.shift_size) != (shift, shift):
            raise r.refuse(
                f"{b}.window_size",
                (tuple(block.window_size), tuple(block.shift_size)),
                f"on its {grid[0]}x{grid[1]} grid specvit's window is {m}x{m} shifted by {shift}",
                "use an image size whose stage grids are larger than the window on both sides, or square",
            )


def swin_common(r: Reader) -> tuple[list[str], dict[str, Any]]:
    """What every timm Swin shares: its block paths, and the stack fields read from its patch embedding,
    stages, windows and head (the block's attention and norm placement are the caller's).

    Args:
        r: the model's reader.
    """
    m = r.model
    if m.dynamic_img_size:
        raise r.refuse("dynamic_img_size", True, "specvit's windows and masks are built for one size", "")
    if not isinstance(m.embed_dim, int):
        raise r.refuse("embed_dim", m.embed_dim, "specvit's stages double the width", "give one int")
    stages = [f"layers.{s}" for s in range(len(m.layers))]
    blocks = [f"{s}.blocks.{i}" for s in stages for i in range(len(r.at(s).blocks))]
    windows = {tuple(w) for w in m._ref_window_sizes}
    if len(windows) != 1 or len(set(next(iter(windows)))) != 1:
        raise r.refuse("window_size", m._ref_window_sizes, "specvit has one square window", "one int")
    size = next(iter(windows))[0]
    for b in blocks:
        r.only(f"{b}.always_partition", [False], "specvit's windows cover a stage smaller than the window")
    _windows(r, blocks, size)
    ratio = r.same(blocks, lambda b: r.at(f"{b}.mlp.fc1").out_features / r.at(b).dim, "MLP ratio")
    r.only("head.global_pool.pool_type", ["avg"], "specvit's Swin head pools by the mean")
    image = r.at("patch_embed")
    size_px, patch = tuple(image.img_size), tuple(image.patch_size)
    stack = {
        "input": {
            "kind": "image",
            "size": size_px[0] if size_px[0] == size_px[1] else list(size_px),
            "patch": patch[0] if patch[0] == patch[1] else list(patch),
            "channels": m.in_chans,
        },
        "position": "none",
        "width": m.embed_dim,
        "depth": [len(r.at(s).blocks) for s in stages],
        "block": {
            "heads": [r.at(f"{s}.blocks.0.attn.num_heads") for s in stages],
            "layers": ["self_attention", "mlp"],
            "window": {"size": size, "shift": True},
            "mlp": {
                "ratio": ratio,
                "activation": r.same(blocks, lambda b: r.activation(f"{b}.mlp.act"), "act"),
            },
            "qkv_bias": r.same(blocks, lambda b: r.at(f"{b}.attn.qkv").bias is not None, "qkv bias"),
        },
        "dropout": {"attention": r.dropout(f"{blocks[0]}.attn.attn_drop")},
        "drop_path": r.drop_path(blocks),
        "embed_norm": type(image.norm).__name__ != "Identity",
        "final_norm": True,
    }
    return blocks, stack


def _head(r: Reader) -> dict[str, Any] | str:
    m = r.model
    classes = m.num_classes or None  # 0: the pooled features
    return {"kind": "classifier", "pool": "mean", "classes": classes, "dropout": r.dropout("head.drop")}


def _swin(r: Reader) -> dict[str, Any]:
    blocks, stack = swin_common(r)
    norm = r.same(blocks, lambda b: r.norm(f"{b}.norm1"), "norm")
    stack["block"]["norm"] = {**norm, "placement": "pre"}
    for b in blocks:
        head_dim = r.at(f"{b}.attn.qkv").out_features // (3 * r.at(f"{b}.attn.num_heads"))
        if head_dim * r.at(f"{b}.attn.num_heads") != r.at(b).dim:
            raise r.refuse(f"{b}.attn.head_dim", head_dim, "specvit's Swin heads split the width", "")
    return {
        "specvit": 1,
        "name": "timm_swin_transformer",
        "description": "timm SwinTransformer, imported by specvit.from_timm.",
        "model": "encoder",
        "encoder": stack,
        "head": _head(r),
    }


def swin_table(stack: StackSpec, block_params: Sequence[str]) -> dict[str, Entry]:
    """The keys every timm Swin names as specvit does: patch embedding, final norm, head, each stage's patch
    merging and its blocks' norms, projections and MLP, plus ``block_params``: each block's parameters or
    modules (``{p}`` for a module's parameters) named alike, such as ``attn.relative_position_bias_table``.

    Args:
        stack: the spec's encoder.
        block_params: the version's own per-block parameter names.
    """
    table: dict[str, Entry] = {
        "encoder.patch_embed.proj.{p}": one("patch_embed.proj.{p}"),
        "encoder.embed_norm.{p}": one("patch_embed.norm.{p}"),
        "encoder.norm.{p}": one("norm.{p}"),
        "head.fc.{p}": one("head.fc.{p}"),
    }
    for s in range(len(stack.facts.stages)):
        ours, theirs = f"encoder.stages.{s}.", f"layers.{s}."
        for part in ("downsample.norm", "downsample.reduction"):
            table[ours + part + ".{p}"] = one(theirs + part + ".{p}")
        for part in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            table[ours + "blocks.{i}." + part + ".{p}"] = one(theirs + "blocks.{i}." + part + ".{p}")
        for param in block_params:
            table[ours + "blocks.{i}." + param] = one(theirs + "blocks.{i}." + param)
    return table


def swin_layout(spec: Spec, keys: Sequence[str]) -> Layout:
    """timm ``SwinTransformer`` keys."""
    name = "timm SwinTransformer"
    check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "pre")
    table = swin_table(spec.stacks["encoder"], ("attn.relative_position_bias_table",))
    # buffers some timm versions save: derived from the window size, recomputed by specvit
    ignore = (
        r"layers\.\d+\.blocks\.\d+\.attn\.relative_position_index",
        r"layers\.\d+\.blocks\.\d+\.attn_mask",
    )
    return Layout(name, table, ignore)


timm_family(
    TimmFamily(
        classes=("SwinTransformer",),
        modules=frozenset(
            {"PatchEmbed", "SwinTransformerStage", "SwinTransformerBlock", "WindowAttention", "PatchMerging"}
            | {"Mlp", "GELU", "Softmax", "ClassifierHead", "SelectAdaptivePool2d", "FastAdaptiveAvgPool"}
        ),
        keys=r"layers\.\d+\.blocks\.\d+\.attn\.relative_position_bias_table",
        spec=_swin,
        layout=swin_layout,
    )
)
