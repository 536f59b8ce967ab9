"""Finding one's way in the schema from a place in a spec's data: the model of a section, its keys, the
``kind`` values a slot accepts, and the sections that hold a key, for messages and ``--set``."""

from __future__ import annotations

from typing import Any, get_args, get_origin

from pydantic import BaseModel

from specvit.spec.schema import Spec
from specvit.spec.yamlread import KeyPath

__all__ = ["fields_at", "holders", "kinds_at", "model_at", "model_in", "sections_below"]


def model_in(annotation: Any, node: Any) -> Any:
    """The model class an annotation holds: the only one, or the one whose ``kind`` the data ``node`` has.

    Args:
        annotation: a field's annotation (a model, a union of models, an ``Annotated`` or ``list`` of them).
        node: the data at that field (a mapping with a ``kind``, or a shorthand kind string), or None.
    """
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = []
    stack = [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            models.append(a)
        else:
            stack.extend(get_args(a))
    if len(models) == 1:
        return models[0]
    kind = node.get("kind") if isinstance(node, dict) else node
    for m in models:
        tag = m.model_fields.get("kind")
        if tag is not None and kind in get_args(tag.annotation):
            return m
    return None


def model_at(loc: KeyPath, data: Any) -> Any:
    """The model class of the section at ``loc`` (list indexes and union tags skipped), or None.

    Args:
        loc: a key path from the spec's top.
        data: the spec's data, which picks the member of a union by its ``kind``.
    """
    cls: Any = Spec
    node = data
    for part in loc:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            continue
        node = node.get(part) if isinstance(node, dict) else None
        cls = model_in(field.annotation, node)
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def fields_at(loc: KeyPath, data: Any) -> list[str]:
    """The keys the section at ``loc`` allows (empty when ``loc`` is not a section).

    Args:
        loc: a key path from the spec's top.
        data: the spec's data.
    """
    cls = model_at(loc, data)
    return list(cls.model_fields) if cls is not None else []


def kinds_at(loc: KeyPath, data: Any) -> list[str]:
    """The ``kind`` values the slot at ``loc`` accepts (``position``: none, learned, ...), or none.

    Args:
        loc: the slot's key path; a trailing list index (``encoder.position.1``) is the list's slot.
        data: the spec's data.
    """
    while loc and isinstance(loc[-1], int):
        loc = loc[:-1]
    parent = model_at(loc[:-1], data)
    field = parent.model_fields.get(loc[-1]) if parent is not None and loc else None
    if field is None:
        return []
    kinds: list[str] = []
    stack = [field.annotation]
    while stack:
        a = stack.pop(0)
        tag = getattr(a, "model_fields", {}).get("kind")
        if tag is not None:
            kinds += list(get_args(tag.annotation))
        else:
            stack.extend(get_args(a))
    return kinds


def sections_below(loc: KeyPath, data: Any, levels: int) -> list[tuple[KeyPath, Any]]:
    """The sections under ``loc``, ``levels`` deep, nearest first (not into named or listed blocks).

    Args:
        loc: a key path from the spec's top.
        data: the spec's data, which picks the member of a union by its ``kind``.
        levels: how many levels down.

    Returns:
        (key path, model class) of each section.
    """
    model = model_at(loc, data)
    frontier: list[tuple[KeyPath, Any]] = [(loc, model)] if model is not None else []
    node_of = {loc: _node(data, loc)}
    out: list[tuple[KeyPath, Any]] = []
    for _ in range(levels):
        below: list[tuple[KeyPath, Any]] = []
        for path, cls in frontier:
            for name, field in cls.model_fields.items():
                if get_origin(field.annotation) in (dict, list):
                    continue
                node = node_of[path].get(name) if isinstance(node_of[path], dict) else None
                sub = model_in(field.annotation, node)
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    node_of[(*path, name)] = node
                    below.append(((*path, name), sub))
        out += below
        frontier = below
    return out


def _node(data: Any, loc: KeyPath) -> Any:
    """The data at ``loc``, or None where the data has no such key."""
    for part in loc:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def holders(key: str, parent: KeyPath, data: Any) -> list[KeyPath]:
    """The sections that have ``key``, as seen from ``parent``: ``parent`` itself if it has it, else those
    up to two levels below it, else the nearest enclosing one; sections the data has come first.

    Args:
        key: a key of the schema (``width``, ``mlp``, ``head``).
        parent: where it was written.
        data: the spec's data.
    """
    if key in fields_at(parent, data):
        return [parent]
    found = [path for path, cls in sections_below(parent, data, 2) if key in cls.model_fields]
    if not found:
        for depth in range(len(parent) - 1, -1, -1):
            if key in fields_at(parent[:depth], data):
                found = [parent[:depth]]
                break
    present = [path for path in found if isinstance(_node(data, path), dict)]
    return present or found
