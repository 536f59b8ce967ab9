"""Reading specs: YAML with source positions (:mod:`~specvit.spec.yamlread`), ``extends`` and overrides
(:mod:`~specvit.spec.compose`), validation against the schema and the cross-field rules, every problem at
its line (:mod:`~specvit.spec.messages`)."""

from __future__ import annotations

import numbers
import operator
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from specvit.errors import Location, Problem, SpecError
from specvit.spec.compose import Overrides, apply_overrides, load_tree, parse_overrides, resolve, shown_path
from specvit.spec.messages import problems, show
from specvit.spec.navigate import kinds_at
from specvit.spec.presets import preset_path
from specvit.spec.rules import check
from specvit.spec.schema import Spec
from specvit.spec.yamlread import (
    MAX_BYTES,
    MAX_NESTING,
    MAX_VALUES,
    KeyPath,
    SourceMap,
    dotted,
    dump_yaml,
    read_yaml,
    too_big,
)

__all__ = [
    "MAX_BYTES",
    "SourceMap",
    "dump_yaml",
    "load_spec",
    "load_text",
    "parse_overrides",
    "parse_spec",
    "read_yaml",
]


def _validate(data: Any, source: SourceMap) -> Spec:
    if not isinstance(data, dict):
        raise SpecError.at(
            f"the spec must be a mapping of keys at the top level, got {show(data)}",
            hint="start the file with 'specvit: 1' and 'name: ...'",
            location=source.locate(()),
        )
    version = data.get("specvit")
    if "specvit" in data and version != 1 and not isinstance(version, bool) and isinstance(version, int):
        raise SpecError.at(
            f"format version {version} is not supported by this specvit",
            path="specvit",
            hint="this specvit reads format version 1; upgrade specvit to read newer specs",
            location=source.locate(("specvit",)),
        )
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_sorted(problems(exc.errors(), data, source))) from None
    except RecursionError:
        raise SpecError.at("the spec is nested too deeply", location=source.locate(())) from None
    found = check(spec)
    if found:
        raise SpecError(_sorted([p if p.location else _at(p, source) for p in found]))
    spec._source = source
    return spec


def _at(problem: Problem, source: SourceMap) -> Problem:
    return Problem(problem.path, problem.message, problem.hint, source.locate(problem.path))


def _sorted(problems: list[Problem]) -> list[Problem]:
    def key(p: Problem) -> tuple[str, int, int]:
        loc = p.location
        return (loc.file, loc.line, loc.col) if loc else ("", 0, 0)

    return sorted(dict.fromkeys(problems), key=key)


# --------------------------------------------------------------------------------------------- public


def parse_spec(
    text_or_mapping: str | bytes | Mapping[str, Any],
    source: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Spec:
    """Validate a spec given as YAML text or as a mapping.

    Args:
        text_or_mapping: YAML text (str or UTF-8 bytes) or an already-parsed mapping.
        source: the name to use in error locations (default ``<string>``).
        overrides: dotted-key overrides applied last, e.g. ``{"encoder.depth": 6}``.

    Raises:
        SpecError: with every problem found.
    """
    label = source or "<string>"
    if isinstance(text_or_mapping, Mapping):
        data: Any = _copy(text_or_mapping, label)
        src = SourceMap(values={(): Location(label)})
    elif isinstance(text_or_mapping, str | bytes):
        data, src = read_yaml(text_or_mapping, label)
    else:
        raise SpecError.at(
            f"expected YAML text or a mapping, got {type(text_or_mapping).__name__}", location=Location(label)
        )
    if isinstance(data, dict) and "extends" in data:
        raise SpecError.at(
            "extends needs a spec file to resolve against",
            path="extends",
            hint="use specvit.load_spec(path) for specs that extend others",
            location=src.locate(("extends",)),
        )
    return _validate(apply_overrides(data, src, _plain(overrides), _shorthand(data)), src)


def _shorthand(data: Any) -> Callable[[KeyPath, str], bool]:
    """Whether a string at a key path of ``data`` is a shorthand kind there (``position: rope2d``)."""
    return lambda path, value: value in kinds_at(path, data)


def _plain(overrides: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The overrides with their values made plain data (NumPy integers -> int), origins kept; anything but a
    mapping (a list of ``--set`` items) is a TypeError saying what to pass."""
    if overrides is not None and not isinstance(overrides, Mapping):
        example = ""
        if isinstance(overrides, list | tuple) and overrides and isinstance(overrides[0], str):
            example = f" (for {overrides[0]!r:.60}-style items, specvit.spec.compose.parse_overrides(items) makes one)"
        raise TypeError(
            f"overrides must be a mapping of dotted keys to values, such as {{'encoder.depth': 6}}, got "
            f"{type(overrides).__name__}{example}"
        )
    if not overrides:
        return {}
    out = Overrides({k: _copy(v, f"<override {k}>") for k, v in overrides.items()})
    out.origin.update(getattr(overrides, "origin", {}))
    return out


def load_spec(
    path: str | os.PathLike[str] | Mapping[str, Any] | Spec, overrides: Mapping[str, Any] | None = None
) -> Spec:
    """Read, merge (``extends``) and validate a spec file, or a bundled preset by name, or a mapping.

    Args:
        path: the YAML file, a preset's name (``vit_base_patch16_224``; ``specvit presets`` lists them),
            a mapping of the spec's keys (as ``yaml.safe_load`` gives), or a :class:`Spec`.
        overrides: dotted-key overrides applied last, e.g. ``{"encoder.depth": 6}``; validated like the file.

    Raises:
        SpecError: with every problem found, each at its file:line:col (at its key path for a mapping).
    """
    if isinstance(path, Spec):
        return parse_spec(path.model_dump(), source=path.name, overrides=overrides) if overrides else path
    if isinstance(path, Mapping):
        return parse_spec(path, source="<dict>", overrides=overrides)
    if not isinstance(path, str | os.PathLike):
        raise SpecError.at(
            f"expected a spec file's path, a preset's name, a mapping or a Spec, got {type(path).__name__}",
            location=Location("<load_spec>"),
        )
    shown = os.fspath(path)
    if not Path(shown).exists() and (preset := preset_path(shown)) is not None:
        shown = shown_path(preset)
    resolved = resolve(Path(shown))
    data, source = load_tree(resolved, shown, (resolved,), None)
    return _validate(apply_overrides(data, source, _plain(overrides), _shorthand(data)), source)


def load_text(
    text: str | bytes,
    path: str | os.PathLike[str],
    *,
    shown: str | None = None,
    within: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Spec:
    """Validate ``text`` as the content of the spec file ``path``, which is not read (an editor's unsaved
    text): ``extends`` resolves relative to ``path``, as :func:`load_spec` would after saving it.

    Args:
        text: the YAML text (str or UTF-8 bytes; at most :data:`MAX_BYTES`).
        path: the file the text is (or will be) saved as.
        shown: its name in error locations (default: ``path`` as given).
        within: a folder every ``extends`` base must be in (bundled presets aside), or None for anywhere.
        overrides: dotted-key overrides applied last, as for :func:`load_spec`.

    Raises:
        SpecError: with every problem found, each at its file:line:col.
    """
    raw = text.encode("utf-8") if isinstance(text, str) else text
    label = shown if shown is not None else os.fspath(path)
    if len(raw) > MAX_BYTES:
        raise too_big(len(raw), label)
    resolved = resolve(Path(os.fspath(path)))
    folder = resolve(Path(os.fspath(within))) if within is not None else None
    data, source = load_tree(resolved, label, (resolved,), None, raw=raw, within=folder)
    return _validate(apply_overrides(data, source, _plain(overrides), _shorthand(data)), source)


def _copy(value: Any, label: str) -> Any:
    """A plain copy of a spec given as Python data: dicts, lists, str, int, float, bool and None only.

    NumPy (or any other) integers become ``int`` and real numbers ``float``, as they would read from YAML;
    a mapping or list that contains itself, nesting deeper than the YAML limit, more values than the YAML
    limit, a key that is not a string, or a value of another type is a SpecError naming its key path.
    """
    budget = [MAX_VALUES]

    def fail(message: str, path: KeyPath, hint: str) -> SpecError:
        return SpecError.at(message, path=dotted(path), hint=hint, location=Location(label))

    def copy(node: Any, path: KeyPath, inside: tuple[int, ...]) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise fail(f"the spec holds more than {MAX_VALUES} values", path, "a spec has about a hundred")
        if isinstance(node, Mapping | list | tuple):
            if id(node) in inside:
                raise fail("the spec contains itself here", path, "a spec is a tree: give each value once")
            if len(inside) >= MAX_NESTING:
                raise fail(
                    f"the spec nests deeper than {MAX_NESTING} levels", path, "a spec is a few levels deep"
                )
            deeper = (*inside, id(node))
            if isinstance(node, Mapping):
                out = {}
                for k, v in node.items():
                    if not isinstance(k, str):
                        raise fail(
                            f"keys must be strings, got {type(k).__name__} {k!r}",
                            path,
                            "write the key as a name",
                        )
                    out[k] = copy(v, (*path, k), deeper)
                return out
            return [copy(v, (*path, i), deeper) for i, v in enumerate(node)]
        if node is None or isinstance(node, str | bool | int | float):
            return node
        if isinstance(node, numbers.Integral):  # numpy.int64, torch.SymInt-free plain integers
            return operator.index(node)
        if isinstance(node, numbers.Real):
            return float(node)
        item = getattr(node, "item", bool)
        if type(node).__module__ == "numpy" and getattr(node, "ndim", 1) == 0 and isinstance(item(), bool):
            return item()  # numpy.bool_
        raise fail(
            f"a {type(node).__module__}.{type(node).__qualname__} is not spec data",
            path,
            "give dicts, lists, strings, numbers, booleans and None only",
        )

    return copy(value, (), ())
