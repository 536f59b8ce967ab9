"""PVT v2 (``PvtV2Model``, ``PvtV2ForImageClassification``; Wang et al. 2022): stages of free widths, each
opened by an overlapping patch embedding (the image's ``stem``, then the stack's ``downsample`` after the
previous stage's closing norm), spatial-reduction attention and the Mix-FFN.

The spec writes one ``downsample`` for every later stage, so their patch sizes and strides must agree;
PVT v2-Li (``linear_attention``) pools its keys and values to 7x7 instead and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Entry, Layout, cat, check_blocks, one, prefix
from specvit.interop.registry import Config, Family, activation, family

__all__ = ["block_table", "stage_fields"]

_DEFAULTS = {
    "depths": [2, 2, 2, 2],
    "sr_ratios": [8, 4, 2, 1],
    "hidden_sizes": [32, 64, 160, 256],
    "patch_sizes": [7, 3, 3, 3],
    "strides": [4, 2, 2, 2],
    "num_attention_heads": [1, 2, 5, 8],
    "mlp_ratios": [8, 8, 4, 4],
}
"""PvtV2Config's per-stage defaults (pvt_v2_b0's)."""


def _image_size(c: Config) -> int | list[int]:
    """PvtV2Config's ``image_size``: one side, or [height, width]."""
    size = c.get("image_size", 224, kind=object)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, list | tuple) and len(size) == 2 and all(type(v) is int and v > 0 for v in size):
        return list(size)
    raise c.refuse(
        "image_size", size, "an image size is one side or [height, width]", "give 224 or [224, 224]"
    )


def stage_fields(c: Config, defaults: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A PVT config's per-stage fields, one entry per stage each (``num_encoder_blocks``); the patch
    embeddings after the first share one kernel and stride, as the spec's one ``downsample`` does.

    Args:
        c: the config.
        defaults: the config class's per-stage defaults, by field.
    """
    n = c.get("num_encoder_blocks", 4)
    out = {key: list(c.get(key, default)) for key, default in defaults.items()}
    for key, values in out.items():
        if len(values) != n:
            raise c.refuse(key, values, f"num_encoder_blocks is {n}", f"give {n} values, one per stage")
    for key in ("patch_sizes", "strides"):
        if len(set(out[key][1:])) > 1:
            why = "the patch embeddings after the first share one kernel and stride in a spec"
            raise c.refuse(key, out[key], why, "give every stage after the first the same value")
    return out


def _stages(c: Config) -> dict[str, list[Any]]:
    """The per-stage fields, one entry per stage each; refused where the spec cannot state them."""
    if c.get("linear_attention", False):
        raise c.refuse(
            "linear_attention",
            True,
            "PVT v2-Li pools keys and values to 7x7 with a GELU and adds a ReLU to its MLP, which no spec states",
            "use linear_attention: false (spatial-reduction attention, pvt_v2_b0 .. b5)",
        )
    return stage_fields(c, _DEFAULTS)


def _spec(c: Config) -> dict[str, Any]:
    st = _stages(c)
    eps = c.get("layer_norm_eps", 1e-6)
    norm = {"kind": "norm", "type": "layer", "eps": eps}
    (k0, *ks), (s0, *ss), ratios = st["patch_sizes"], st["strides"], st["mlp_ratios"]
    later = [{"kind": "conv", "kernel": ks[0], "stride": ss[0], "padding": ks[0] // 2}] if ks else []
    overrides = [
        {"stages": [i for i, r in enumerate(ratios) if r == ratio], "block": {"mlp": {"ratio": ratio}}}
        for ratio in dict.fromkeys(ratios[1:])
        if ratio != ratios[0]
    ]
    labels = c.get("id2label", kind=dict) or {}
    classify = "PvtV2ForImageClassification" in (c.get("architectures", kind=list) or [])
    widths = st["hidden_sizes"]
    stem = {"kind": "conv", "channels": widths[0], "kernel": k0, "stride": s0, "padding": k0 // 2}
    return {
        "specvit": 1,
        "name": "pvt_v2_from_hf",
        "description": "PVT v2 (PvtV2Model; Wang et al. 2022), imported from its transformers config.",
        "model": "encoder",
        "encoder": {
            "input": {
                "kind": "image",
                "size": _image_size(c),
                "channels": c.get("num_channels", 3),
                "stem": [stem, norm],
            },
            "position": "none",
            "width": widths[0],
            "widths": widths,
            "depth": st["depths"],
            **({"downsample": [norm, *later, norm]} if later else {}),
            "block": {
                "heads": st["num_attention_heads"],
                "spatial_reduction": st["sr_ratios"],
                "qkv_bias": bool(c.get("qkv_bias", True)),
                "norm": {"eps": eps},
                "mlp": {"ratio": ratios[0], "activation": activation(c, default="gelu"), "dwconv": True},
            },
            **({"overrides": overrides} if overrides else {}),
        },
        "head": {"kind": "classifier", "pool": "mean", "classes": len(labels)}
        if classify
        else {"kind": "map"},
    }


def block_table(ours: str, layer: str, names: dict[str, str]) -> dict[str, Entry]:
    """The rename table of one stage's blocks, shared by PVT v1 and v2: the same layout under each version's
    names.

    Args:
        ours: the blocks' key prefix (``encoder.stages.1.blocks.{i}.``).
        layer: HF's (``encoder.layers.1.blocks.{i}.``).
        names: HF's names under ``layer``: ``attention`` (the prefix of query, key and value), ``sr``,
            ``proj``, and for the parts one version has, ``dwconv`` and ``pos_embed`` (a full key).
    """
    attention = layer + names["attention"]
    kv = (attention + "key.{p}", attention + "value.{p}")
    table = {
        ours + "norm1.{p}": one(layer + "layer_norm_1.{p}"),
        ours + "attn.qkv.{p}": ((attention + "query.{p}", *kv), cat),
        ours + "attn.q.{p}": one(attention + "query.{p}"),
        ours + "attn.kv.{p}": (kv, cat),
        ours + "attn.sr.{p}": one(attention + names["sr"] + ".{p}"),
        ours + "attn.norm.{p}": one(attention + "layer_norm.{p}"),
        ours + "attn.proj.{p}": one(layer + names["proj"] + ".{p}"),
        ours + "norm2.{p}": one(layer + "layer_norm_2.{p}"),
        ours + "mlp.fc1.{p}": one(layer + "mlp.dense1.{p}"),
        ours + "mlp.fc2.{p}": one(layer + "mlp.dense2.{p}"),
    }
    if "dwconv" in names:
        table[ours + "mlp.dwconv.{p}"] = one(layer + names["dwconv"] + ".{p}")
    if "pos_embed" in names:
        table[ours + "pos_embed.weight"] = one(names["pos_embed"])
    return table


_V2_NAMES = {
    "attention": "attention.",
    "sr": "spatial_reduction",
    "proj": "attention.proj",
    "dwconv": "mlp.dwconv.dwconv",
}
"""HF PVT v2's names in a block."""


def _block(pre: str, s: int) -> dict[str, Entry]:
    """The table of stage ``s``'s blocks."""
    return block_table(
        f"encoder.stages.{s}.blocks.{{i}}.", f"{pre}encoder.layers.{s}.blocks.{{i}}.", _V2_NAMES
    )


def _layout(spec: Any, keys: Sequence[str]) -> Layout:
    name = "HF PvtV2Model / PvtV2ForImageClassification"
    stages = len(check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "pre").stage_depths)
    pre = prefix(keys, "pvt_v2.")
    embed = [f"{pre}encoder.layers.{s}.patch_embedding." for s in range(stages)]
    closing = [f"{pre}encoder.layers.{s}.layer_norm.{{p}}" for s in range(stages)]  # each stage's last norm
    table: dict[str, Entry] = {
        "encoder.stem.0.{p}": one(embed[0] + "proj.{p}"),
        "encoder.stem.1.{p}": one(embed[0] + "layer_norm.{p}"),
        "encoder.norm.{p}": one(closing[-1]),
        "head.fc.{p}": one("classifier.{p}"),
    }
    for s in range(stages):
        table |= _block(pre, s)
        if s:
            down = f"encoder.stages.{s}.downsample."
            table[down + "0.{p}"] = one(closing[s - 1])
            table[down + "1.{p}"] = one(embed[s] + "proj.{p}")
            table[down + "2.{p}"] = one(embed[s] + "layer_norm.{p}")
    return Layout(name, table)


family(
    Family(
        "PvtV2Model",
        ("pvt_v2",),
        r"(pvt_v2\.)?encoder\.layers\.\d+\.blocks\.\d+\.mlp\.dwconv\.dwconv\.",
        _spec,
        _layout,
    )
)
