"""``specvit eject``: a model's graph as one standalone, readable PyTorch file.

The file holds the generated classes (one per block kind, one per stack, the head, ``Model``) with the
very forwards a compiled model runs, an ``__init__`` that constructs each layer with the arguments the
compiler uses, and the source of every layer class and helper they call, specialised to this model
(:mod:`specvit.codegen.specialise`). It imports only torch and the standard library; ``Model()`` takes no
arguments and has the compiled model's state_dict keys.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
import types
from collections.abc import Iterable
from typing import Any

from torch import nn

from specvit.codegen.build import class_names, compile_graph, helper_names, resolve
from specvit.codegen.emit import methods, wrap
from specvit.codegen.scopes import analyse, attr_path, block_container
from specvit.codegen.specialise import Facts, specialise
from specvit.graph.ir import ArchGraph
from specvit.ops.embed import Ref

__all__ = ["eject_source"]

_CONTAINER = '''
def _container(**children: nn.Module) -> nn.Module:
    """A module that only holds others (a stage of blocks, a downsampling step)."""
    module = nn.Module()
    for name, child in children.items():
        module.add_module(name, child)
    return module
'''


class _Root(nn.Module):
    def __init__(self, graph: ArchGraph):
        super().__init__()


def _ctor(
    graph: ArchGraph, path: str, refs: dict[str, str], varying: dict[str, str], folded: set[str]
) -> str:
    """The constructor call of module node ``path``: ``nn.Linear(in_features=768, ...)``, without the
    arguments ``folded`` into the specialised class."""
    op, p = graph.op(path), graph[path]["p"]
    cls = resolve(op.module_for(p))
    name = f"nn.{cls.__name__}" if cls.__module__.startswith("torch.") else cls.__name__
    args = []
    for key, value in op.ctor(p).items():
        if key in folded:
            continue
        if isinstance(value, Ref):
            args.append(f"{key}={refs[value.path]}")
        elif key in varying:
            args.append(f"{key}={varying[key]}")
        else:
            args.append(f"{key}={value!r}")
    return f"{name}({', '.join(args)})"


class _Ejector:
    """Collects the classes, layer sources and imports of one ejected file."""

    def __init__(self, graph: ArchGraph):
        self.graph = graph
        self.scopes = analyse(graph)
        self.names = class_names(graph, self.scopes)
        self.model = compile_graph(graph, _Root, nn.Module, None)
        self._facts: dict[type, Facts] = {}
        self.leaf_classes: dict[type, list[str]] = {}  # class -> its module nodes
        self.general: set[str] = (
            set()
        )  # layer classes other code also builds: written in full, not specialised
        for n in graph.module_nodes():
            self.leaf_classes.setdefault(resolve(graph.op(n).module_for(graph[n]["p"])), []).append(n)

    # -- the generated classes ---------------------------------------------------------------------

    def varying(self, name: str) -> dict[str, dict[str, list[Any]]]:
        """For block class ``name``: leaf -> constructor argument -> its value in each instance, when they differ."""
        instances = [s for s, n in self.names.items() if n == name]
        out: dict[str, dict[str, list[Any]]] = {}
        for leaf in (n for n in self.graph.module_nodes() if self.graph[n]["scope"] == instances[0]):
            rel = leaf[len(instances[0]) + 1 :]
            per = [self.graph.op(f"{s}.{rel}").ctor(self.graph[f"{s}.{rel}"]["p"]) for s in instances]
            for key in per[0]:
                values = [kw[key] for kw in per]
                if any(v != values[0] for v in values):
                    out.setdefault(rel, {})[key] = values
        return out

    def refs_of(self, scope: str) -> list[str]:
        """The modules of other scopes that leaves of ``scope`` use (tied and shared weights)."""
        found = []
        for n in self.graph.module_nodes():
            if self.graph[n]["scope"] != scope:
                continue
            for value in self.graph.op(n).ctor(self.graph[n]["p"]).values():
                if isinstance(value, Ref) and self.graph[value.path]["scope"] != scope:
                    found.append(value.path)
        return found

    def construct(self, scope: str, module: nn.Module, path: str, refs: dict[str, str]) -> str:
        """The expression building ``module`` (at graph path ``path``) inside scope ``scope``'s ``__init__``."""
        g = self.graph
        if path in g.nx and g[path]["module"]:
            params = self.varying(self.names[scope]) if block_container(scope) else {}
            rel = path[len(scope) + 1 :]
            cls = resolve(g.op(path).module_for(g[path]["p"]))
            folded = (  # constants the specialiser folds into the class's own __init__
                set(self.facts(cls).init)
                if cls in self.leaf_classes
                and cls.__name__ not in self.general
                and not cls.__module__.startswith("torch.")
                and "__init__" in vars(cls)
                else set()
            )
            return _ctor(
                g, path, refs, {k: f"{rel.replace('.', '_')}_{k}" for k in params.get(rel, {})}, folded
            )
        if path in self.scopes:
            return self.call(path, refs)
        children = [
            (name, self.construct(scope, child, f"{path}.{name}", refs))
            for name, child in module.named_children()
        ]
        if isinstance(module, nn.ModuleList):
            return self.module_list(scope, path, [c for _, c in children])
        return "_container(" + ", ".join(f"{name}={expr}" for name, expr in children) + ")"

    def call(self, scope: str, refs: dict[str, str]) -> str:
        """The constructor call of a generated class for scope ``scope``."""
        args = [f"{p.replace('.', '_')}={refs.get(p, 'self.' + attr_path(p))}" for p in self.refs_of(scope)]
        instance = [s for s, n in self.names.items() if n == self.names[scope]]
        for rel, keys in self.varying(self.names[scope]).items() if block_container(scope) else []:
            for key, values in keys.items():
                args.append(f"{rel.replace('.', '_')}_{key}={values[instance.index(scope)]!r}")
        return f"{self.names[scope]}({', '.join(args)})"

    def module_list(self, scope: str, path: str, items: list[str]) -> str:
        blocks = [f"{path}.{i}" for i in range(len(items))]
        if items and all(b in self.scopes for b in blocks) and len({self.names[b] for b in blocks}) == 1:
            varying = self.varying(self.names[blocks[0]])
            progression = _progressions(varying, len(blocks))
            if progression is not None:
                call = f"{self.names[blocks[0]]}({', '.join(progression)})"
                return (
                    f"nn.ModuleList([{call} for i in range({len(blocks)})])"
                    if progression
                    else f"nn.ModuleList([{call} for _ in range({len(blocks)})])"
                )
        inner = "".join(f"\n            {item}," for item in items)
        return f"nn.ModuleList([{inner}\n        ])"

    def scope_class(self, scope: str, written: set[str]) -> str:
        name = self.names[scope]
        module = self.model.get_submodule(scope) if scope else self.model
        refs = self.refs_of(scope)
        params = [f"{r.replace('.', '_')}: nn.Module" for r in refs]
        ref_names = {r: r.replace(".", "_") for r in refs}
        for rel, keys in (self.varying(name) if block_container(scope) else {}).items():
            params += [f"{rel.replace('.', '_')}_{k}: {type(v[0]).__name__}" for k, v in keys.items()]
        for n in self.graph.module_nodes():  # a leaf using a module of its own scope
            if self.graph[n]["scope"] == scope:
                for value in self.graph.op(n).ctor(self.graph[n]["p"]).values():
                    if isinstance(value, Ref) and value.path not in ref_names:
                        ref_names[value.path] = "self." + attr_path(
                            value.path[len(scope) + 1 :] if scope else value.path
                        )
        body = ["super().__init__()"]
        for child_name, child in module.named_children():
            path = f"{scope}.{child_name}" if scope else child_name
            body.append(f"self.{child_name} = {self.construct(scope, child, path, ref_names)}")
        signature = "self" + (", *, " + ", ".join(params) if params else "")
        doc = _class_doc(self.graph, scope)
        lines = wrap(f"def __init__({signature}) -> None:", "    ")
        for line in body:
            lines += wrap(line, "        ")
        init = "\n".join(lines)
        generated = "\n\n".join(m.source for m in methods(self.graph, self.scopes, self.scopes[scope]))
        written.add(name)
        return f'class {name}(nn.Module):\n    """{doc}"""\n\n{init}\n\n{generated}\n'

    # -- the layer classes and helpers --------------------------------------------------------------

    def facts(self, cls: type) -> Facts:
        """What is constant in layer class ``cls`` across this model (cached)."""
        if cls not in self._facts:
            self._facts[cls] = self._find_facts(cls)
        return self._facts[cls]

    def _find_facts(self, cls: type) -> Facts:
        nodes = self.leaf_classes[cls]
        modules = [self.model.get_submodule(n) for n in nodes]
        attrs = _common([{k: v for k, v in vars(m).items() if not k.startswith("_")} for m in modules])
        ctors = [self.graph.op(n).ctor(self.graph[n]["p"]) for n in nodes]
        wired = {d["port"] for n in nodes for _, _, d in self.graph.nx.in_edges(n, data=True)}
        forward = inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
        absent = {
            k for k, v in forward.items() if v.kind is v.KEYWORD_ONLY and v.default is None and k not in wired
        }
        return Facts(attrs, absent, _common(ctors))


def _common(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The items every dict has with the same value."""
    first = dicts[0]
    return {
        k: v for k, v in first.items() if all(k in d and d[k] == v and type(d[k]) is type(v) for d in dicts)
    }


def _progressions(varying: dict[str, dict[str, list[Any]]], n: int) -> list[str] | None:
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
            out.append(f"{rel.replace('.', '_')}_{key}={expr}")
    return out


def _class_doc(graph: ArchGraph, scope: str) -> str:
    if not scope:
        return f"{graph.name}: {graph.kind.replace('_', '-')} model."
    container = block_container(scope)
    if container is not None:
        return f"A block of {container[0]}."
    return "The head." if scope == "head" else f"The {scope}."


def _dependencies(
    sources: Iterable[tuple[str, types.ModuleType]], leaves: set[str], helpers: Iterable[str] = ()
) -> tuple[list[str], list[str], set[str]]:
    """The definitions (source text) and import lines the given sources need, in dependency order, and
    which of the layer classes named ``leaves`` (written separately) they call; the ``helpers`` are among
    the sources (functions a layer may call too, such as ``to_map``), so never defined again."""
    definitions: dict[str, str] = {}
    imports: set[str] = set()
    order: list[str] = []
    called: set[str] = set()

    def visit(source: str, module: types.ModuleType, own: str) -> None:
        tree = ast.parse(source)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        called.update((used & leaves) - {own})
        for name in sorted(used - {own}):
            value = module.__dict__.get(name)
            if value is None or name in definitions or name in leaves or name in helpers:
                continue
            origin = getattr(value, "__module__", "") or ""
            if isinstance(value, types.ModuleType):
                imports.add(_import_module(name, value))
                continue
            home = module
            if (constant := _constant(module, name)) is not None:  # MASKED = -100.0, QkNorm = Literal[...]
                definitions[name], home = constant
            elif origin.startswith("specvit.") and (inspect.isfunction(value) or inspect.isclass(value)):
                definitions[name] = textwrap.dedent(inspect.getsource(value))
                home = inspect.getmodule(value) or module  # its own names are resolved where it is defined
            elif origin:
                imports.add(f"from {origin} import {name}")
                continue
            else:
                continue
            visit(definitions[name], home, name)
            order.append(name)

    for source, module in sources:
        visit(source, module, "")
    return [definitions[n] for n in order], sorted(imports), called


def _import_block(lines: set[str]) -> str:
    """Import lines merged per module, the standard library first, then torch."""
    plain = sorted(line for line in lines if line.startswith("import "))
    names: dict[str, set[str]] = {}
    for line in lines:
        if line.startswith("from "):
            module, _, imported = line[5:].partition(" import ")
            names.setdefault(module, set()).update(n.strip() for n in imported.split(","))
    froms = [f"from {m} import {', '.join(sorted(n))}" for m, n in sorted(names.items())]
    stdlib = [line for line in plain + froms if line.split()[1].split(".")[0] != "torch"]
    third = [line for line in plain + froms if line.split()[1].split(".")[0] == "torch"]
    return "\n".join(stdlib) + ("\n\n" if stdlib else "") + "\n".join(third)


def _import_module(name: str, module: types.ModuleType) -> str:
    if module.__name__ == name:
        return f"import {name}"
    head, _, tail = module.__name__.rpartition(".")
    return f"from {head} import {tail}" if tail == name else f"import {module.__name__} as {name}"


def _constant(module: types.ModuleType, name: str) -> tuple[str, types.ModuleType] | None:
    """The assignment defining ``name`` in ``module``, or in the specvit module it imports it from, and that
    module."""
    if name in _module_constants(module):
        return _module_constants(module)[name], module
    origin = _specvit_imports(module).get(name)
    return _constant(importlib.import_module(origin), name) if origin else None


@functools.cache
def _specvit_imports(module: types.ModuleType) -> dict[str, str]:
    """The names ``module`` imports from other specvit modules, and the module of each."""
    out = {}
    for stmt in ast.parse(inspect.getsource(module)).body:
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("specvit."):
            out.update({alias.name: stmt.module or "" for alias in stmt.names if alias.asname is None})
    return out


@functools.cache
def _module_constants(module: types.ModuleType) -> dict[str, str]:
    """Module-level assignments of ``module`` (``MASKED = -100.0``, type aliases), by name."""
    source = inspect.getsource(module)
    out = {}
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            out[stmt.targets[0].id] = ast.get_source_segment(source, stmt) or ""
    return out


def eject_source(graph: ArchGraph, origin: str = "") -> str:
    """The standalone PyTorch source of ``graph``'s model.

    Args:
        graph: the lowered spec.
        origin: where the spec came from, for the file's docstring.
    """
    e = _Ejector(graph)
    own = [cls for cls in e.leaf_classes if not cls.__module__.startswith("torch.")]
    general = e.general
    while True:
        layers: list[tuple[str, types.ModuleType]] = []
        for cls in own:
            source = (
                textwrap.dedent(inspect.getsource(cls))
                if cls.__name__ in general
                else specialise(cls, e.facts(cls))
            )
            layers.append((source, inspect.getmodule(cls)))  # type: ignore[arg-type]
        helpers = helper_names(graph)
        for fn in helpers.values():
            layers.append((textwrap.dedent(inspect.getsource(fn)), inspect.getmodule(fn)))  # type: ignore[arg-type]
        definitions, imports, called = _dependencies(layers, {cls.__name__ for cls in own}, set(helpers))
        if called <= general:
            break
        general |= called
    written: set[str] = set()
    generated = []
    order = {"": 3, "head": 2}  # blocks, stacks, the head, the model
    for scope in sorted(e.scopes, key=lambda s: (0 if block_container(s) else order.get(s, 1), s)):
        if e.names[scope] not in written:
            generated.append(e.scope_class(scope, written))
    uses_container = "_container(" in "".join(generated)
    header = f'"""{graph.name}, generated by specvit{" from " + origin if origin else ""}.\n\nStandalone: it needs only PyTorch. Build it with ``Model()``; load weights with ``load_state_dict``.\n"""'
    parts = [
        header + "\n\nfrom __future__ import annotations\n",
        _import_block({"import torch", "from torch import Tensor, nn", *imports}),
        *definitions,
        *(source for source, _ in layers),
        *([_CONTAINER.strip()] if uses_container else []),
        *generated,
    ]
    return "\n\n\n".join(p.strip() for p in parts).replace("annotations\n\n\n", "annotations\n\n") + "\n"
