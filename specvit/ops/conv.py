"""Ops on channels-first maps, the primitives stems and map heads are written in.

A spec writes them as a list under an input's ``stem:`` or a ``map`` head's ``ops:``; each item is one
layer over a (B, C, L) signal or a (B, C, H, W) image map:

- ``{kind: conv, channels: 64, kernel: 7, stride: 2, padding: 3, bias: false}``: a 1D or 2D convolution
  (``groups``; ``standardize: 1.0e-8`` standardises its weight per output channel, as BiT's StdConv);
- ``{kind: norm, type: batch | group | layer, groups: 32, eps: 1.0e-5}``: a norm over the channels;
- ``{kind: act, fn: relu}``: an activation;
- ``{kind: pool, type: max | avg, kernel: 3, stride: 2, padding: 1}``: a pooling window.

Square kernels, strides and paddings; 1D or 2D follows from the input. The lowering writes the ops between
maps and tokens (``to_tokens``, ``to_map``, ``map_pool``). Modules: ``torch.nn``'s and :mod:`specvit.nn.conv`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from specvit.errors import Problem
from specvit.ops.base import MAX_IMAGE, MAX_WIDTH, Dims, Fragment, ModelCtx, Op, Params, Shape, op
from specvit.ops.maps import spatial as _spatial

__all__ = [
    "ActLayer",
    "ConvLayer",
    "MapOp",
    "NormLayer",
    "PadLayer",
    "PoolLayer",
    "lower_map_ops",
    "map_ops_problems",
    "map_out",
]

PlainActivation = Literal["gelu", "gelu_tanh", "quick_gelu", "relu", "relu2", "silu", "tanh"]
_ACT_MODULES: dict[str, tuple[str, dict[str, Any]]] = {
    "gelu": ("torch.nn:GELU", {}),
    "gelu_tanh": ("torch.nn:GELU", {"approximate": "tanh"}),
    "quick_gelu": ("specvit.nn.mlp:QuickGELU", {}),
    "relu": ("torch.nn:ReLU", {}),
    "relu2": ("specvit.nn.mlp:ReLUSquared", {}),
    "silu": ("torch.nn:SiLU", {}),
    "tanh": ("torch.nn:Tanh", {}),  # BERT's pooler
}
_Size = Annotated[int, Field(ge=1, le=MAX_IMAGE)]


def _window_out(size: int, kernel: int, stride: int, padding: int) -> int:
    """Positions along one side after a window of ``kernel`` at ``stride`` over ``size`` padded by ``padding``."""
    return (size + 2 * padding - kernel) // stride + 1


# ------------------------------------------------------------------------------------- spec fragments


class _Layer(Fragment):
    def out(self, channels: int, size: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """(channels, spatial size) after this layer."""
        return channels, size

    def problems(self, at: str, channels: int, size: tuple[int, ...]) -> list[Problem]:
        """What this layer cannot do to a (channels, size) map."""
        return []

    def node(self, channels: int, dims: int) -> tuple[str, Params]:
        """The op kind and params of this layer over a map of ``channels`` and ``dims`` spatial dims."""
        raise NotImplementedError


class _Window(_Layer):
    kernel: _Size = Field(description="Side of the square window.")
    stride: _Size = Field(1, description="Step between windows.")
    padding: int = Field(0, ge=0, le=MAX_IMAGE, description="Zeros (pool: ignored values) on each side.")

    def out(self, channels: int, size: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        return channels, tuple(_window_out(s, self.kernel, self.stride, self.padding) for s in size)

    def problems(self, at: str, channels: int, size: tuple[int, ...]) -> list[Problem]:
        short = min(size) + 2 * self.padding
        if self.kernel > short:
            return [
                Problem(
                    f"{at}.kernel",
                    f"a {self.kernel}-wide window does not fit a side of {min(size)} padded by {self.padding}",
                    f"use a kernel of at most {short}, or more padding",
                )
            ]
        return []


class ConvLayer(_Window):
    """A convolution over the map (1D for a signal, 2D for an image)."""

    kind: Literal["conv"] = Field(description="Discriminator: a convolution.")
    channels: int | None = Field(None, ge=1, le=MAX_WIDTH, description="Output channels; null: the input's.")
    groups: int = Field(
        1, ge=1, le=MAX_WIDTH, description="Channel groups (the input's channels for depthwise)."
    )
    bias: bool = Field(True, description="A learned bias per output channel.")
    standardize: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Standardise the weight per output channel with this epsilon before use (BiT's StdConv, "
        "timm's ResNetV2 stems); null: the weight as it is.",
    )

    def out(self, channels: int, size: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        return self.channels or channels, super().out(channels, size)[1]

    def node(self, channels: int, dims: int) -> tuple[str, Params]:
        args = (self.kernel, self.stride, self.padding, self.groups, self.bias, self.standardize)
        return "conv", ConvParams(dims, channels, self.channels or channels, *args)

    def problems(self, at: str, channels: int, size: tuple[int, ...]) -> list[Problem]:
        out, c_out = super().problems(at, channels, size), self.channels or channels
        if channels % self.groups or c_out % self.groups:
            out.append(
                Problem(
                    f"{at}.groups",
                    f"{self.groups} groups do not divide {channels} input and {c_out} output channels",
                    "use a number of groups dividing both",
                )
            )
        if self.standardize is not None and len(size) != 2:
            out.append(Problem(f"{at}.standardize", "weight standardisation is for 2D convs", "remove it"))
        return out


class NormLayer(_Layer):
    """A norm over the channels of the map."""

    kind: Literal["norm"] = Field(description="Discriminator: a norm over the channels.")
    type: Literal["batch", "group", "layer"] = Field(
        description="batch: BatchNorm (running statistics in eval); group: GroupNorm; layer: LayerNorm over "
        "the channels at each position (timm's LayerNorm2d)."
    )
    groups: int | None = Field(
        None, ge=1, le=MAX_WIDTH, description="Groups of a group norm (32 in ResNets)."
    )
    eps: float = Field(1e-5, gt=0.0, lt=1.0, description="Added to the variance.")
    affine: bool = Field(True, description="A learned weight and bias per channel.")

    def node(self, channels: int, dims: int) -> tuple[str, Params]:
        return "channel_norm", ChannelNormParams(
            dims, self.type, channels, self.groups, self.eps, self.affine
        )

    def problems(self, at: str, channels: int, size: tuple[int, ...]) -> list[Problem]:
        if self.type != "group":
            if self.groups is not None:
                return [Problem(f"{at}.groups", f"a {self.type} norm has no groups", "remove groups")]
            return []
        if self.groups is None or channels % self.groups:
            got = "no groups" if self.groups is None else f"{self.groups} groups"
            return [
                Problem(
                    f"{at}.groups",
                    f"a group norm over {channels} channels needs a number of groups dividing them, got {got}",
                    "set groups to a divisor of the channels, such as 32",
                )
            ]
        return []


class ActLayer(_Layer):
    """An activation, elementwise."""

    kind: Literal["act"] = Field(description="Discriminator: an activation.")
    fn: PlainActivation = Field(description="gelu (exact), gelu_tanh, quick_gelu, relu, relu2, silu or tanh.")

    def node(self, channels: int, dims: int) -> tuple[str, Params]:
        return "act", ActParams(self.fn)


class PoolLayer(_Window):
    """Max or average over square windows of the map."""

    kind: Literal["pool"] = Field(description="Discriminator: a pooling window.")
    type: Literal["max", "avg"] = Field(description="max or avg (padding not counted in the average).")
    stride: _Size | None = Field(None, description="Step between windows; null: the kernel.")  # type: ignore[assignment]

    def node(self, channels: int, dims: int) -> tuple[str, Params]:
        return "spatial_pool", SpatialPoolParams(
            dims, self.type, self.kernel, self.stride or self.kernel, self.padding
        )

    def out(self, channels: int, size: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        step = self.stride or self.kernel
        return channels, tuple(_window_out(s, self.kernel, step, self.padding) for s in size)

    def problems(self, at: str, channels: int, size: tuple[int, ...]) -> list[Problem]:
        if 2 * self.padding > self.kernel:
            return [
                Problem(
                    f"{at}.padding", "a pool pads at most half its kernel", f"use at most {self.kernel // 2}"
                )
            ]
        return super().problems(at, channels, size)


class PadLayer(_Layer):
    """Constant padding, its own amount on each side: TensorFlow's "same" padding, which pads the far side
    more (timm's ``StdConv2dSame`` and ``MaxPool2dSame``), is this before a window with no padding."""

    kind: Literal["pad"] = Field(description="Discriminator: constant padding.")
    sides: list[Annotated[int, Field(ge=0, le=MAX_IMAGE)]] = Field(
        min_length=2,
        max_length=4,
        description="Positions added: [left, right] of a signal; [left, right, top, bottom] of an image "
        "(F.pad's order).",
    )
    fill: Literal["zero", "lowest"] = Field(
        "zero", description="zero; lowest: -inf, which a max pool never picks (MaxPool2dSame's padding)."
    )

    def out(self, channels: int, size: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        if len(self.sides) != 2 * len(size):
            return channels, size  # the problem says so
        pairs = [self.sides[2 * i] + self.sides[2 * i + 1] for i in range(len(size))]  # last dim first
        return channels, tuple(s + pad for s, pad in zip(size, reversed(pairs), strict=True))

    def problems(self, at: str, channels: int, size: tuple[int, ...]) -> list[Problem]:
        if len(self.sides) != 2 * len(size):
            what = "[left, right]" if len(size) == 1 else "[left, right, top, bottom]"
            return [Problem(f"{at}.sides", f"a {len(size)}D map pads {2 * len(size)} sides", f"write {what}")]
        return []

    def node(self, channels: int, dims: int) -> tuple[str, Params]:
        return "pad", PadParams(dims, tuple(self.sides), self.fill)


MapOp = Annotated[ConvLayer | NormLayer | ActLayer | PoolLayer | PadLayer, Field(discriminator="kind")]
MapOps = Annotated[list[MapOp], Field(max_length=64)]


def map_out(ops: Sequence[_Layer], channels: int, size: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(channels, spatial size) of a (channels, size) map after ``ops``."""
    for layer in ops:
        channels, size = layer.out(channels, size)
    return channels, size


def map_ops_problems(at: str, ops: Sequence[_Layer], channels: int, size: tuple[int, ...]) -> list[Problem]:
    """The problems of ``ops`` (written at key ``at``) over a (channels, size) map, the first layer's only:
    a layer that does not fit makes every later size meaningless."""
    for i, layer in enumerate(ops):
        problems = layer.problems(f"{at}.{i}", channels, size)
        if problems:
            return problems
        channels, size = layer.out(channels, size)
    return []


def lower_map_ops(
    ctx: ModelCtx, x: str, ops: Sequence[_Layer], path: str, source: str, stack: str = ""
) -> str:
    """Add a node per layer of ``ops`` after map node ``x``, named ``{path}.{i}``; returns the last.

    Args:
        ctx: the lowering.
        x: a (B, C, *size) node.
        ops: the layers.
        path: the nodes' common prefix (``encoder.stem``).
        source: the spec key of the list (``encoder.input.stem``).
        stack: the stack the nodes belong to.
    """
    for i, layer in enumerate(ops):
        _, c, *size = ctx.shape(x)
        assert isinstance(c, int)
        kind, p = layer.node(c, len(size))
        x = ctx.add(f"{path}.{i}", kind, p, {"x": x}, source=f"{source}.{i}", stack=stack)
    return x


# ---------------------------------------------------------------------------------------------- ops


@dataclass(frozen=True)
class ConvParams(Params):
    """A convolution over a (B, C, *size) map.

    Args:
        dims: 1 or 2 spatial dims.
        c_in: input channels.
        c_out: output channels.
        kernel: side of the square kernel.
        stride: its step.
        padding: zeros on each side.
        groups: channel groups.
        bias: a bias per output channel.
        standardize: epsilon of weight standardisation, or None.
    """

    dims: int
    c_in: int
    c_out: int
    kernel: int
    stride: int = 1
    padding: int = 0
    groups: int = 1
    bias: bool = True
    standardize: float | None = None


@op
class Conv(Op):
    kind = "conv"
    params_type = ConvParams
    category = "embedding"

    def shape(self, p: ConvParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        x = inputs["x"]
        if len(x) != 2 + p.dims or x[1] != p.c_in:
            raise ValueError(f"expects a ({p.c_in} channels, {p.dims}D) map, got {x}")
        return (x[0], p.c_out, *(_window_out(s, p.kernel, p.stride, p.padding) for s in _spatial(x)))

    def params(self, p: ConvParams) -> int:
        return p.c_out * (p.c_in // p.groups) * p.kernel**p.dims + p.c_out * p.bias

    def flops(self, p: ConvParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        positions = inputs["x"][0]
        for s in inputs["x"][2:]:
            positions *= _window_out(s, p.kernel, p.stride, p.padding)
        return 2 * positions * p.c_out * (p.c_in // p.groups) * p.kernel**p.dims

    def module_for(self, p: ConvParams) -> str:
        return "specvit.nn.conv:StdConv2d" if p.standardize is not None else f"torch.nn:Conv{p.dims}d"

    def ctor(self, p: ConvParams) -> dict[str, Any]:
        out: dict[str, Any] = {"in_channels": p.c_in, "out_channels": p.c_out, "kernel_size": p.kernel}
        out |= {"stride": p.stride} if p.stride != 1 else {}
        out |= {"padding": p.padding} if p.padding else {}
        out |= {"groups": p.groups} if p.groups != 1 else {}
        out |= {} if p.bias else {"bias": False}
        return out | ({"eps": p.standardize} if p.standardize is not None else {})

    def label(self, p: ConvParams) -> tuple[str, ...]:
        k = "x".join([str(p.kernel)] * p.dims)
        parts = [f"{k} conv {p.c_in} → {p.c_out}"]
        parts += [f"stride {p.stride}"] if p.stride != 1 else []
        parts += [f"groups {p.groups}"] if p.groups != 1 else []
        parts += [] if p.bias else ["no bias"]
        parts += ["standardised weight"] if p.standardize is not None else []
        return (" · ".join(parts),)


@dataclass(frozen=True)
class ChannelNormParams(Params):
    """A norm over the channels of a (B, C, *size) map.

    Args:
        dims: 1 or 2 spatial dims.
        type: ``batch``, ``group`` or ``layer``.
        channels: C.
        groups: groups of a group norm.
        eps: added to the variance.
        affine: a learned weight and bias.
    """

    dims: int
    type: str
    channels: int
    groups: int | None = None
    eps: float = 1e-5
    affine: bool = True


@op
class ChannelNorm(Op):
    kind = "channel_norm"
    params_type = ChannelNormParams
    category = "norm"

    def params(self, p: ChannelNormParams) -> int:
        return 2 * p.channels * p.affine

    def module_for(self, p: ChannelNormParams) -> str:
        if p.type == "batch":
            return f"torch.nn:BatchNorm{p.dims}d"
        return "torch.nn:GroupNorm" if p.type == "group" else "specvit.nn.conv:LayerNorm2d"

    def ctor(self, p: ChannelNormParams) -> dict[str, Any]:
        affine = {} if p.affine else {"affine": False}
        if p.type == "group":
            return {"num_groups": p.groups, "num_channels": p.channels, "eps": p.eps, **affine}
        if p.type == "layer":
            return {"normalized_shape": p.channels, "eps": p.eps} | (
                {} if p.affine else {"elementwise_affine": False}
            )
        return {"num_features": p.channels, "eps": p.eps, **affine}

    def label(self, p: ChannelNormParams) -> tuple[str, ...]:
        name = {"batch": "BatchNorm", "group": f"GroupNorm {p.groups}", "layer": "LayerNorm"}[p.type]
        return (f"{name} over {p.channels} channels · eps {p.eps:g}",)


@dataclass(frozen=True)
class ActParams(Params):
    """An elementwise activation: ``fn`` is one of the MLPs' plain activations."""

    fn: str


@op
class Act(Op):
    kind = "act"
    params_type = ActParams

    def module_for(self, p: ActParams) -> str:
        return _ACT_MODULES[p.fn][0]

    def ctor(self, p: ActParams) -> dict[str, Any]:
        return _ACT_MODULES[p.fn][1]

    def label(self, p: ActParams) -> tuple[str, ...]:
        return (p.fn,)


@dataclass(frozen=True)
class SpatialPoolParams(Params):
    """Max or average over square windows of a (B, C, *size) map (an average leaves padding out)."""

    dims: int
    type: str
    kernel: int
    stride: int
    padding: int = 0


@op
class SpatialPool(Op):
    kind = "spatial_pool"
    params_type = SpatialPoolParams

    def shape(self, p: SpatialPoolParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        x = inputs["x"]
        return (*x[:2], *(_window_out(s, p.kernel, p.stride, p.padding) for s in _spatial(x)))

    def module_for(self, p: SpatialPoolParams) -> str:
        return f"torch.nn:{p.type.capitalize()}Pool{p.dims}d"

    def ctor(self, p: SpatialPoolParams) -> dict[str, Any]:
        out: dict[str, Any] = {"kernel_size": p.kernel, "stride": p.stride}
        out |= {"padding": p.padding} if p.padding else {}
        return out | ({"count_include_pad": False} if p.type == "avg" and p.padding else {})

    def label(self, p: SpatialPoolParams) -> tuple[str, ...]:
        return (f"{p.type} pool {p.kernel} · stride {p.stride}",)


@dataclass(frozen=True)
class PadParams(Params):
    """Constant padding of a (B, C, *size) map, in F.pad's order (last dim first).

    Args:
        dims: 1 or 2 spatial dims.
        sides: positions added on each side.
        fill: ``zero`` or ``lowest`` (-inf).
    """

    dims: int
    sides: tuple[int, ...]
    fill: str = "zero"


@op
class Pad(Op):
    kind = "pad"
    params_type = PadParams

    def shape(self, p: PadParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        x = inputs["x"]
        size = list(_spatial(x))
        for i in range(p.dims):  # F.pad: the first pair pads the last dim
            size[-1 - i] += p.sides[2 * i] + p.sides[2 * i + 1]
        return (*x[:2], *size)

    def module_for(self, p: PadParams) -> str:
        return f"torch.nn:ConstantPad{p.dims}d"

    def ctor(self, p: PadParams) -> dict[str, Any]:
        return {"padding": p.sides, "value": 0.0 if p.fill == "zero" else float("-inf")}

    def label(self, p: PadParams) -> tuple[str, ...]:
        fill = "" if p.fill == "zero" else " · -inf"
        return (f"pad {list(p.sides)}{fill}",)
