"""PVT v1 (``PvtModel``, ``PvtForImageClassification``; Wang et al. 2021): stages of free widths, each opened by
a non-overlapping patch embedding (a conv whose kernel is its stride, a LayerNorm) and a learned position table of
the stage's grid (``block.absolute_position`` on each stage's first block), the class token entering the last stage
(``prefix.at``) with a row of that stage's table, spatial-reduction attention and plain MLPs.

HF sizes each later stage's table as if the grid halved from a 4x4 first patch (``image_size // 2 ** (i + 1)``
divided by the stage's patch); a config whose convs leave other grids is refused, as HF itself cannot run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.hf_pvt import block_table, stage_fields
from specvit.interop.layout import Entry, Layout, check_blocks, one, prefix
from specvit.interop.registry import Config, Family, activation, family

__all__: list[str] = []

_DEFAULTS = {
    "depths": [2, 2, 2, 2],
    "sequence_reduction_ratios": [8, 4, 2, 1],
    "hidden_sizes": [64, 128, 320, 512],
    "patch_sizes": [4, 2, 2, 2],
    "strides": [4, 2, 2, 2],
    "num_attention_heads": [1, 2, 5, 8],
    "mlp_ratios": [8, 8, 4, 4],
}
"""PvtConfig's per-stage defaults (pvt-tiny's)."""


def _stages(c: Config) -> dict[str, list[Any]]:
    """The per-stage fields, one entry per stage each; refused where the spec (or HF) cannot state them."""
    out = stage_fields(c, _DEFAULTS)
    size, grid = c.get("image_size", 224), c.get("image_size", 224)
    for i, (patch, kernel) in enumerate(zip(out["patch_sizes"], out["strides"], strict=True)):
        grid = (grid - kernel) // patch + 1
        table = (size if i == 0 else size // 2 ** (i + 1)) // patch
        if grid != table:
            why = f"stage {i}'s grid is {grid}x{grid} and HF sizes its position table for {table}x{table}"
            raise c.refuse("patch_sizes", out["patch_sizes"], why, "use PVT's patch sizes [4, 2, 2, 2]")
    return out


def _spec(c: Config) -> dict[str, Any]:
    st = _stages(c)
    eps = c.get("layer_norm_eps", 1e-6)
    norm = {"kind": "norm", "type": "layer", "eps": eps}
    (k0, *ks), (s0, *ss), ratios = st["strides"], st["patch_sizes"], st["mlp_ratios"]
    depths, widths = st["depths"], st["hidden_sizes"]
    starts = [sum(depths[:i]) for i in range(len(depths))]
    overrides: list[dict[str, Any]] = [
        {"stages": [i for i, r in enumerate(ratios) if r == ratio], "block": {"mlp": {"ratio": ratio}}}
        for ratio in dict.fromkeys(ratios[1:])
        if ratio != ratios[0]
    ]
    overrides.append({"layers": starts, "block": {"absolute_position": "learned"}})  # each stage's table
    labels = c.get("id2label", kind=dict) or {}
    classes = len(labels) or c.get("num_labels", 1000)  # PvtConfig keeps num_labels itself
    classify = "PvtForImageClassification" in (c.get("architectures", kind=list) or [])
    return {
        "specvit": 1,
        "name": "pvt_from_hf",
        "description": "PVT v1 (PvtModel; Wang et al. 2021), imported from its transformers config.",
        "model": "encoder",
        "encoder": {
            "input": {
                "kind": "image",
                "size": c.get("image_size", 224),
                "channels": c.get("num_channels", 3),
                "stem": [{"kind": "conv", "channels": widths[0], "kernel": k0, "stride": s0}, norm],
            },
            "position": "none",
            "prefix": {"cls": True, "at": starts[-1]},
            "width": widths[0],
            "widths": widths,
            "depth": depths,
            **({"downsample": [{"kind": "conv", "kernel": ks[0], "stride": ss[0]}, norm]} if ks else {}),
            "block": {
                "heads": st["num_attention_heads"],
                "spatial_reduction": st["sequence_reduction_ratios"],
                "qkv_bias": bool(c.get("qkv_bias", True)),
                "norm": {"eps": eps},
                "mlp": {"ratio": ratios[0], "activation": activation(c, default="gelu")},
            },
            "overrides": overrides,
        },
        "head": {"kind": "classifier", "pool": "cls", "classes": classes} if classify else "none",
    }


def _block(pre: str, s: int) -> dict[str, Entry]:
    """The table of stage ``s``'s blocks: PVT v2's layout under v1's names, and the stage's position table."""
    names = {
        "attention": "attention.self.",
        "sr": "sequence_reduction",
        "proj": "attention.output.dense",
        "pos_embed": f"{pre}encoder.patch_embeddings.{s}.position_embeddings",
    }
    return block_table(f"encoder.stages.{s}.blocks.{{i}}.", f"{pre}encoder.block.{s}.{{i}}.", names)


def _layout(spec: Any, keys: Sequence[str]) -> Layout:
    name = "HF PvtModel / PvtForImageClassification"
    stages = len(check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "pre").stage_depths)
    pre = prefix(keys, "pvt.")
    embed = [f"{pre}encoder.patch_embeddings.{s}." for s in range(stages)]
    table: dict[str, Entry] = {
        "encoder.stem.0.{p}": one(embed[0] + "projection.{p}"),
        "encoder.stem.1.{p}": one(embed[0] + "layer_norm.{p}"),
        "encoder.prefix.cls_token": one(embed[-1] + "cls_token"),
        "encoder.norm.{p}": one(f"{pre}encoder.layer_norm.{{p}}"),
        "head.fc.{p}": one("classifier.{p}"),
    }
    for s in range(stages):
        table |= _block(pre, s)
        if s:
            table[f"encoder.stages.{s}.downsample.0.{{p}}"] = one(embed[s] + "projection.{p}")
            table[f"encoder.stages.{s}.downsample.1.{{p}}"] = one(embed[s] + "layer_norm.{p}")
    return Layout(name, table)


family(
    Family(
        "PvtModel",
        ("pvt",),
        r"(pvt\.)?encoder\.patch_embeddings\.\d+\.position_embeddings",
        _spec,
        _layout,
    )
)
