"""Reading specs: safe YAML with source positions, ``extends``, overrides, and errors at the line.

A spec file is untrusted input. It is read as plain YAML only (mappings, lists, strings, numbers,
booleans, null): tags that would construct objects are refused, duplicate keys are errors, and
size, nesting depth and alias expansion are bounded so that no file can hang or exhaust memory.
Every value keeps the file:line:col it came from, through ``extends`` chains and overrides, so
that each validation error points at the line to edit.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from specvit.errors import Location, Problem, SpecError
from specvit.spec.schema import Spec

__all__ = ["SourceMap", "dump_yaml", "load_spec", "parse_overrides", "parse_spec", "read_yaml"]

MAX_BYTES = 1 << 20  # 1 MiB: a spec is a page of YAML; anything larger is refused before parsing
MAX_NESTING = 64
MAX_VALUES = 10_000  # values after alias expansion (a spec has ~100): bounds "billion laughs" documents
MAX_EXTENDS = 32  # files in one extends chain (the presets use one)

KeyPath = tuple[str | int, ...]

_PLAIN_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
}
_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _TooDeep(yaml.YAMLError):
    """Flow collections (``[``, ``{``) nest deeper than MAX_NESTING: raised by the scanner, at ``mark``."""

    def __init__(self, mark: Any):
        super().__init__(f"flow collections nest deeper than {MAX_NESTING} levels")
        self.mark = mark


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-6`` as a float (YAML 1.2), not as the string PyYAML makes of it.

    Its scanner also stops at the 65th nested ``[`` or ``{``: it looks up to 1024 characters ahead for
    a key and, for each token, checks every open flow level, so that ``[[[[...`` costs time quadratic in
    the depth (about a second for 1024 levels) before the parser sees any of it.
    """

    def fetch_flow_collection_start(self, token_class: Any) -> None:
        if self.flow_level >= MAX_NESTING:
            raise _TooDeep(self.get_mark())
        super().fetch_flow_collection_start(token_class)


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _short_tag(tag: str) -> str:
    return "!!" + tag.removeprefix("tag:yaml.org,2002:") if tag.startswith("tag:yaml.org,2002:") else tag


def _loc(file: str, mark: Any) -> Location:
    return Location(file, mark.line + 1, mark.column + 1)


def _dotted(path: KeyPath) -> str:
    return ".".join(str(p) for p in path)


class SourceMap:
    """Where each value of a spec came from: key path -> file:line:col.

    Args:
        values: location of each value, by key path.
        keys: location of each mapping key, by the key path it introduces.
    """

    def __init__(
        self, values: dict[KeyPath, Location] | None = None, keys: dict[KeyPath, Location] | None = None
    ):
        self.values: dict[KeyPath, Location] = values or {}
        self.keys: dict[KeyPath, Location] = keys or {}

    def locate(self, path: KeyPath | str, *, key: bool = False) -> Location | None:
        """The location of ``path``, or of its nearest ancestor that the source spells out."""
        parts: KeyPath = tuple(_split_path(path)) if isinstance(path, str) else path
        table = self.keys if key else self.values
        while True:
            if parts in table:
                return table[parts]
            if key and parts in self.values:
                return self.values[parts]
            if not parts:
                return None
            parts = parts[:-1]


# ----------------------------------------------------------------------------------------------- YAML


def _yaml_problem(exc: yaml.YAMLError, file: str, text: str) -> Problem:
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow; no mark, only a position
        pos = exc.position
        line = text.count("\n", 0, pos) + 1
        col = pos - (text.rfind("\n", 0, pos) + 1) + 1
        code = ord(exc.character) if isinstance(exc.character, str) else exc.character
        return Problem(
            "",
            f"the character #x{code:04x} is not allowed in YAML",
            "remove it; write special characters as escapes inside double quotes",
            Location(file, line, col),
        )
    mark = getattr(exc, "problem_mark", None)
    location = _loc(file, mark) if mark is not None else Location(file)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    message = f"YAML syntax error: {problem}" + (f" ({context})" if context else "")
    hint = "fix the YAML at this position"
    if "\t" in problem or "'\\t'" in problem:
        message = "a tab character where YAML expects indentation or a value"
        hint = "YAML does not allow tabs for indentation; indent with spaces"
    return Problem("", message, hint, location)


def _check_nesting(text: str, file: str) -> None:
    """Walk the event stream (iterative, cheap) so that deep nesting never reaches a recursive composer.

    It also counts the values (nodes that are not mapping keys) and stops at ``MAX_VALUES``, so that a
    long document is refused after scanning that many values rather than parsed and composed whole.
    """
    values = 0
    open_: list[bool | None] = []  # per open collection: None for a list; for a mapping, is a key next?
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.NodeEvent):
            is_key = bool(open_) and open_[-1] is True
            if open_ and open_[-1] is not None:
                open_[-1] = not open_[-1]
            values += not is_key
            if values > MAX_VALUES:
                raise SpecError.at(
                    f"the document holds more than {MAX_VALUES} values",
                    hint="a spec has about a hundred; is this the right file?",
                    location=_loc(file, event.start_mark),
                )
        if isinstance(event, yaml.CollectionStartEvent):
            open_.append(True if isinstance(event, yaml.MappingStartEvent) else None)
            if len(open_) > MAX_NESTING:
                raise _too_deep(_loc(file, event.start_mark))
        elif isinstance(event, yaml.CollectionEndEvent):
            open_.pop()


def _too_deep(location: Location) -> SpecError:
    return SpecError.at(
        f"the document nests deeper than {MAX_NESTING} levels",
        hint="a spec is a few levels deep; check for runaway brackets or indentation",
        location=location,
    )


class _Converter:
    """YAML node tree -> plain Python data plus a SourceMap, refusing anything that is not plain data."""

    def __init__(self, file: str):
        self.file = file
        self.source = SourceMap()
        self.problems: list[Problem] = []
        self.budget = MAX_VALUES
        self.scalars = yaml.constructor.SafeConstructor()
        self.entered: set[int] = set()  # ids of the collections being converted: an alias to one loops
        self.depth = 0  # collections being converted, merges (<<) included

    def convert(self, node: yaml.Node, path: KeyPath) -> Any:
        self.budget -= 1
        if self.budget < 0:
            raise SpecError.at(
                f"the document expands to more than {MAX_VALUES} values",
                hint="aliases (*name) that repeat anchors many times over are refused; write the values out",
                location=_loc(self.file, node.start_mark),
            )
        self.source.values[path] = _loc(self.file, node.start_mark)
        if (isinstance(node, yaml.MappingNode) and node.tag == _MAP_TAG) or (
            isinstance(node, yaml.SequenceNode) and node.tag == _SEQ_TAG
        ):
            return self._collection(node, path)
        if isinstance(node, yaml.ScalarNode) and node.tag in _PLAIN_TAGS:
            return self._scalar(node, path)
        self.problems.append(
            Problem(
                _dotted(path),
                f"the tag {_short_tag(node.tag)} is refused",
                "specvit reads plain YAML only (mappings, lists, strings, numbers, booleans, null); remove the tag",
                _loc(self.file, node.start_mark),
            )
        )
        return None

    def _collection(self, node: yaml.MappingNode | yaml.SequenceNode, path: KeyPath) -> Any:
        """Convert a mapping or a list, bounding what aliases and merge keys can make of it."""
        if id(node) in self.entered:
            raise SpecError.at(
                "an alias (*name) refers to a collection that contains it",
                path=_dotted(path),
                hint="an anchored mapping or list cannot include itself; write the values out",
                location=_loc(self.file, node.start_mark),
            )
        if self.depth >= MAX_NESTING:  # the text nests <= 64 deep, but aliases and merges can stack anchors
            raise SpecError.at(
                f"the document nests deeper than {MAX_NESTING} levels once its aliases are expanded",
                path=_dotted(path),
                hint="a spec is a few levels deep; check what the aliases (*name) and merges (<<) refer to",
                location=_loc(self.file, node.start_mark),
            )
        self.entered.add(id(node))
        self.depth += 1
        try:
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, path)
            return [self.convert(item, (*path, i)) for i, item in enumerate(node.value)]
        finally:
            self.depth -= 1
            self.entered.discard(id(node))

    def _scalar(self, node: yaml.ScalarNode, path: KeyPath) -> Any:
        try:
            return self.scalars.construct_object(node)
        except (ArithmeticError, LookupError, TypeError, ValueError, yaml.YAMLError) as exc:
            # an explicit tag on a value that is not of that type (`!!int abc`, `!!int` with nothing), or
            # an integer with more digits than Python converts (sys.get_int_max_str_digits(), 4300)
            if isinstance(exc, ValueError) and "digits" in str(exc):
                digits = sum(c.isdigit() for c in node.value)
                message, hint = (
                    f"the integer has {digits:,} digits, too many to read",
                    "write a smaller number",
                )
            else:
                message = f"{_clip(node.value)!r} is not a valid {_short_tag(node.tag)}"
                hint = "remove the tag or correct the value"
            self.problems.append(Problem(_dotted(path), message, hint, _loc(self.file, node.start_mark)))
            return None

    def _mapping(self, node: yaml.MappingNode, path: KeyPath) -> dict[str, Any]:
        out: dict[str, Any] = {}
        merged: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                for source in value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]:
                    value = self.convert(source, path)
                    if isinstance(value, dict):
                        for k, v in value.items():
                            merged.setdefault(k, v)
                    else:
                        self.problems.append(
                            Problem(
                                _dotted(path),
                                "a merge key (<<) needs a mapping",
                                "merge an anchored mapping: <<: *name",
                                _loc(self.file, source.start_mark),
                            )
                        )
                continue
            if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:str"):
                self.problems.append(
                    Problem(
                        _dotted(path),
                        f"keys must be plain strings, got {_show_node(key_node)}",
                        "write the key as a name such as width",
                        _loc(self.file, key_node.start_mark),
                    )
                )
                continue
            key = key_node.value
            child = (*path, key)
            if key in out:
                self.problems.append(
                    Problem(
                        _dotted(child),
                        f"duplicate key '{key}' (first at line {self.source.keys[child].line})",
                        "a key may appear once per mapping; delete one of them",
                        _loc(self.file, key_node.start_mark),
                    )
                )
                continue
            self.source.keys[child] = _loc(self.file, key_node.start_mark)
            out[key] = self.convert(value_node, child)
        for k, v in merged.items():
            out.setdefault(k, v)
        return out


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show_node(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(_clip(str(node.value)))


def read_yaml(text: str | bytes, file: str = "<string>") -> tuple[Any, SourceMap]:
    """Parse one YAML document into plain data and the location of every value.

    Args:
        text: the document, as text or as UTF-8 bytes.
        file: the name used in error locations.

    Raises:
        SpecError: on anything that is not a single, plain, bounded YAML document.
    """
    if isinstance(text, bytes):
        raw = text
        if len(raw) > MAX_BYTES:
            raise _too_big(len(raw), file)
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
            raise SpecError.at(
                f"the file is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                hint="save the spec as UTF-8",
                location=Location(file, line, col),
            ) from None
    if len(text) > MAX_BYTES:
        raise _too_big(len(text), file)
    try:
        _check_nesting(text, file)
        node = yaml.compose(text, Loader=_Loader)
    except _TooDeep as exc:
        raise _too_deep(_loc(file, exc.mark)) from None
    except yaml.YAMLError as exc:
        raise SpecError(_yaml_problem(exc, file, text)) from None
    if node is None:
        raise SpecError.at(
            "the file holds no YAML document",
            hint="a spec starts with 'specvit: 1'",
            location=Location(file, 1, 1),
        )
    converter = _Converter(file)
    data = converter.convert(node, ())
    if converter.problems:
        raise SpecError(converter.problems)
    return data, converter.source


def _too_big(size: int, file: str) -> SpecError:
    return SpecError.at(
        f"the file is {size:,} bytes, over the {MAX_BYTES:,}-byte limit for a spec",
        hint="a spec is a page of YAML; is this the right file?",
        location=Location(file, 1, 1),
    )


def dump_yaml(data: Any) -> str:
    """Plain YAML for ``data``, keys in insertion order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


# --------------------------------------------------------------------------------------------- extends


_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # POSIX: opening a FIFO nobody writes to returns at once


def _resolve(path: Path) -> Path:
    """``path.resolve()``, or ``path`` itself where that fails (a symlink loop): reading it then says why."""
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError):  # ValueError: a NUL character in the path
        return path


def _read_file(path: Path, shown: str, *, what: str = "spec", at: Location | None = None) -> bytes:
    """The bytes of a spec file (at most ``MAX_BYTES + 1``), or a SpecError saying why there are none.

    Only regular files are read. The file is opened without blocking and checked before any read, so
    that a FIFO or a device (``extends: /dev/stdin``) is refused instead of waiting forever for input.
    """
    try:
        if "\0" in str(path):
            raise SpecError.at(
                f"{what} {shown!r} cannot be read: the path holds a NUL character",
                hint="check the path",
                location=at,
            )
        if path.is_dir():
            raise SpecError.at(
                f"{what} '{shown}' is a directory", hint="give the path of a .yaml file", location=at
            )
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | getattr(os, "O_BINARY", 0))
        with open(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise SpecError.at(
                    f"{what} '{shown}' is not a regular file",
                    hint="give the path of a .yaml file",
                    location=at,
                )
            if info.st_size > MAX_BYTES:
                raise _too_big(info.st_size, shown)
            return f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise SpecError.at(f"{what} '{shown}' does not exist", hint="check the path", location=at) from None
    except PermissionError:
        raise SpecError.at(
            f"{what} '{shown}' cannot be read (permission denied)",
            hint="check the file's permissions",
            location=at,
        ) from None
    except OSError as exc:
        raise SpecError.at(f"{what} '{shown}' cannot be read: {exc.strerror}", location=at) from None


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_tree(path: Path, shown: str, chain: tuple[Path, ...], at: Location | None) -> tuple[Any, SourceMap]:
    data, source = read_yaml(_read_file(path, shown, at=at), shown)
    if not isinstance(data, dict) or "extends" not in data:
        return data, source
    base_ref = data.pop("extends")
    ref_at = source.values.get(("extends",))
    if not isinstance(base_ref, str) or not base_ref:
        raise SpecError.at(
            "extends must name a spec file",
            path="extends",
            hint="write extends: vit_base_patch16_224.yaml (relative to this file)",
            location=ref_at,
        )
    if len(chain) >= MAX_EXTENDS:
        raise SpecError.at(
            f"extends chains more than {MAX_EXTENDS} files",
            path="extends",
            hint="a spec extends a preset, which may extend another; shorten the chain",
            location=ref_at,
        )
    base_path = _resolve(path.parent / base_ref)
    if base_path in chain:
        cycle = " -> ".join(p.name for p in (*chain, base_path))
        raise SpecError.at(
            f"extends forms a cycle: {cycle}",
            path="extends",
            hint="a spec may not extend itself, directly or through others",
            location=ref_at,
        )
    base_shown = os.path.relpath(base_path) if not Path(shown).is_absolute() else str(base_path)
    base_data, base_source = _load_tree(base_path, base_shown, (*chain, base_path), ref_at)
    if not isinstance(base_data, dict):
        raise SpecError.at(f"the base spec '{base_ref}' is not a mapping", path="extends", location=ref_at)
    merged = _deep_merge(base_data, data)
    base_source.values.pop(("extends",), None)
    _overlay(base_source, source, data)
    return merged, base_source


def _overlay(base: SourceMap, over: SourceMap, over_data: Any) -> None:
    """Point every path that ``over_data`` sets (at its deepest level) at ``over``'s file.

    One pass over each map (not one per value set), so that large specs overlay in linear time.
    """
    leaves: set[KeyPath] = set()  # paths where over_data sets a value that replaces the base's whole
    stack: list[tuple[KeyPath, Any]] = [((), over_data)]
    while stack:
        prefix, node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            path = (*prefix, key)
            if path in over.keys:
                base.keys[path] = over.keys[path]
            if path in over.values:
                base.values[path] = over.values[path]
            if isinstance(value, dict):
                stack.append((path, value))
            else:
                leaves.add(path)
    if not leaves:
        return

    def under(p: KeyPath, proper: bool) -> bool:
        return any(p[:k] in leaves for k in range(1, len(p) + (not proper)))

    for p in [p for p in base.values if under(p, proper=True)]:
        del base.values[p]
    base.values.update({p: loc for p, loc in over.values.items() if under(p, proper=False)})


# ------------------------------------------------------------------------------------------- overrides


def _split_path(path: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in path.split(".")] if path else []


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["encoder.depth=6", "head=none"]`` -> ``{"encoder.depth": 6, "head": "none"}``, values read as YAML.

    Raises:
        SpecError: for an item without ``=`` or with a value that is not plain YAML.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        label = f"<--set {item}>"
        if not sep or not key.strip():
            raise SpecError.at(
                f"'{item}' is not KEY=VALUE",
                hint="write e.g. --set encoder.depth=6",
                location=Location(label),
            )
        value, _ = read_yaml(text or "null", label)
        out[key.strip()] = value
    return out


def _apply_overrides(data: Any, source: SourceMap, overrides: Mapping[str, Any]) -> Any:
    if not isinstance(data, dict):
        return data
    for dotted, value in overrides.items():
        parts = _split_path(dotted)
        label = Location(f"<override {dotted}>")
        node: Any = data
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list) and isinstance(part, int) and part < len(node):
                if last:
                    node[part] = value
                else:
                    node = node[part]
            elif isinstance(node, dict) and isinstance(part, str):
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})
            else:
                raise SpecError.at(
                    f"the override path '{dotted}' does not lead to a key of the spec",
                    path=_dotted(tuple(parts[:i])),
                    hint="use dotted keys such as encoder.depth",
                    location=label,
                )
        path = tuple(parts)
        for p in [p for p in source.values if p[: len(path)] == path]:
            del source.values[p]
        source.values[path] = label
        source.keys[path] = label
    return data


# ------------------------------------------------------------------------------------------ validation


def _walk(data: Any, loc: tuple[Any, ...]) -> tuple[KeyPath, Any]:
    """Drop the union tags Pydantic puts into error locations, keeping the real key path."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        ):
            path.append(part)
            node = node[part]
        elif (
            (isinstance(node, dict) and node.get("kind") == part)
            or (isinstance(node, str) and node == part)
            or (
                isinstance(part, str)
                and (
                    "[" in part or part in {"tuple", "function-after", "function-before", "single", "stages"}
                )
            )
        ):
            continue
        else:
            path.append(part)
            node = None
    return tuple(path), node


def _fields_of(loc: tuple[Any, ...], data: Any, model: bool = False) -> Any:
    """Allowed keys of the model at ``loc`` (for did-you-mean), found by following the schema."""
    from pydantic import BaseModel

    cls: Any = Spec
    node = data
    for part in loc:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return []
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            continue
        node = node.get(part) if isinstance(node, dict) else None
        cls = _model_in(field.annotation, node)
    is_model = isinstance(cls, type) and issubclass(cls, BaseModel)
    if model:
        return cls if is_model else None
    return list(cls.model_fields) if is_model else []


def _kinds_at(loc: tuple[Any, ...], data: Any) -> list[str]:
    """The ``kind`` values a discriminated union at ``loc`` accepts."""
    from typing import get_args

    parent = _fields_of(loc[:-1], data, model=True)
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


def _model_in(annotation: Any, node: Any) -> Any:
    from typing import get_args

    from pydantic import BaseModel

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


def _suggest(word: Any, options: list[str]) -> str:
    close = difflib.get_close_matches(str(word), options, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


def _problem(err: Any, data: Any, source: SourceMap) -> Problem:
    kind = err["type"]
    path, _ = _walk(data, tuple(err["loc"]))
    if path and isinstance(path[-1], int) and not isinstance(_walk(data, path[:-1])[1], list):
        path = path[:-1]  # `patch: 0` expands to (0, 0): one problem, not one per side
    value = err.get("input")
    ctx = err.get("ctx") or {}
    dotted = _dotted(path)
    message = err["msg"]
    hint = ""
    location = source.locate(path)
    if kind == "extra_forbidden":
        key = path[-1] if path else "?"
        options = _fields_of(path[:-1], data)
        message = f"unknown key '{key}'"
        hint = _suggest(key, options) or (f"valid keys: {', '.join(options)}" if options else "remove it")
        location = source.locate(path, key=True)
    elif kind == "missing":
        key = path[-1] if path else "?"
        message = f"missing required key '{key}'"
        hint = f"add {key}: under {_dotted(path[:-1]) or 'the top level'}"
        if path == ("specvit",):
            hint = "start the file with 'specvit: 1', the format version"
        location = source.locate(path[:-1], key=True)
    elif kind in ("literal_error", "union_tag_invalid"):
        expected = ctx.get("expected_tags") or ctx.get("expected", "")
        options = re.findall(r"'([^']*)'", str(expected)) or re.findall(r"[\w.-]+", str(expected))
        shown = ctx.get("tag", value)
        message = f"{shown!r} is not one of {', '.join(options)}"
        hint = _suggest(shown, options) or f"use one of {', '.join(options)}"
        if kind == "union_tag_invalid":
            path = (*path, "kind") if isinstance(value, dict) and "kind" in value else path
            location = source.locate(path)
            dotted = _dotted(path)
    elif kind == "union_tag_not_found":
        message = "needs a 'kind' key"
        hint = f"add kind: one of {', '.join(_kinds_at(path, data))}"
    elif kind in ("int_type", "float_type", "bool_type", "string_type"):
        want = {
            "int_type": "an integer",
            "float_type": "a number",
            "bool_type": "true or false",
            "string_type": "a string",
        }[kind]
        message = f"expected {want}, got {_show(value)}"
        if isinstance(value, str) and kind in ("int_type", "float_type"):
            hint = f"write the number without quotes: {value.strip()}"
        elif isinstance(value, bool) and kind in ("int_type", "float_type"):
            hint = "booleans are not numbers here; write a number"
        elif kind == "bool_type" and isinstance(value, str):
            hint = "write true or false without quotes"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[
            kind
        ]
        bound = next(iter(ctx.values())) if ctx else "?"
        message = f"must be {op} {bound}, got {_show(value)}"
    elif kind == "finite_number":
        message = f"must be a finite number, got {_show(value)}"
    elif kind in ("too_short", "too_long"):
        bound = ctx.get("min_length") if kind == "too_short" else ctx.get("max_length")
        message = f"needs {'at least' if kind == 'too_short' else 'at most'} {bound} item{'s' * (bound != 1)}, got {ctx.get('actual_length')}"
    elif kind == "string_pattern_mismatch" and path == ("name",):
        message = f"{_show(value)} is not a valid name"
        hint = "use only letters, digits, '_', '.' and '-': the name becomes a file name"
    elif kind == "model_type" or kind == "model_attributes_type" or kind == "dict_type":
        message = f"expected a mapping of keys, got {_show(value)}"
        hint = "write the keys of this section indented below it"
    elif kind == "tuple_type" or kind == "list_type":
        message = f"expected a list, got {_show(value)}"
    else:
        message = message[0].lower() + message[1:]
    return Problem(dotted, message, hint, location)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return str(value)


def _validate(data: Any, source: SourceMap) -> Spec:
    if not isinstance(data, dict):
        raise SpecError.at(
            f"the spec must be a mapping of keys at the top level, got {_show(data)}",
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
        problems = [_problem(err, data, source) for err in exc.errors()]
        raise SpecError(_sorted(problems)) from None
    except RecursionError:
        raise SpecError.at("the spec is nested too deeply", location=source.locate(())) from None
    from specvit.spec.rules import check

    problems = check(spec)
    if problems:
        raise SpecError(_sorted([p if p.location else _at(p, source) for p in problems]))
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
        data: Any = _copy(text_or_mapping)
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
    return _validate(_apply_overrides(data, src, overrides or {}), src)


def load_spec(path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> Spec:
    """Read, merge (``extends``) and validate a spec file.

    Args:
        path: the YAML file.
        overrides: dotted-key overrides applied last, e.g. ``{"encoder.depth": 6}``; validated like the file.

    Raises:
        SpecError: with every problem found, each at its file:line:col.
    """
    shown = os.fspath(path)
    resolved = _resolve(Path(shown))
    data, source = _load_tree(resolved, shown, (resolved,), None)
    return _validate(_apply_overrides(data, source, overrides or {}), source)


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(v) for v in value]
    return value
