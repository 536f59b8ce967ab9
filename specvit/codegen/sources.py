"""What an ejected file needs besides its classes: the functions and constants they call, and the imports.

A layer class's source names helpers of its module (``apply_rope``, ``MASKED = -100.0``); those are
written into the file too, in dependency order, each once, with their own dependencies. Names of the
compiled model's fast paths are written as the plain torch call (``Linear`` -> ``nn.Linear``,
``onednn_linear`` -> ``F.linear``): an ejected file uses public torch only.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
import types
from collections.abc import Iterable, Mapping
from typing import TypeVar

from specvit.codegen.fold import PlainCall
from specvit.codegen.specialise import rewrite_function
from specvit.nn import functional, layers, linear, mlp, qkv

__all__ = ["dependencies", "import_block", "plain_calls", "renames"]

T = TypeVar("T")

_FAST: dict[object, str] = {
    linear.Linear: "nn.Linear",
    linear.onednn_linear: "F.linear",
    layers.Dropout: "nn.Dropout",
}
"""The fast paths of the compiled model and the plain torch they compute."""

_PLAIN_CALLS: dict[object, PlainCall] = {
    functional.sdpa_layout: lambda call: call.args[0],  # only a memory layout (for export): its argument
    mlp.activate: lambda call: ast.Call(call.args[0], call.args[1:], []),  # act(h), never in place
    mlp._recomputes: lambda call: ast.Constant(False),  # no backward recomputing the activations
    qkv.one_node: lambda call: ast.Constant(False),  # heads and RoPE by torch's views and ops
}
"""Fast-path functions whose calls an ejected file writes as plain torch, and the call each becomes."""


def _named(module: types.ModuleType | None, table: Mapping[object, T]) -> dict[str, T]:
    """The names of ``module`` bound to keys of ``table``, each with its entry."""
    out = {}
    for name, value in vars(module).items() if module is not None else ():
        try:
            entry = table.get(value)
        except TypeError:  # unhashable
            continue
        if entry is not None:
            out[name] = entry
    return out


def renames(module: types.ModuleType | None) -> dict[str, str]:
    """The names of ``module`` that are fast paths, and the plain torch each is written as."""
    return _named(module, _FAST)


def plain_calls(module: types.ModuleType | None) -> dict[str, PlainCall]:
    """The names of ``module`` that are fast-path functions, and the plain call a call of each becomes."""
    return _named(module, _PLAIN_CALLS)


def _plain(source: str, module: types.ModuleType) -> str:
    """A library function's source with its fast paths written plainly."""
    names, calls = renames(module), plain_calls(module)
    if not names and not calls:
        return source
    return rewrite_function(source, module, names, calls)


def dependencies(
    sources: Iterable[tuple[str, types.ModuleType]], defined: set[str]
) -> tuple[list[str], set[str]]:
    """The definitions (source text) the given sources need, in dependency order, and their import lines.

    Args:
        sources: the class and function sources, each with the module its names are resolved in.
        defined: names the file defines otherwise (its layer classes, the generated helpers): never
            written again.
    """
    definitions: dict[str, str] = {}
    imports: set[str] = set()
    order: list[str] = []

    def visit(source: str, module: types.ModuleType, own: str) -> None:
        used = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
        for name in sorted(used - {own}):
            value = module.__dict__.get(name)
            if value is None or name in definitions or name in defined:
                continue
            origin = getattr(value, "__module__", "") or ""
            if isinstance(value, types.ModuleType):
                imports.add(_import_module(name, value))
                continue
            home = module
            if (constant := _constant(module, name)) is not None:  # MASKED = -100.0, QkNorm = Literal[...]
                definitions[name], home = constant
            elif origin.startswith("specvit.") and (inspect.isfunction(value) or inspect.isclass(value)):
                home = inspect.getmodule(value) or module  # its own names are resolved where it is defined
                definitions[name] = _plain(textwrap.dedent(inspect.getsource(value)), home)
            elif origin:
                imports.add(f"from {origin} import {name}")
                continue
            else:
                continue
            visit(definitions[name], home, name)
            order.append(name)

    for source, module in sources:
        visit(source, module, "")
    return [definitions[n] for n in order], imports


_ALWAYS = {
    "torch": "import torch",
    "F": "import torch.nn.functional as F",
    "nn": "from torch import nn",
    "Tensor": "from torch import Tensor",
    "math": "import math",
}


def import_block(text: str, imports: set[str]) -> str:
    """The import lines of a file whose body is ``text``: those ``imports`` whose names it uses, and torch's
    usual names it uses; merged per module, the standard library first (isort's order, as ruff's)."""
    used = {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)}
    used |= {
        n.value.id
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }
    lines = {line for name, line in _ALWAYS.items() if name in used}
    for line in imports:
        names = line.rpartition(" import ")[2]
        bound = names.split(" as ")[-1].strip()
        if bound in used or any(n.strip() in used for n in names.split(",")):
            lines.add(line)
    plain = sorted(line for line in lines if line.startswith("import "))
    froms: dict[str, set[str]] = {}
    for line in lines:
        if line.startswith("from "):
            module, _, names_text = line[5:].partition(" import ")
            froms.setdefault(module, set()).update(n.strip() for n in names_text.split(","))
    groups: dict[bool, list[str]] = {True: [], False: []}  # third party (torch) or not
    for line in plain:
        groups[line.split()[1].split(".")[0] == "torch"].append(line)
    for module, imported in sorted(froms.items()):
        line = f"from {module} import {', '.join(sorted(imported, key=_isort_key))}"
        groups[module.split(".")[0] == "torch"].append(line)
    order = [sorted(groups[False], key=_line_key), sorted(groups[True], key=_line_key)]
    return "\n\n".join("\n".join(g) for g in order if g)


def _isort_key(name: str) -> tuple[int, str]:
    """isort's order of imported names: constants, classes, then functions (force-sort-within-sections off)."""
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return (kind, name.lower())


def _line_key(line: str) -> tuple[int, str]:
    """isort's order of lines within a section: ``import x`` lines first, each kind by module."""
    parts = line.split()
    return (0 if parts[0] == "import" else 1, parts[1].lower())


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
