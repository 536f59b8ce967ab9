"""The CNN stems of timm's hybrid ViTs (``HybridEmbed``): a backbone of convolutions, norms, activations and
pools read into an image input's ``stem:`` (timm's ResNetV2 stems of ``vit_*_r_*``, ``ConvStem``).

TensorFlow's "same" padding (``StdConv2dSame``, ``MaxPool2dSame``) pads the far side more, by amounts that
follow from the map's size; the size is fixed, so each becomes a ``pad`` layer before its window. Backbones
with residual stages (``ResNetV2`` with layers, ``ResNet``) are refused by their module classes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Entry, Misfit, one
from specvit.interop.timm import Reader
from specvit.spec.schema import ImageInput

__all__ = ["STEM_MODULES", "stem_entries", "stem_input"]

STEM_MODULES = frozenset(
    {
        "HybridEmbed",
        "StdConv2d",
        "StdConv2dSame",
        "GroupNorm",
        "GroupNormAct",
        "BatchNorm2d",
        "BatchNormAct2d",
    }
    | {"MaxPool2d", "MaxPool2dSame", "AvgPool2d", "ConvNormAct", "ConvStem", "ReLU", "GELU", "SiLU"}
)
"""The module classes a hybrid's stem may hold."""

_CONTAINERS = ("Sequential", "ConvStem", "ConvNormAct")


def _pair(r: Reader, path: str, value: Any) -> int:
    values = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if values[0] != values[1]:
        raise r.refuse(path, values, "specvit's stem windows are square", "")
    return int(values[0])


def _same(size: tuple[int, int], kernel: int, stride: int) -> list[int]:
    """timm's ``pad_same``: [left, right, top, bottom] for a window over an (h, w) map."""
    h, w = (max((math.ceil(s / stride) - 1) * stride + kernel - s, 0) for s in size)
    return [w // 2, w - w // 2, h // 2, h - h // 2]


def _window(size: tuple[int, int], kernel: int, stride: int, padding: int) -> tuple[int, int]:
    return (size[0] + 2 * padding - kernel) // stride + 1, (size[1] + 2 * padding - kernel) // stride + 1


class _Stem:
    """The stem's layers, read in order, with the map's size."""

    def __init__(self, r: Reader, size: tuple[int, int]) -> None:
        self.r, self.size = r, size
        self.layers: list[dict[str, Any]] = []

    def read(self, path: str) -> None:
        module = self.r.at(path)
        name = type(module).__name__
        if name in _CONTAINERS:
            for child, _ in module.named_children():
                self.read(f"{path}.{child}")
        elif name in ("Conv2d", "StdConv2d", "StdConv2dSame"):
            self._conv(path, module, name)
        elif name in ("GroupNorm", "GroupNormAct", "BatchNorm2d", "BatchNormAct2d"):
            self._norm(path, module, name)
        elif name in ("MaxPool2d", "MaxPool2dSame", "AvgPool2d"):
            self._pool(path, module, name)
        elif name != "Identity":
            self.layers.append({"kind": "act", "fn": self.r.activation(path)})

    def _pad(self, kernel: int, stride: int, fill: str) -> None:
        sides = _same(self.size, kernel, stride)
        if any(sides):
            self.layers.append({"kind": "pad", "sides": sides} | ({"fill": fill} if fill != "zero" else {}))
            self.size = (self.size[0] + sides[2] + sides[3], self.size[1] + sides[0] + sides[1])

    def _conv(self, path: str, conv: Any, name: str) -> None:
        r = self.r
        r.only(f"{path}.padding_mode", ["zeros"], "specvit's stem pads with zeros")
        kernel, stride = (
            _pair(r, f"{path}.kernel_size", conv.kernel_size),
            _pair(r, f"{path}.stride", conv.stride),
        )
        if _pair(r, f"{path}.dilation", conv.dilation) != 1:
            raise r.refuse(
                f"{path}.dilation", conv.dilation, "specvit's stem convolutions are not dilated", ""
            )
        padding = _pair(r, f"{path}.padding", conv.padding)
        if getattr(conv, "same_pad", False):
            self._pad(kernel, stride, "zero")
        layer = {"kind": "conv", "channels": conv.out_channels, "kernel": kernel, "stride": stride}
        layer |= {"padding": padding, "groups": conv.groups, "bias": conv.bias is not None}
        self.layers.append(layer | ({"standardize": float(conv.eps)} if name != "Conv2d" else {}))
        self.size = _window(self.size, kernel, stride, padding)

    def _norm(self, path: str, norm: Any, name: str) -> None:
        group = name.startswith("Group")
        if not group and not norm.track_running_stats:
            raise self.r.refuse(
                path, "track_running_stats=False", "specvit's batch norm keeps statistics", ""
            )
        layer = {"kind": "norm", "type": "group" if group else "batch", "eps": float(norm.eps)}
        self.layers.append(layer | ({"groups": norm.num_groups} if group else {}) | {"affine": norm.affine})
        if "Act" in name:  # timm's norm with its activation (and a dropout, which must be none)
            self.r.absent(f"{path}.drop", "a dropout inside the stem's norm")
            self.read(f"{path}.act")

    def _pool(self, path: str, pool: Any, name: str) -> None:
        r = self.r
        kernel, stride = (
            _pair(r, f"{path}.kernel_size", pool.kernel_size),
            _pair(r, f"{path}.stride", pool.stride),
        )
        padding = _pair(r, f"{path}.padding", pool.padding)
        r.only(f"{path}.ceil_mode", [False], "specvit's pools floor the output size")
        if name == "AvgPool2d" and padding and pool.count_include_pad:
            raise r.refuse(f"{path}.count_include_pad", True, "specvit's average leaves padding out", "")
        if name == "MaxPool2dSame":
            self._pad(kernel, stride, "lowest")
        self.layers.append(
            {"kind": "pool", "type": "avg" if name == "AvgPool2d" else "max", "kernel": kernel}
        )
        self.layers[-1] |= {"stride": stride, "padding": padding}
        self.size = _window(self.size, kernel, stride, padding)


def stem_input(r: Reader) -> dict[str, Any]:
    """The ``input:`` of a ``HybridEmbed`` at ``patch_embed``: the backbone as the stem, patches cut by
    ``proj`` from the map it leaves."""
    e = "patch_embed"
    r.only(f"{e}.dynamic_img_pad", [False], "specvit pads nothing")
    r.only(f"{e}.flatten", [True], "the patches are the transformer's tokens")
    proj = r.at(f"{e}.proj")
    if type(proj).__name__ != "Conv2d":
        raise r.refuse(f"{e}.proj", type(proj).__name__, "specvit cuts patches from the stem's map", "")
    patch = _pair(r, f"{e}.proj.kernel_size", proj.kernel_size)
    if _pair(r, f"{e}.proj.stride", proj.stride) != patch:
        raise r.refuse(f"{e}.proj.stride", proj.stride, "overlapping patches", "stride = patch size")
    size = tuple(r.at(f"{e}.img_size"))
    stem = _Stem(r, (int(size[0]), int(size[1])))
    stem.read(f"{e}.backbone")
    return {
        "kind": "image",
        "size": size[0] if size[0] == size[1] else list(size),
        "patch": patch,
        "channels": r.at(f"{e}.in_chans"),
        "bias": proj.bias is not None,
        "stem": stem.layers,
    }


def stem_entries(image: ImageInput, keys: Sequence[str]) -> dict[str, Entry]:
    """Where each stem layer's weights come from: the backbone's modules that hold any, in the state dict's
    order (a Sequential's, the forward's), matched to the stem's convolutions and norms in order."""
    prefix = "patch_embed.backbone."
    modules = list(dict.fromkeys(k[len(prefix) :].rsplit(".", 1)[0] for k in keys if k.startswith(prefix)))
    stateful = [
        i
        for i, layer in enumerate(image.stem)
        if layer.kind == "conv" or (layer.kind == "norm" and (layer.affine or layer.type == "batch"))
    ]
    if len(modules) != len(stateful):
        raise Misfit(f"the stem has {len(stateful)} layers with weights, the backbone {len(modules)} modules")
    return {
        f"encoder.stem.{i}.{{p}}": one(f"{prefix}{m}.{{p}}") for i, m in zip(stateful, modules, strict=True)
    }
