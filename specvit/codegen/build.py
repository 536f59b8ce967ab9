"""Build a model from its graph: generated classes for the scopes, leaf modules for the module nodes.

Each scope gets a class whose methods are the generated source (:mod:`specvit.codegen.emit`), executed
once per class; blocks with equal signatures share one class. Leaf modules are constructed from each
node's op (:meth:`~specvit.ops.base.Op.module_for`, :meth:`~specvit.ops.base.Op.ctor`) on the meta device,
then materialised and initialised by :func:`init_weights` through each op's
:meth:`~specvit.ops.base.Op.init`, so that a normal build and a meta-device build followed by
``to_empty()`` and ``init_weights()`` give the same weights under the same seed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import linecache
from collections.abc import Callable, Iterator
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specvit.codegen.emit import methods
from specvit.codegen.scopes import Scope, analyse, block_container
from specvit.graph.ir import ArchGraph
from specvit.nn.attention import KVCache
from specvit.nn.mlp import XIELU
from specvit.nn.norm import Norm
from specvit.ops.embed import Ref

__all__ = ["class_names", "compile_graph", "init_weights", "resolve"]


@cache
def resolve(target: str) -> Any:
    """``"python.module:Name"`` -> the object."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@cache
def _takes_factory(cls: type) -> bool:
    """Whether a module class's constructor takes ``device`` and ``dtype``."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return "device" in params and "dtype" in params


def class_names(graph: ArchGraph, scopes: dict[str, Scope]) -> dict[str, str]:
    """Scope path -> generated class name: ``Model``, ``Encoder``, ``Head``, ``EncoderBlock``, ``EncoderBlock2``.

    Blocks with the same signature (:meth:`ArchGraph.signature`) share a name, hence a class.
    """
    names: dict[str, str] = {}
    kinds: dict[tuple[str, Any], str] = {}  # (role, what makes a block class) -> class name
    for path in scopes:
        if not path:
            names[path] = "Model"
        elif block_container(path) is None:
            names[path] = path.title().replace(".", "")
        else:
            role = path.split(".")[0].title()
            key = (role, (graph.signature(path), tuple(scopes[path].params.values())))
            if key not in kinds:
                count = sum(1 for r, _ in kinds if r == role)
                kinds[key] = f"{role}Block" + (str(count + 1) if count else "")
            names[path] = kinds[key]
    return names


def helper_names(graph: ArchGraph) -> dict[str, Any]:
    """The functions the generated expressions call, by name."""
    found: dict[str, Any] = {}
    for n in graph:
        for target in graph.op(n).helpers:
            found[target.partition(":")[2]] = resolve(target)
    return found


def _class(name: str, base: type, source: str, namespace: dict[str, Any]) -> type:
    """Execute the class body ``source`` (its methods) into a new class deriving from ``base``."""
    text = f"from __future__ import annotations\n\n\nclass {name}(_Base):\n{source}\n"
    filename = f"<specvit generated {name}>"
    linecache.cache[filename] = (
        len(text),
        None,
        text.splitlines(keepends=True),
        filename,
    )  # readable tracebacks
    scope = {**namespace, "_Base": base}
    exec(compile(text, filename, "exec"), scope)
    cls: type = scope[name]
    cls.__module__ = "specvit.generated"
    cls.__qualname__ = name
    return cls


def _classes(graph: ArchGraph, scopes: dict[str, Scope], root: type, block: type) -> dict[str, type]:
    names = class_names(graph, scopes)
    namespace = {"torch": torch, "F": F, "Tensor": torch.Tensor, "KVCache": KVCache, **helper_names(graph)}
    made: dict[str, type] = {}
    out: dict[str, type] = {}
    for path, scope in scopes.items():
        name = names[path]
        if name not in made:
            base = root if not path else block if block_container(path) is not None else nn.Module
            body = "\n\n".join(m.source for m in methods(graph, scopes, scope))
            made[name] = _class(name, base, body, namespace)
        out[path] = made[name]
    return out


def _leaf(graph: ArchGraph, path: str, built: dict[str, nn.Module], factory: dict[str, Any]) -> nn.Module:
    op, p = graph.op(path), graph[path]["p"]
    cls = resolve(op.module_for(p))
    kwargs = {k: built[v.path] if isinstance(v, Ref) else v for k, v in op.ctor(p).items()}
    return cls(**kwargs, **(factory if _takes_factory(cls) else {}))


def compile_graph(graph: ArchGraph, root: type, block: type, dtype: torch.dtype | None = None) -> nn.Module:
    """The model of ``graph``, its parameters on the meta device (uninitialised).

    Args:
        graph: the lowered spec.
        root: the base class of the model (a :class:`~specvit.model.SpecModel` subclass).
        block: the base class of every block.
        dtype: the parameters' dtype.
    """
    scopes = analyse(graph)
    classes = _classes(graph, scopes, root, block)
    model = classes[""](graph)
    made: dict[str, nn.Module] = {"": model}

    def ensure(path: str) -> nn.Module:
        if path in made:
            return made[path]
        parent_path, _, name = path.rpartition(".")
        parent = ensure(parent_path)
        obj: nn.Module = (
            classes[path]() if path in classes else nn.ModuleList() if _numbered(graph, path) else nn.Module()
        )
        if isinstance(parent, nn.ModuleList):
            assert int(name) == len(parent), f"{path}: modules of a list are built in order"
            parent.append(obj)
        else:
            parent.add_module(name, obj)
        made[path] = obj
        return obj

    factory = {"device": "meta", "dtype": dtype}
    built: dict[str, nn.Module] = {}
    with _skip_default_init():
        for path in graph.module_nodes():
            parent_path, _, name = path.rpartition(".")
            built[path] = _leaf(graph, path, built, factory)
            parent = ensure(parent_path)
            parent.add_module(name, built[path])
            made[path] = built[path]
        for path in scopes:
            ensure(path)
    return model


def _numbered(graph: ArchGraph, path: str) -> bool:
    """Whether the modules under ``path`` are numbered (``blocks.0``, ``blocks.1``): an ``nn.ModuleList``."""
    prefix = path + "."
    return any(n.startswith(prefix) and n[len(prefix) :].split(".")[0].isdigit() for n in graph)


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


@contextlib.contextmanager
def _skip_default_init() -> Iterator[None]:
    """Make torch.nn.init's functions no-ops while modules are constructed (as HF's ``no_init_weights``).

    The parameters live on the meta device and :func:`init_weights` draws every one of them afterwards (it
    raises on any parameter without a rule), so the default inits would be work thrown away: on ViT-H they
    are half of the build time. Not thread-safe: do not construct other modules in another thread meanwhile.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def skip(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, skip)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class _Filler:
    """The initialisers an op's ``init`` uses, under one convention; records what it filled."""

    def __init__(self, convention: str):
        self.convention = convention
        self.done: set[int] = set()

    def __call__(self, param: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> None:
        _fill_full(param, fn)
        self.done.add(id(param))

    def _matrix(self, w: torch.Tensor) -> None:
        if self.convention == "xavier":
            nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        elif self.convention == "vit":
            nn.init.trunc_normal_(w, std=0.02)
        else:
            nn.init.normal_(w, std=0.02)

    def _embedding(self, w: torch.Tensor, padding_idx: int | None) -> None:
        self._matrix(w)
        if padding_idx is not None:
            w[padding_idx].zero_()

    def matrix(self, param: torch.Tensor) -> None:
        self(param, self._matrix)

    def matrices(self, param: torch.Tensor) -> None:
        self(param, self._stacked)

    def _stacked(self, w: torch.Tensor) -> None:
        for matrix in w:  # (E, out, in): each (out, in) on its own fans, not one (E, out * in) matrix
            self._matrix(matrix)

    def zeros(self, param: torch.Tensor) -> None:
        self(param, nn.init.zeros_)

    def ones(self, param: torch.Tensor) -> None:
        self(param, nn.init.ones_)

    def children(self, module: nn.Module) -> None:
        """Initialise ``module`` and its descendants by layer type: matrices by the convention, biases
        zero, norms one and zero, embeddings by the convention with a zero padding row."""
        for m in module.modules():
            if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d):
                self.matrix(m.weight)
                if m.bias is not None:
                    self.zeros(m.bias)
            elif isinstance(m, nn.Embedding):
                self(m.weight, partial(self._embedding, padding_idx=m.padding_idx))
            elif isinstance(
                m, nn.LayerNorm | nn.RMSNorm | Norm | nn.GroupNorm | nn.BatchNorm1d | nn.BatchNorm2d
            ):
                if m.weight is not None:
                    (self.zeros if getattr(m, "unit_offset", False) else self.ones)(m.weight)
                if getattr(m, "bias", None) is not None:
                    self.zeros(m.bias)  # type: ignore[arg-type]
                if isinstance(
                    m, nn.BatchNorm1d | nn.BatchNorm2d
                ):  # built on the meta device: no statistics yet
                    with torch.no_grad():
                        m.reset_running_stats()
            elif isinstance(m, XIELU):
                for name, value in XIELU.INIT.items():
                    self(getattr(m, name), partial(nn.init.constant_, val=value))
                m.reset_buffers()


def _fill_full(param: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> None:
    """Initialise ``param`` in place with ``fn``; a sharded DTensor gets its shard of the full tensor.

    ``fn`` always sees a tensor of the parameter's full shape, so the random stream it draws from (and hence
    every value) is the same on one process as under FSDP, on every rank. A parameter left on the meta device
    (a pipeline stage's rank holds only its stages' weights) is drawn on a CPU scratch tensor and stays meta,
    so that the weights after it are still the ones a whole build draws.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if param.is_meta:
            fn(torch.empty(param.shape, dtype=param.dtype))
        elif isinstance(param, DTensor):
            local = param.to_local()
            full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
            fn(full)
            local.copy_(
                distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            )
        else:
            fn(param)


def init_weights(model: nn.Module, graph: ArchGraph, convention: str) -> None:
    """Initialise every parameter of ``model`` by each module node's op, in graph order.

    Works on plain and on FSDP2-sharded models: each parameter is drawn at its full shape, so the
    weights equal a single-process build's under the same ``torch.manual_seed``.

    Args:
        model: the model compiled from ``graph``.
        graph: its graph.
        convention: ``vit`` (timm/HF ViT: trunc-normal 0.02 weights, zero biases, 1e-6 class token, zero
            classifier), ``xavier`` (torch.nn.Transformer: xavier-uniform matrices, zero biases) or
            ``normal`` (BERT/GPT-2: N(0, 0.02) weights and embeddings, zero biases).

    Raises:
        RuntimeError: a parameter no op initialised.
    """
    fill = _Filler(convention)
    for path in graph.module_nodes():
        graph.op(path).init(model.get_submodule(path), graph[path]["p"], fill)
    missed = [name for name, p in model.named_parameters() if id(p) not in fill.done]
    if missed:
        raise RuntimeError(f"init_weights has no rule for {', '.join(missed)}")
