"""Structural ops: the model's inputs and output, residual adds, dropout, stochastic depth, layer scale,
a second pass through a stack, and the small tensor steps between modules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from specvit.ops.base import Dims, Filler, Op, Params, Shape, attr_path, op

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "AddParams",
    "CallParams",
    "ClassTokenParams",
    "DropParams",
    "InputParams",
    "LayerScaleParams",
    "MaskParams",
    "OutputParams",
    "ScaleParams",
    "SubCacheParams",
    "TokenParams",
]


def _show(v: float) -> str:
    return f"{v:g}"


@dataclass(frozen=True)
class InputParams(Params):
    """A forward argument of the model.

    Args:
        arg: the argument's name (``x``, ``src``, ``key_padding_mask``, ``cache``).
        shape: its shape; ``()`` for values that are not tensors (an offset, a cache).
        dtype: ``float``, ``long`` (ids), ``bool`` (masks), ``int`` (a Python int) or ``cache``.
        required: the caller must pass it; otherwise it defaults to ``default``.
        keyword: keyword-only.
        default: the default of an optional argument.
        vocab: for ids, the vocabulary (example inputs draw below it).
        group: the order of arguments: data, masks, token types, then keyword-only state.
        what: what it is, for the diagram (``image 224x224``, ``tokens``).
        local: its name inside the stack that reads it (``images``); empty: the argument's name.
    """

    arg: str
    shape: Shape
    dtype: str = "float"
    required: bool = True
    keyword: bool = False
    default: Any = None
    vocab: int | None = None
    group: int = 0
    what: str = ""
    local: str = ""


@op
class Input(Op):
    kind = "input"
    params_type = InputParams
    ports = ()
    required = ()

    def shape(self, p: InputParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return p.shape

    def label(self, p: InputParams) -> tuple[str, ...]:
        return (f"{p.what or p.dtype} · {p.arg}" + ("" if p.required else " (optional)"),)


@dataclass(frozen=True)
class OutputParams(Params):
    """The model's result: one tensor (``keys == ()``) or a dict of named tensors.

    Args:
        keys: the dict's keys, each an input port of the node.
    """

    keys: tuple[str, ...] = ()


@op
class Output(Op):
    kind = "output"
    params_type = OutputParams
    required = ()
    any_ports = True

    def shape(self, p: OutputParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return inputs[p.keys[0] if p.keys else "x"]

    def code(self, p: OutputParams, args: Mapping[str, str]) -> str:
        if not p.keys:
            return args["x"]
        return "{" + ", ".join(f'"{k}": {args[k]}' for k in p.keys) + "}"  # ruff's quotes

    def label(self, p: OutputParams) -> tuple[str, ...]:
        return (" + ".join(p.keys),) if p.keys else ()


@dataclass(frozen=True)
class AddParams(Params):
    """A residual add: ``x + branch``."""


@op
class Add(Op):
    kind = "add"
    params_type = AddParams
    ports = ("x", "branch")
    required = ("x", "branch")

    def shape(self, p: AddParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        if inputs["x"] != inputs["branch"]:
            raise ValueError(f"adds {inputs['branch']} to {inputs['x']}")
        return inputs["x"]

    def code(self, p: AddParams, args: Mapping[str, str]) -> str:
        return f"{args['x']} + {args['branch']}"


@dataclass(frozen=True)
class DropParams(Params):
    """Dropout probability (zeroes single values) or stochastic-depth rate (zeroes whole samples).

    The rate of stochastic depth grows along the depth, so it varies between repeats of a block.
    """

    p: float = field(metadata={"varies": True})


@op
class Dropout(Op):
    kind = "dropout"
    params_type = DropParams
    module = "specvit.nn.layers:Dropout"

    def label(self, p: DropParams) -> tuple[str, ...]:
        return (f"p {_show(p.p)}",)


@op
class DropPath(Op):
    kind = "drop_path"
    params_type = DropParams
    module = "specvit.nn.layers:DropPath"

    def ctor(self, p: DropParams) -> dict[str, Any]:
        return {"prob": p.p}

    def label(self, p: DropParams) -> tuple[str, ...]:
        return ("per sample · rate grows with depth",)


@dataclass(frozen=True)
class LayerScaleParams(Params):
    """LayerScale (CaiT): a learned per-channel scale of a residual branch.

    Args:
        dim: the width.
        init: the initial value of every scale.
    """

    dim: int
    init: float


@op
class LayerScale(Op):
    kind = "layer_scale"
    params_type = LayerScaleParams
    category = "norm"  # a learned per-channel gain, as a norm's weight: drawn in the norms' colour
    module = "specvit.nn.layers:LayerScale"

    def params(self, p: LayerScaleParams) -> int:
        return p.dim

    def ctor(self, p: LayerScaleParams) -> dict[str, Any]:
        return {"dim": p.dim, "init_value": p.init}

    def init(self, module: nn.Module, p: LayerScaleParams, fill: Filler) -> None:
        fill(module.gamma, lambda t: t.fill_(p.init))

    def label(self, p: LayerScaleParams) -> tuple[str, ...]:
        return (f"per channel · init {_show(p.init)}",)


@dataclass(frozen=True)
class MaskParams(Params):
    """Prepend ``prefix`` never-padded positions to a padding mask (class and register tokens)."""

    prefix: int


@op
class ExtendMask(Op):
    kind = "extend_mask"
    params_type = MaskParams
    helpers: ClassVar[tuple[str, ...]] = ("specvit.nn.functional:extend_mask",)

    def shape(self, p: MaskParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, s = inputs["x"]
        return (b, dims.plus(s, p.prefix))

    def code(self, p: MaskParams, args: Mapping[str, str]) -> str:
        return f"extend_mask({args['x']}, {p.prefix})"

    def label(self, p: MaskParams) -> tuple[str, ...]:
        return (f"{p.prefix} prefix position{'s' * (p.prefix > 1)} never padded",)


@dataclass(frozen=True)
class ZerosParams(Params):
    """Zeros shaped like the input (DETR's decoder starts from zeros)."""


@op
class Zeros(Op):
    kind = "zeros"
    params_type = ZerosParams

    def code(self, p: ZerosParams, args: Mapping[str, str]) -> str:
        return f"torch.zeros_like({args['x']})"

    def label(self, p: ZerosParams) -> tuple[str, ...]:
        return ("zeros",)


@dataclass(frozen=True)
class CallParams(Params):
    """Run a scope again on another input, with its weights: a stack (CroCo's second view) or a block whose
    weights later layers share (ALBERT).

    Args:
        scope: the scope run (``encoder``, ``encoder.blocks.0``).
        shape: its output shape.
        flops: the FLOPs of the scope's modules, run again.
        caller: the scope the call is made from (``""``: the model; ``encoder`` for its blocks).
        kwargs: the scope's keyword arguments, in order: ports of the node of the same names.
        useful_flops: the useful FLOPs of the scope's modules (:meth:`~specvit.ops.base.Op.useful_flops`),
            or None for ``flops``.
    """

    scope: str
    shape: Shape
    flops: int = 0
    caller: str = ""
    kwargs: tuple[str, ...] = ()
    useful_flops: int | None = None


@op
class Call(Op):
    kind = "call"
    params_type = CallParams
    any_ports = True

    def shape(self, p: CallParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        return p.shape

    def flops(self, p: CallParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        return p.flops

    def useful_flops(self, p: CallParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        return p.flops if p.useful_flops is None else p.useful_flops

    def code(self, p: CallParams, args: Mapping[str, str]) -> str:
        target = attr_path(p.scope[len(p.caller) + 1 :] if p.caller else p.scope)
        kwargs = "".join(f", {k}={args[k]}" for k in p.kwargs if k in args)
        return f"self.{target}({args['x']}{kwargs})"

    def label(self, p: CallParams) -> tuple[str, ...]:
        return (f"the {p.scope} again · shared weights",)


@dataclass(frozen=True)
class SubCacheParams(Params):
    """The KV cache of one later run of a shared block: entries of its own under the block's layer indexes.

    Args:
        key: the run's layer index in its stack.
    """

    key: int


@op
class SubCache(Op):
    kind = "sub_cache"
    params_type = SubCacheParams
    helpers = ("specvit.nn.cache:sub_cache",)
    value = "KVCache"

    def code(self, p: SubCacheParams, args: Mapping[str, str]) -> str:
        return f"sub_cache({args['x']}, {p.key})"

    def label(self, p: SubCacheParams) -> tuple[str, ...]:
        return (f"KV cache of layer {p.key}'s run",)


@dataclass(frozen=True)
class SoftcapParams(Params):
    """Squash into (-cap, cap): ``cap * tanh(x / cap)`` (Gemma 2's final-logit soft-capping)."""

    cap: float


@op
class Softcap(Op):
    kind = "softcap"
    params_type = SoftcapParams
    helpers = ("specvit.nn.scores:tanh_cap",)

    def code(self, p: SoftcapParams, args: Mapping[str, str]) -> str:
        return f"tanh_cap({args['x']}, {p.cap!r})"

    def label(self, p: SoftcapParams) -> tuple[str, ...]:
        return (f"{p.cap:g} · tanh(x / {p.cap:g})",)


@dataclass(frozen=True)
class ScaleParams(Params):
    """Multiply by a constant (T5 scales the last hidden state by width**-0.5 before its tied head)."""

    factor: float


@op
class Scale(Op):
    kind = "scale"
    params_type = ScaleParams

    def code(self, p: ScaleParams, args: Mapping[str, str]) -> str:
        return f"{args['x']} * {p.factor!r}"

    def label(self, p: ScaleParams) -> tuple[str, ...]:
        return (f"× {p.factor:.6g}",)


@dataclass(frozen=True)
class ClassTokenParams(Params):
    """The class token (the first token) taken out of the tokens, or put back in front of them: a block
    whose sublayers update the class token alone (CaiT's class attention) adds onto it, then joins it back."""


@op
class ClassToken(Op):
    kind = "class_token"
    params_type = ClassTokenParams
    helpers = ("specvit.nn.cait:class_token",)

    def shape(self, p: ClassTokenParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, _, d = inputs["x"]
        return (b, 1, d)

    def code(self, p: ClassTokenParams, args: Mapping[str, str]) -> str:
        return f"class_token({args['x']})"

    def label(self, p: ClassTokenParams) -> tuple[str, ...]:
        return ("class token · x[:, :1]",)


@op
class JoinClassToken(Op):
    kind = "join_class_token"
    params_type = ClassTokenParams
    helpers = ("specvit.nn.cait:join_class_token",)
    ports = ("x", "cls")
    required = ("x", "cls")

    def shape(self, p: ClassTokenParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        if inputs["cls"][-1] != inputs["x"][-1]:
            raise ValueError(f"puts a {inputs['cls']} class token in front of {inputs['x']}")
        return inputs["x"]

    def code(self, p: ClassTokenParams, args: Mapping[str, str]) -> str:
        return f"join_class_token({args['x']}, {args['cls']})"

    def label(self, p: ClassTokenParams) -> tuple[str, ...]:
        return ("updated class token · other tokens unchanged",)


@dataclass(frozen=True)
class TokenParams(Params):
    """One token of every sample, by its index (a prefix token; the attention pool's probe).

    Args:
        index: the token's position in the sequence.
        name: what the token is, for the diagram.
    """

    index: int
    name: str


@op
class Token(Op):
    kind = "token"
    params_type = TokenParams
    category = "head"

    def shape(self, p: TokenParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        b, _, d = inputs["x"]
        return (b, d)

    def code(self, p: TokenParams, args: Mapping[str, str]) -> str:
        return f"{args['x']}[:, {p.index}]"

    def label(self, p: TokenParams) -> tuple[str, ...]:
        return (f"the {p.name} token (index {p.index})",)
