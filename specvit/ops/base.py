"""What an op is: the spec fragment a user writes, and the graph node kind it lowers to.

Two kinds of definition live in :mod:`specvit.ops`, each in the file of its op family:

- **Spec fragments** (:class:`Fragment` subclasses registered with :func:`fragment`): what a user writes
  in one slot of a spec (an input, a position, a head), with its fields, its cross-field ``check`` and its
  ``lower``, which emits graph nodes through a :class:`StackCtx` or :class:`ModelCtx`. The schema's
  unions are assembled from them (:func:`fragments`).
- **Ops** (:class:`Op` subclasses registered with :func:`op`): one graph node kind with typed, frozen
  hyper-parameters (:class:`Params`), its output shape, parameter count and FLOPs, the module it builds
  (or the expression it computes), its weight init, and its diagram label. The lowering, the compiler,
  the init and the diagrams read these, never a list of their own.

Nothing here imports torch: validating a spec stays fast. Modules are named by ``"module:Class"`` and
imported when a model is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from specvit.errors import Problem
from specvit.ops.facts import SpecView, StackView

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "OPS",
    "Category",
    "Dim",
    "Dims",
    "Filler",
    "Fragment",
    "ModelCtx",
    "Op",
    "Params",
    "Shape",
    "StackCtx",
    "attr_path",
    "fragment",
    "fragments",
    "linear_flops",
    "numel",
    "op",
    "visible_pairs",
]

Dim = int | str
Shape = tuple[Dim, ...]
Category = Literal["attention", "mlp", "norm", "embedding", "position", "structural", "head"]

# Upper bounds keep shape, parameter and FLOP arithmetic far from overflow and from sizes that would
# take minutes to lower; they are well above any model trained to date.
MAX_WIDTH = 1 << 16
MAX_DEPTH = 1024
MAX_HEADS = 1024
MAX_IMAGE = 1 << 14
MAX_VOCAB = 1 << 24
MAX_LEN = 1 << 20


# ------------------------------------------------------------------------------------------ fragments


class Fragment(BaseModel):
    """Base of every spec model: strict types, unknown keys refused, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=False)

    def check(self, at: str, stack: StackView, spec: SpecView) -> list[Problem]:
        """Cross-field problems of this fragment, written at key path ``at`` of ``spec``.

        Args:
            at: where the fragment is (``encoder.position``).
            stack: the stack it belongs to (for a head: the stack it reads).
            spec: the whole spec.
        """
        return []


_FRAGMENTS: dict[str, list[type[Fragment]]] = {}

F = TypeVar("F", bound=type[Fragment])


def fragment(slot: str) -> Callable[[F], F]:
    """Register a fragment class as one kind of ``slot`` (``input``, ``position``, ``head``)."""

    def register(cls: F) -> F:
        _FRAGMENTS.setdefault(slot, []).append(cls)
        return cls

    return register


def fragments(slot: str) -> tuple[type[Fragment], ...]:
    """The fragment classes of a slot, in registration order (the order error messages list them in)."""
    return tuple(_FRAGMENTS.get(slot, ()))


# ---------------------------------------------------------------------------------------------- dims


class Dims:
    """Concrete sizes of the symbolic dims (``B``, ``S``, ``S+1``) that shapes are written in.

    Args:
        sizes: the concrete value of each named dim.
    """

    def __init__(self, sizes: Mapping[str, int]):
        self.sizes = dict(sizes)

    def size(self, d: Dim) -> int:
        return d if isinstance(d, int) else self.sizes[d]

    def concrete(self, shape: Shape) -> tuple[int, ...]:
        return tuple(self.size(d) for d in shape)

    def plus(self, d: Dim, k: int) -> Dim:
        """``d + k``: an int for an int, else a new named dim (``S+1``) with its size recorded."""
        if isinstance(d, int) or k == 0:
            return d + k if isinstance(d, int) else d
        name = f"{d}+{k}"
        self.sizes.setdefault(name, self.sizes[d] + k)
        return name


def numel(shape: tuple[int, ...]) -> int:
    """Product of all dims but the last: the number of vectors a per-token layer sees."""
    out = 1
    for d in shape[:-1]:
        out *= d
    return out


def attr_path(rel: str) -> str:
    """``stages.1.downsample.norm`` -> ``stages[1].downsample.norm``: a module path as attribute access."""
    out = ""
    for part in rel.split("."):
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out.lstrip(".")


def linear_flops(tokens: int, d_in: int, d_out: int) -> int:
    """FLOPs of a ``d_in -> d_out`` linear layer on ``tokens`` vectors (a multiply-add counts 2)."""
    return 2 * tokens * d_in * d_out


def visible_pairs(n: int, causal: bool, window: int | None) -> int:
    """The query-key pairs of an ``n``-token sequence that a causal mask and a sliding window keep: query i
    sees key j when ``j <= i`` (causal) and ``|i - j| < window`` (as :func:`specvit.nn.attend.visible_keys`).

    The pairs at offset d are ``n - d``; offsets 1 to ``reach`` (the window's, at most ``n - 1``) make
    ``reach * n - reach * (reach + 1) / 2`` pairs on each side of the diagonal's ``n``: causal alone keeps
    ``n (n + 1) / 2``, a causal window w < n keeps ``w n - w (w - 1) / 2``, neither keeps ``n * n``.

    Args:
        n: the sequence length (queries and keys).
        causal: only keys at or before the query's position.
        window: only keys less than ``window`` positions away, or None.
    """
    reach = n - 1 if window is None else min(window - 1, n - 1)
    side = reach * n - reach * (reach + 1) // 2
    return n + side * (1 if causal else 2)


# ----------------------------------------------------------------------------------------------- ops


@dataclasses.dataclass(frozen=True)
class Params:
    """Base of every op's resolved hyper-parameters: a frozen dataclass of concrete values.

    A field declared with ``metadata={"varies": True}`` may differ between repeats of one block (a
    stochastic-depth rate, a KV-cache layer index) without making them different blocks. A field declared
    with ``metadata={"setting": False}`` is no setting of the spec but a position the lowering counts (the
    KV-cache layer index): ``specvit diff`` does not compare it.
    """

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def identity(self) -> tuple[tuple[str, Any], ...]:
        """The fields that make two nodes the same drawing and the same code."""
        return tuple(
            (f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)
            if not f.metadata.get("varies", False)
        )


P = TypeVar("P", bound=Params)


class Filler(Protocol):
    """Initialisers handed to :meth:`Op.init`; each fills a parameter at its full (unsharded) shape."""

    convention: str

    def __call__(self, param: Any, fn: Callable[[Any], Any]) -> None: ...

    def matrix(self, param: Any) -> None: ...

    def matrices(self, param: Any) -> None:
        """A stack of (E, out, in) matrices (the experts of an MoE MLP), each initialised as one."""

    def zeros(self, param: Any) -> None: ...

    def ones(self, param: Any) -> None: ...

    def children(self, module: nn.Module) -> None: ...


class Op:
    """One graph node kind. Subclasses set the class attributes and override what differs.

    Attributes:
        kind: the node's ``op`` string.
        names: more ``op`` strings of the same op: the names of its configurations (an attention is
            recorded as ``cross_attention``, ``window_attention`` ... by its parts).
        params_type: its :class:`Params` dataclass.
        category: the diagram colour category.
        module: ``"python.module:Class"`` of the ``nn.Module`` built for the node, or None for an op
            computed by an expression (:meth:`code`).
        ports: the input ports it accepts, the main one first.
        required: the ports that must be connected.
        any_ports: it accepts ports of any name (the output's dict keys).
        helpers: ``"python.module:function"`` of the functions its expression calls.
        value: the Python type of the node's value, as generated code annotates it.
    """

    kind: ClassVar[str]
    names: ClassVar[tuple[str, ...]] = ()
    params_type: ClassVar[type[Params]] = Params
    category: ClassVar[Category] = "structural"
    module: ClassVar[str | None] = None
    ports: ClassVar[tuple[str, ...]] = ("x",)
    required: ClassVar[tuple[str, ...]] = ("x",)
    any_ports: ClassVar[bool] = False
    helpers: ClassVar[tuple[str, ...]] = ()
    value: ClassVar[str] = "Tensor"

    def requires(self, p: Any) -> tuple[str, ...]:
        """The ports a node with these hyper-parameters must have connected."""
        return self.required

    def shape(self, p: Any, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        """The output shape; raises ValueError when the inputs do not fit."""
        return inputs["x"]

    def params(self, p: Any) -> int:
        """Parameters the node owns (0 for shared and tied weights)."""
        return 0

    def flops(self, p: Any, inputs: Mapping[str, tuple[int, ...]]) -> int:
        """FLOPs of one forward at concrete input shapes, as ``FlopCounterMode`` counts them."""
        return 0

    def useful_flops(self, p: Any, inputs: Mapping[str, tuple[int, ...]]) -> int:
        """The part of :meth:`flops` whose results are used: less where a dense kernel computes scores a
        static mask then hides (an attention's causal mask or sliding window); by default all of it."""
        return self.flops(p, inputs)

    def module_for(self, p: Any) -> str | None:
        """The module class built for a node with these hyper-parameters, or None for an expression op."""
        return self.module

    def ctor(self, p: Any) -> dict[str, Any]:
        """Keyword arguments of the module's constructor (module ops)."""
        return p.as_dict()

    def code(self, p: Any, args: Mapping[str, str]) -> str:
        """The Python expression computing the node from its inputs' variable names (expression ops)."""
        raise NotImplementedError(f"op {self.kind!r} builds a module; it has no expression")

    def init(self, module: nn.Module, p: Any, fill: Filler) -> None:
        """Initialise the module's parameters under ``fill.convention``; default: by layer type."""
        fill.children(module)

    def label(self, p: Any) -> tuple[str, ...]:
        """Key hyper-parameters for the diagram, one short line each."""
        return ()

    def note(self, p: Any) -> str | None:
        """What the model's totals should say about nodes of this op (the summary prints each note once)."""
        return None


OPS: dict[str, Op] = {}

OpType = TypeVar("OpType", bound=type[Op])


def op(cls: OpType) -> OpType:
    """Register an :class:`Op` subclass under its ``kind`` and its ``names``."""
    instance = cls()
    for name in (cls.kind, *cls.names):
        if name in OPS:
            raise ValueError(f"op kind {name!r} is defined twice")
        OPS[name] = instance
    return cls


# -------------------------------------------------------------------------------- lowering contexts


class ModelCtx(Protocol):
    """What a fragment's ``lower`` may use of the whole-model lowering (see :mod:`specvit.graph.lower`)."""

    @property
    def spec(self) -> SpecView: ...

    dims: Dims
    memory: dict[str, str]
    outputs: dict[str, tuple[str, str, Params]]
    """The model's outputs beside the head's: name -> (node, kind, params) of the head node computing it
    from that node (the MoE layers' ``router_loss`` from their last routing statistics)."""

    def add(
        self,
        path: str,
        kind: str,
        p: Params,
        srcs: Mapping[str, str] | None = None,
        *,
        source: str = "",
        stack: str = "",
        block: str | None = None,
        scope: str | None = None,
    ) -> str: ...

    def placeholder(
        self,
        path: str,
        arg: str,
        shape: Shape,
        *,
        dtype: str = "float",
        required: bool = True,
        keyword: bool = False,
        default: Any = None,
        vocab: int | None = None,
        source: str = "",
        stack: str = "",
        group: int = 0,
        what: str = "",
        local: str = "",
    ) -> str: ...

    def shape(self, node: str) -> Shape: ...


class StackCtx(ModelCtx, Protocol):
    """What a fragment's ``lower`` may use while one stack is lowered.

    Attributes:
        role: ``encoder`` or ``decoder``.
        stack: the stack's spec.
        x: the node holding the current tokens.
        n: the current token count.
        grid: the (rows, cols) token grid of an image or feature-map input, or None.
        side: named values the attention layers of the stack read: ``mask``, ``rope``, ``bias``,
            ``pos``, ``offset``, ``cache``, and for cross-attention ``memory``, ``memory_mask``,
            ``memory_pos``, ``memory_rope``.
    """

    role: str
    x: str
    n: Dim
    grid: tuple[int, int] | None
    side: dict[str, str]

    @property
    def stack(self) -> StackView: ...

    def arg(self, what: str) -> str: ...

    def total_flops(self, scope: str, useful: bool = False) -> int:
        """The FLOPs of the nodes drawn in ``scope`` (a stack); with ``useful``, their useful FLOPs."""
        ...
