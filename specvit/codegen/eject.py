"""``specvit eject``: a model's graph as one standalone, readable PyTorch file.

The file holds the generated classes (one per block kind, one per stack, the head, ``Model``) with the
very forwards a compiled model runs, an ``__init__`` that constructs each layer, and the source of every
layer class and helper they call, specialised to this model (:mod:`specvit.codegen.specialise`). A layer
is written plainly where :mod:`specvit.codegen.templates` has a counterpart computing it (``nn.Linear``,
``F.scaled_dot_product_attention``), else from its own source with the fast paths written as plain torch.
A decoder's ``Model`` gets ``generate()``. It imports only torch and the standard library; ``Model()``
takes no arguments and has the compiled model's state_dict keys.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specvit.codegen.build import class_names, compile_graph, helper_names, resolve
from specvit.codegen.emit import methods, wrap
from specvit.codegen.fold import unparse
from specvit.codegen.functions import reachable, specialise_helpers
from specvit.codegen.lines import split_line
from specvit.codegen.scopes import analyse, attr_path, block_container
from specvit.codegen.sources import dependencies, import_block, plain_calls, renames
from specvit.codegen.specialise import Facts, rewrite_function, specialise
from specvit.codegen.templates import DecoderGenerate, EncoderDecoderGenerate, decoding, template_for
from specvit.codegen.text import (
    class_doc,
    container_source,
    format_file,
    generate_source,
    spec_note,
    with_doc,
)
from specvit.codegen.tidy import dead_attributes, drop_attributes, drop_unused_params
from specvit.graph.ir import ArchGraph
from specvit.ops.embed import Ref

__all__ = ["eject_source"]

_TEMPLATES = "specvit.codegen.templates"


class _Root(nn.Module):
    def __init__(self, graph: ArchGraph):
        super().__init__()


def _is_torch(cls: type) -> bool:
    return cls.__module__.startswith("torch.")


def _plain_value(v: Any) -> bool:
    """A value an attribute or argument folds on: a Python scalar, a string, None, or a tuple of them."""
    if isinstance(v, tuple):
        return all(_plain_value(x) for x in v)
    return isinstance(v, bool | int | float | str | type(None))


def _common(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The items every dict has with the same plain value."""
    first = dicts[0]
    return {
        k: v
        for k, v in first.items()
        if _plain_value(v) and all(k in d and type(d[k]) is type(v) and d[k] == v for d in dicts)
    }


class _Ejector:
    """Chooses, specialises and calls the layer classes of one ejected file."""

    def __init__(self, graph: ArchGraph, general: set[str]):
        self.graph = graph
        self.general = general  # layer classes other code builds too: the library's, written whole
        self.scopes = analyse(graph)
        self.names = class_names(graph, self.scopes)
        self.model = compile_graph(graph, _Root, nn.Module, None)
        self.leaves = self._choose()  # module node -> (class, constructor arguments)
        self.users: dict[type, list[str]] = {}  # each written class -> its module nodes
        for path, (cls, _) in self.leaves.items():
            if not _is_torch(cls):
                self.users.setdefault(cls, []).append(path)
        self.sources = {cls: self._source(cls) for cls in self.users}
        self._varying: dict[str, dict[str, dict[str, list[Any]]]] = {}

    def _source(self, cls: type) -> str:
        """A layer class's source: specialised to this model, or whole when other code builds it too."""
        if cls.__name__ not in self.general:
            return specialise(cls, self.facts(cls))
        module = inspect.getmodule(cls)
        assert module is not None
        source = textwrap.dedent(inspect.getsource(cls))
        return rewrite_function(source, module, renames(module), plain_calls(module), _called_from_outside())

    def _choose(self) -> dict[str, tuple[type, dict[str, Any]]]:
        """Each module node's class: torch's own, a plain template, or the library's (every node of a library
        class takes a template, or none does: one class of a name in the file)."""
        uses: dict[str, list[str]] = {}
        for n in self.graph.module_nodes():
            uses.setdefault(self.graph.op(n).module_for(self.graph[n]["p"]) or "", []).append(n)
        out: dict[str, tuple[type, dict[str, Any]]] = {}
        for target, nodes in uses.items():
            ctors = [self.graph.op(n).ctor(self.graph[n]["p"]) for n in nodes]
            plain = [template_for(target, kw) for kw in ctors]
            if any(t is not None and t[0].__name__ in self.general for t in plain):
                plain = [None]  # a library class of that name is built by other code: the library's
            for n, kw, t in zip(nodes, ctors, plain, strict=True):
                out[n] = t if t is not None and all(plain) else (resolve(target), kw)
        return out

    def facts(self, cls: type) -> Facts:
        """What is constant in ``cls`` across this model."""
        paths = self.users[cls]
        kwargs = [self.leaves[p][1] for p in paths]
        template = cls.__module__.startswith(_TEMPLATES)
        if template:
            with torch.device("meta"):
                modules = [cls(**kw) for kw in kwargs]
        else:
            modules = [self.model.get_submodule(p) for p in paths]
        attrs = _common([{k: v for k, v in vars(m).items() if not k.startswith("_")} for m in modules])
        wired = {d["port"] for p in paths for _, _, d in self.graph.nx.in_edges(p, data=True)}
        forward = inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
        absent = {
            k: v.default
            for k, v in forward.items()
            if v.kind is v.KEYWORD_ONLY and v.default is not v.empty and k not in wired
        }
        init = _common(kwargs)
        params = inspect.signature(cls).parameters
        init |= {k: None for k in ("device", "dtype") if k in params}  # built where torch builds
        unsaid = {
            k: p.default for k, p in params.items() if p.default is not p.empty and _plain_value(p.default)
        }
        init |= {
            k: v for k, v in unsaid.items() if all(k not in kw for kw in kwargs)
        }  # every use: the default
        module = inspect.getmodule(cls)
        if template:
            return Facts(attrs, absent, init, module, renames(module))
        return Facts(
            attrs, absent, init, module, renames(module), plain_calls(module), _called_from_outside()
        )

    def tidy(self, others: list[str]) -> set[str]:
        """Drop the attributes no source reads, then the constructor parameters nothing reads; the attributes
        dropped."""
        dead = dead_attributes([*self.sources.values(), *others])
        for cls, source in self.sources.items():
            self.sources[cls] = drop_unused_params(drop_attributes(source, dead))
        return dead

    def args(self, path: str, defaults: bool = False) -> dict[str, Any]:
        """The constructor arguments of module node ``path``'s class as written, in its parameters' order:
        those its (specialised) ``__init__`` takes, at their defaults too if ``defaults``, else not."""
        cls, kwargs = self.leaves[path]
        own = not _is_torch(cls) and _has_init(self.sources[cls])
        params = _init_defaults(self.sources[cls]) if own else _defaults(cls)  # else torch's (inherited)
        return {
            k: kwargs.get(k, d)
            for k, d in params.items()
            if (k in kwargs or (defaults and d is not _NO_DEFAULT)) and (defaults or not _same(d, kwargs[k]))
        }

    def ctor(self, path: str, refs: dict[str, str], varying: dict[str, str]) -> str:
        """The constructor call of module node ``path``: ``nn.Linear(768, 1000)``, ``Attention(dim=768, ...)``.
        A torch module takes its leading arguments positionally, as people write them."""
        cls, _ = self.leaves[path]
        name = f"nn.{cls.__name__}" if _is_torch(cls) else cls.__name__
        params = list(inspect.signature(cls).parameters.values())
        parts, positional = [], _is_torch(cls)
        args = self.args(path)
        args |= {k: v for k, v in self.args(path, defaults=True).items() if k in varying}
        args = {k: args[k] for k in self.args(path, defaults=True) if k in args}
        for i, (key, value) in enumerate(args.items()):
            text = refs[value.path] if isinstance(value, Ref) else varying.get(key) or _literal(value)
            p = params[i] if i < len(params) else None
            positional = positional and p is not None and p.name == key and (p.default is p.empty or i == 0)
            parts.append(text if positional else f"{key}={text}")
        return f"{name}({', '.join(parts)})"

    # -- the generated classes ---------------------------------------------------------------------

    def varying(self, name: str) -> dict[str, dict[str, list[Any]]]:
        """For block class ``name``: leaf -> constructor argument -> its value in each instance, when they differ."""
        if name not in self._varying:
            self._varying[name] = self._find_varying(name)
        return self._varying[name]

    def _find_varying(self, name: str) -> dict[str, dict[str, list[Any]]]:
        instances = self.instances(name)
        out: dict[str, dict[str, list[Any]]] = {}
        for leaf in (n for n in self.graph.module_nodes() if self.graph[n]["scope"] == instances[0]):
            rel = leaf[len(instances[0]) + 1 :]
            per = [self.args(f"{s}.{rel}", defaults=True) for s in instances]
            for key in per[0]:
                values = [kw.get(key) for kw in per]
                if any(v != values[0] for v in values):
                    out.setdefault(rel, {})[key] = values
        return out

    def instances(self, name: str) -> list[str]:
        """The scopes of generated class ``name``, blocks in their order (``blocks.2`` before ``blocks.10``)."""
        found = [s for s, n in self.names.items() if n == name]
        return sorted(found, key=lambda s: (c[0], c[1]) if (c := block_container(s)) else (s, 0))

    def param_names(self, name: str) -> dict[tuple[str, str], str]:
        """(leaf, argument) -> the block class's parameter for it: the argument's name, or ``leaf_argument``
        where two leaves vary one of the same name."""
        varying = self.varying(name)
        keys = [k for keys in varying.values() for k in keys]
        return {
            (rel, k): k if keys.count(k) == 1 else f"{rel.replace('.', '_')}_{k}"
            for rel, ks in varying.items()
            for k in ks
        }

    def refs_of(self, scope: str) -> list[str]:
        """The modules of other scopes that leaves of ``scope`` use (tied and shared weights)."""
        found = []
        for n in self.graph.module_nodes():
            if self.graph[n]["scope"] == scope:
                for value in self.leaves[n][1].values():
                    if isinstance(value, Ref) and self.graph[value.path]["scope"] != scope:
                        found.append(value.path)
        return found

    def construct(self, scope: str, module: nn.Module, path: str, refs: dict[str, str]) -> str:
        """The expression building ``module`` (at graph path ``path``) inside scope ``scope``'s ``__init__``."""
        if path in self.leaves:
            rel = path[len(scope) + 1 :]
            named = self.param_names(self.names[scope]) if block_container(scope) else {}
            return self.ctor(path, refs, {k: v for (r, k), v in named.items() if r == rel})
        if path in self.scopes:
            return self.call(path, refs)
        children = [
            (name, self.construct(scope, child, f"{path}.{name}", refs))
            for name, child in module.named_children()
        ]
        if isinstance(module, nn.ModuleList):
            return self.module_list(path, [c for _, c in children])
        return "_container(" + ", ".join(f"{name}={expr}" for name, expr in children) + ")"

    def call(self, scope: str, refs: dict[str, str]) -> str:
        """The constructor call of a generated class for scope ``scope``."""
        args = [f"{p.replace('.', '_')}={refs.get(p, 'self.' + attr_path(p))}" for p in self.refs_of(scope)]
        instance = self.instances(self.names[scope])
        if block_container(scope):
            named = self.param_names(self.names[scope])
            for rel, keys in self.varying(self.names[scope]).items():
                for key, values in keys.items():
                    args.append(f"{named[rel, key]}={_literal(values[instance.index(scope)])}")
        return f"{self.names[scope]}({', '.join(args)})"

    def module_list(self, path: str, items: list[str]) -> str:
        blocks = [f"{path}.{i}" for i in range(len(items))]
        if items and all(b in self.scopes for b in blocks) and len({self.names[b] for b in blocks}) == 1:
            name = self.names[blocks[0]]
            progression = _progressions(self.varying(name), self.param_names(name), len(blocks))
            if progression is not None:
                index = "i" if progression else "_"
                return (
                    f"nn.ModuleList([{name}({', '.join(progression)}) for {index} in range({len(blocks)})])"
                )
        return "nn.ModuleList([" + ", ".join(items) + "])"

    def scope_class(self, scope: str) -> str:
        name = self.names[scope]
        module = self.model.get_submodule(scope) if scope else self.model
        refs = self.refs_of(scope)
        params = [f"{r.replace('.', '_')}: nn.Module" for r in refs]
        ref_names = {r: r.replace(".", "_") for r in refs}
        if block_container(scope):
            named = self.param_names(name)
            for rel, keys in self.varying(name).items():
                params += [f"{named[rel, k]}: {type(v[0]).__name__}" for k, v in keys.items()]
        for n in self.graph.module_nodes():  # a leaf using a module of its own scope
            if self.graph[n]["scope"] == scope:
                for value in self.leaves[n][1].values():
                    if isinstance(value, Ref) and value.path not in ref_names:
                        ref_names[value.path] = "self." + attr_path(
                            value.path[len(scope) + 1 :] if scope else value.path
                        )
        body = ["super().__init__()"]
        for child_name, child in module.named_children():
            path = f"{scope}.{child_name}" if scope else child_name
            body.append(f"self.{child_name} = {self.construct(scope, child, path, ref_names)}")
        signature = "self" + (", *, " + ", ".join(params) if params else "")
        lines = wrap(f"def __init__({signature}) -> None:", "    ")
        for line in body:
            lines += split_line(line, "        ")
        generated = [m.source for m in methods(self.graph, self.scopes, self.scopes[scope])]
        if not scope:
            generated += generate_source(self.graph, _generate_template(self.graph))
        doc = class_doc(self.graph, scope, [c for c, _ in module.named_children()], self.scopes)
        return (
            f"class {name}(nn.Module):\n{doc}\n\n" + "\n".join(lines) + "\n\n" + "\n\n".join(generated) + "\n"
        )


def _generate_template(graph: ArchGraph) -> str | None:
    """The source of the ``generate`` a model of ``graph``'s kind gets: a decoder of tokens (its forward takes
    a KV cache and the decoding offset) gets one; others (an encoder, MAE's decoder of pixels, a decoder reading
    its source shifted right: no ``tgt``) none."""
    args = {graph[n]["p"].arg for n in graph.placeholders()}
    owner = {"decoder": DecoderGenerate, "encoder_decoder": EncoderDecoderGenerate}.get(graph.kind)
    if (
        not {"cache", "offset"} <= args
        or owner is None
        or (graph.kind == "encoder_decoder" and "tgt" not in args)
    ):
        return None
    return textwrap.dedent(inspect.getsource(owner.generate))  # type: ignore[attr-defined]


_NO_DEFAULT = object()


def _defaults(cls: type) -> dict[str, Any]:
    """A torch module's constructor parameters and their defaults (``_NO_DEFAULT`` for the required)."""
    params = inspect.signature(cls).parameters.values()
    return {p.name: _NO_DEFAULT if p.default is p.empty else p.default for p in params}


@functools.cache
def _called_from_outside() -> frozenset[str]:
    """Private methods specvit's layers call on other objects (``owner._attend(...)``): a layer class keeps
    them whole."""
    import specvit.nn

    found = set()
    for path in Path(specvit.nn.__file__).parent.glob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            private = isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
            if private and not (isinstance(n.value, ast.Name) and n.value.id == "self"):  # type: ignore[attr-defined]
                found.add(n.attr)  # type: ignore[attr-defined]
    return frozenset(found)


def _has_init(source: str) -> bool:
    klass = ast.parse(source).body[0]
    return isinstance(klass, ast.ClassDef) and any(
        isinstance(f, ast.FunctionDef) and f.name == "__init__" for f in klass.body
    )


@functools.cache
def _init_defaults(source: str) -> dict[str, Any]:
    """The ``__init__`` parameters of a class's source and their literal defaults (``_NO_DEFAULT``)."""
    klass = ast.parse(source).body[0]
    assert isinstance(klass, ast.ClassDef)
    init = next((f for f in klass.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None:
        return {}
    args = init.args
    out: dict[str, Any] = {a.arg: _NO_DEFAULT for a in args.args[1:]}
    for a, d in zip(args.args[len(args.args) - len(args.defaults) :], args.defaults, strict=True):
        out[a.arg] = _literal_default(d)
    for a, kd in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out[a.arg] = _NO_DEFAULT if kd is None else _literal_default(kd)
    return out


def _literal_default(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _NO_DEFAULT


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def _literal(value: Any) -> str:
    """A constructor argument as source, strings double-quoted."""
    return (
        unparse(ast.Constant(value))
        if not isinstance(value, tuple)
        else unparse(ast.parse(repr(value), mode="eval"))
    )


def _progressions(
    varying: dict[str, dict[str, list[Any]]], named: dict[tuple[str, str], str], n: int
) -> list[str] | None:
    """``key=a * i + b`` for each varying argument, if every one is an integer progression; else None."""
    out = []
    for rel, keys in varying.items():
        for key, values in keys.items():
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values) or n < 2:
                return None
            step = values[1] - values[0]
            if any(values[i] != values[0] + step * i for i in range(n)):
                return None
            expr = " + ".join(
                t for t in (f"{step} * i" if step != 1 else "i", str(values[0]) if values[0] else "") if t
            )
            out.append(f"{named[rel, key]}={expr}")
    return out


def _names(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}


def _defined(source: str) -> str:
    node = ast.parse(source).body[0]
    return getattr(node, "name", "") or ast.unparse(getattr(node, "targets", [node])[0])


def _document(definitions: list[str], layers: dict[str, list[str]], graph: ArchGraph) -> list[str]:
    """The definitions, each class among them with a docstring naming the spec lines of the layers that use
    it (directly, or through the functions they call)."""
    by_name = {_defined(d): d for d in definitions}
    users: dict[str, list[str]] = {}
    for source, paths in layers.items():
        seen, todo = set(), list(_names(source))
        while todo:
            name = todo.pop()
            if name in by_name and name not in seen:
                seen.add(name)
                users.setdefault(name, []).extend(paths)
                todo += _names(by_name[name])
    return [
        with_doc(d, spec_note(graph, users.get(_defined(d), []))) if d.startswith("class ") else d
        for d in definitions
    ]


def eject_source(graph: ArchGraph, origin: str = "", *, use_ruff: bool = True) -> str:
    """The standalone PyTorch source of ``graph``'s model.

    Args:
        graph: the lowered spec.
        origin: where the spec came from, for the file's docstring.
        use_ruff: pass the text through ``ruff format`` when ruff is installed (specvit writes it formatted
            already: the tests check the text without).
    """
    general: set[str] = set()
    while True:  # until no layer class is also built by other code (then written whole, the library's)
        e = _Ejector(graph, general)
        rank = {"": 3, "head": 2}  # blocks, stacks, the head, the model
        order = sorted(e.scopes, key=lambda s: (0 if block_container(s) else rank.get(s, 1), s))
        forwards = "\n".join(m.source for s in order for m in methods(graph, e.scopes, e.scopes[s]))
        helpers = {h: fn for h, fn in helper_names(graph).items() if f"{h}(" in forwards}
        helper_sources = [
            (textwrap.dedent(inspect.getsource(fn)), inspect.getmodule(fn)) for fn in helpers.values()
        ]
        generate = _generate_template(graph)
        sources = [(e.sources[cls], inspect.getmodule(cls)) for cls in e.users] + helper_sources
        sources += [(generate, decoding)] if generate else []
        if "KVCache" in forwards:
            sources.append(("KVCache", decoding))
        defined = {cls.__name__ for cls in e.users} | set(helpers)
        definitions, imports = dependencies(sources, defined)  # type: ignore[arg-type]
        layers = {cls.__name__ for cls in e.users}
        built = {n for d in [*definitions, *(src for src, _ in sources)] for n in _names(d) - {_defined(d)}}
        if built & layers <= general:
            break
        general |= built & layers
    others = [src for src, _ in helper_sources] + ([generate] if generate else [])
    classes = list(e.users)
    layer_sources = [e.sources[c] for c in classes]
    keep = _called_from_outside()
    definitions, layer_sources = specialise_helpers(definitions, layer_sources, others, set(), keep)
    e.sources = dict(zip(classes, layer_sources, strict=True))
    definitions = reachable(definitions, [*layer_sources, *others, f"class _Forwards:\n{forwards}"])
    dead = e.tidy([*definitions, *(s for s, _ in helper_sources)])
    definitions = [drop_attributes(d, dead) for d in definitions]
    generated: dict[str, str] = {}
    for scope in order:
        if e.names[scope] not in generated:
            generated[e.names[scope]] = e.scope_class(scope)
    body = [
        *_document(definitions, {e.sources[c]: paths for c, paths in e.users.items()}, graph),
        *(s for s, _ in helper_sources),
        *(with_doc(e.sources[cls], spec_note(graph, paths)) for cls, paths in e.users.items()),
        *([container_source()] if any("_container(" in s for s in generated.values()) else []),
        *generated.values(),
    ]
    return format_file(graph, origin, body, imports, import_block, use_ruff)
