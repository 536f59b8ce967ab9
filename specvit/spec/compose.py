"""Composing a spec: ``extends`` chains (deep merge over a base file) and dotted-key overrides, each value
keeping the file:line:col it came from."""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from specvit.errors import Location, SpecError, SpecFileError
from specvit.io import Unreadable, read_regular
from specvit.spec.presets import preset_dir, preset_path, suggest
from specvit.spec.yamlread import (
    MAX_BYTES,
    MAX_NESTING,
    MAX_VALUES,
    KeyPath,
    SourceMap,
    dotted,
    read_yaml,
    split_path,
    too_big,
)
from specvit.text import quote

__all__ = [
    "MAX_EXTENDS",
    "Overrides",
    "apply_overrides",
    "load_tree",
    "parse_overrides",
    "resolve",
    "shown_path",
]

MAX_EXTENDS = 32  # files in one extends chain (the presets use one)


def resolve(path: Path) -> Path:
    """``path.resolve()``, or ``path`` itself where that fails (a symlink loop): reading it then says why."""
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError):  # ValueError: a NUL character in the path
        return path


def _read_file(path: Path, shown: str, *, what: str = "spec", at: Location | None = None) -> bytes:
    """The bytes of a spec file (at most ``MAX_BYTES + 1``), or a SpecError saying why there are none.

    Read by :func:`specvit.io.read_regular`: only regular files, opened without blocking and checked
    before any read, so that a FIFO or a device (``extends: /dev/stdin``) is refused instead of waiting
    forever for input, and a file over the limit is refused by its size.
    """
    error = SpecFileError if at is None else SpecError  # the file named by the user, or by a spec
    try:
        return read_regular(path, MAX_BYTES, what, shown=shown)
    except Unreadable as exc:
        if exc.reason == "too_big":
            raise too_big(exc.size, shown) from None
        hint = {"missing": suggest(shown), "directory": "give the path of a .yaml file"}.get(
            exc.reason, exc.hint
        )
        if exc.reason == "special":
            hint = "give the path of a .yaml file"
        raise error.at(exc.message, hint=hint, location=at) from None


def shown_path(path: Path, *, absolute: bool = False) -> str:
    """How a file is named in messages: relative to the working directory where that is short, else whole.

    Args:
        path: the file.
        absolute: name it whole (the spec that names it was named by its whole path).
    """
    if absolute:
        return str(path)
    try:
        rel = os.path.relpath(path)
    except (ValueError, OSError):  # another drive (Windows); a working directory that no longer exists
        return str(path)
    return str(path) if rel.startswith(".." + os.sep + "..") else rel


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_PLAIN_EXTENDS = re.compile(rb"^extends:[ ]+([^\s#'\"{}\[\],&*!|>]+)[ ]*(?:#[^\n]*)?$", re.M)
"""A top-level ``extends: name`` written plainly: what :func:`_chain_too_big` follows without parsing."""


def _too_big(shown: str, files: int, total: int, at: Location | None) -> SpecError:
    return SpecError.at(
        f"the extends chain holds more than {MAX_BYTES:,} bytes: with '{shown}' its {files} files hold {total:,}",
        path="extends",
        hint="a spec and its bases are a few pages of YAML; shorten the chain or the files",
        location=at,
    )


def _chain_too_big(path: Path, raw: bytes, shown: str, within: Path | None = None) -> SpecError | None:
    """The chain's bytes counted before any of its files is parsed (parsing is what costs: a chain of files
    each under the limit must not be parsed whole to be refused), following plain top-level ``extends:``
    lines; a chain written otherwise is counted file by file as :func:`load_tree` parses it.

    Args:
        path: the spec file, resolved.
        raw: its bytes.
        shown: its name as the user gave it.
        within: the folder the chain's files must be in (besides presets), or None for anywhere.
    """
    chain, total = [path], len(raw)
    while len(chain) < MAX_EXTENDS and (match := _PLAIN_EXTENDS.search(raw)) is not None:
        ref = match.group(1).decode("utf-8", "replace")
        base = resolve(path.parent / ref)
        if not base.exists() and (preset := preset_path(ref)) is not None:
            base = resolve(preset)
        if base in chain or not base.is_file() or _outside(base, within):
            return None  # a cycle, a file that is not there or not allowed: the parse says so, where it is
        at = Location(shown, raw[: match.start()].count(b"\n") + 1, match.start(1) - match.start() + 1)
        path, shown = base, shown_path(base, absolute=Path(shown).is_absolute())
        try:
            raw = read_regular(path, MAX_BYTES, "spec", shown=shown)
        except Unreadable:
            return None
        chain.append(path)
        total += len(raw)
        if total > MAX_BYTES:
            return _too_big(shown, len(chain), total, at)
    return None


def _outside(path: Path, within: Path | None) -> bool:
    """Whether the resolved ``path`` is outside the folder ``within`` (never, for None) and not a preset."""
    if within is None or path.is_relative_to(within):
        return False
    folder = _preset_folder()
    return folder is None or not path.is_relative_to(folder)


def _preset_folder() -> Path | None:
    """The bundled presets' folder, resolved."""
    folder = preset_dir()
    return resolve(folder) if folder is not None else None


def _too_many(shown: str, files: int, at: Location | None) -> SpecError:
    return SpecError.at(
        f"the extends chain holds more than {MAX_VALUES:,} values: its {files} files up to '{shown}' do",
        path="extends",
        hint="a spec and its bases hold a few hundred values; shorten the chain or the files",
        location=at,
    )


def load_tree(
    path: Path,
    shown: str,
    chain: tuple[Path, ...],
    at: Location | None,
    total: int = 0,
    values: int = 0,
    *,
    raw: bytes | None = None,
    within: Path | None = None,
) -> tuple[Any, SourceMap]:
    """Read ``path`` and, through ``extends``, every base it names, merged; with where each value came from.

    The bytes of the whole chain count against :data:`MAX_BYTES`, not each file's alone, so that a
    chain of files near the limit cannot cost many times what one file may.

    Args:
        path: the file, resolved.
        shown: its name as the user gave it (or relative to them), for error locations.
        chain: the files read so far, this one included.
        at: where the file was named (the ``extends`` of the file before), or None for the spec itself.
        total: the bytes of the files before it in the chain.
        values: the values of the files before it in the chain: they count against :data:`MAX_VALUES`
            together, as their bytes do against :data:`MAX_BYTES` (20 files of 5,000 values each merged
            100,000 values, for a minute, where one file may hold 10,000).
        raw: the file's bytes when they are not to be read from ``path`` (an editor's unsaved text).
        within: the resolved folder every base must be in, presets aside (``specvit serve``'s folder), or
            None for anywhere.
    """
    if raw is None:
        raw = _read_file(path, shown, at=at)
    if total + len(raw) > MAX_BYTES:
        raise _too_big(shown, len(chain), total + len(raw), at)
    if at is None and (error := _chain_too_big(path, raw, shown, within)) is not None:
        raise error
    if at is None:  # the spec itself: the document's own limit and message
        data, source = read_yaml(raw, shown)
    else:  # a base: what is left of the chain's values, scanned before the document is composed
        over = partial(_too_many, shown, len(chain), at)
        data, source = read_yaml(raw, shown, limit=max(MAX_VALUES - values, 0), too_many=over)
    values += len(source.values)
    if values > MAX_VALUES:
        raise _too_many(shown, len(chain), at)
    source.files.append(str(path))
    if not isinstance(data, dict) or "extends" not in data:
        return data, source
    base_ref = data.pop("extends")
    ref_at = source.values.get(("extends",))
    base_path = _base_path(path, base_ref, chain, within, ref_at)
    base_shown = shown_path(base_path, absolute=Path(shown).is_absolute())
    base_data, base_source = load_tree(
        base_path, base_shown, (*chain, base_path), ref_at, total + len(raw), values, within=within
    )
    if not isinstance(base_data, dict):
        raise SpecError.at(f"the base spec '{base_ref}' is not a mapping", path="extends", location=ref_at)
    merged = _deep_merge(base_data, data)
    base_source.values.pop(("extends",), None)
    _overlay(base_source, source, data)
    base_source.files = [*source.files, *base_source.files]
    return merged, base_source


def _base_path(
    path: Path, base_ref: object, chain: tuple[Path, ...], within: Path | None, ref_at: Location | None
) -> Path:
    """The resolved file ``extends: base_ref`` in ``path`` names, refused when it is not a name, makes the
    chain too long or a cycle, or leaves the served folder."""
    if not isinstance(base_ref, str) or not base_ref:
        raise SpecError.at(
            "extends must name a spec file",
            path="extends",
            hint="write extends: vit_base_patch16_224.yaml (a file relative to this one, or a bundled preset)",
            location=ref_at,
        )
    if len(chain) >= MAX_EXTENDS:
        raise SpecError.at(
            f"extends chains more than {MAX_EXTENDS} files",
            path="extends",
            hint="a spec extends a preset, which may extend another; shorten the chain",
            location=ref_at,
        )
    base_path = resolve(path.parent / base_ref)
    if not base_path.exists() and (preset := preset_path(base_ref)) is not None:
        base_path = resolve(preset)  # a bundled preset, by name, from a spec anywhere
    if _outside(base_path, within):
        raise SpecError.at(
            f"extends names '{base_ref}', outside the folder being served ({within})",
            path="extends",
            hint="extend a preset or a spec in that folder, or serve a folder that holds both files",
            location=ref_at,
        )
    if base_path in chain:
        cycle = " -> ".join(p.name for p in (*chain, base_path))
        raise SpecError.at(
            f"extends forms a cycle: {cycle}",
            path="extends",
            hint="a spec may not extend itself, directly or through others",
            location=ref_at,
        )
    return base_path


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


class Overrides(dict[str, Any]):
    """Dotted-key overrides that remember where each came from (``--set encoder.depth=6``).

    Args:
        origin: the label of each key's origin, shown in place of a file name in its problems.
    """

    def __init__(self, items: Mapping[str, Any] | None = None, origin: Mapping[str, str] | None = None):
        super().__init__(items or {})
        self.origin: dict[str, str] = dict(origin or {})


def _check_key(key: Any, label: Location) -> list[str | int]:
    """The parts of an override's dotted key, or a SpecError saying what is wrong with it."""
    if not isinstance(key, str):
        raise SpecError.at(
            f"an override key must be a string such as 'encoder.depth', got {type(key).__name__}",
            hint="write dotted keys such as encoder.depth",
            location=label,
        )
    parts = key.split(".")
    if len(parts) > MAX_NESTING:  # each level of the path copies the path so far: bound it before walking
        raise SpecError.at(
            f"the override path {quote(key[:40])}... has {len(parts):,} keys, more than the {MAX_NESTING} levels "
            "a spec may nest",
            hint="write dotted keys such as encoder.depth or encoder.block.layers.0",
            location=label,
        )
    for part in parts:
        if not part.strip():
            raise SpecError.at(
                f"the override path {quote(key)} has an empty key"
                + (" between dots" if 0 < parts.index(part) < len(parts) - 1 else ""),
                hint="write dotted keys such as encoder.depth or encoder.block.layers.0",
                location=label,
            )
        if part.isdigit() and not part.isascii():
            raise SpecError.at(
                f"the override path {quote(key)} writes the list index {quote(part)} with digits that are not "
                f"ASCII ({', '.join(unicodedata.name(c, hex(ord(c))) for c in dict.fromkeys(part))})",
                hint="write list indices with the digits 0-9, e.g. layers.2",
                location=label,
            )
    return split_path(key)


def parse_overrides(items: list[str]) -> Overrides:
    """``["encoder.depth=6", "head=none"]`` -> ``{"encoder.depth": 6, "head": "none"}``, values read as YAML.

    Each override remembers its ``--set`` item, so that a problem it causes says it came from ``--set``.

    Args:
        items: ``KEY=VALUE`` strings, as given to ``--set``.

    Raises:
        SpecError: for an item without ``=``, a key with an empty or non-ASCII-digit part, or a value that
            is not plain YAML.
    """
    out = Overrides()
    for item in items:
        key, sep, text = item.partition("=")
        label = Location(f"<--set {item if len(item) <= 200 else item[:200] + '...'}>")  # one readable line
        if not sep or not key.strip():
            raise SpecError.at(
                f"{quote(item)} is not KEY=VALUE", hint="write e.g. --set encoder.depth=6", location=label
            )
        _check_key(key.strip(), label)
        value, _ = read_yaml(text or "null", label.file)
        out[key.strip()] = value
        out.origin[key.strip()] = label.file
    return out


def apply_overrides(
    data: Any,
    source: SourceMap,
    overrides: Mapping[str, Any],
    shorthand: Callable[[KeyPath, str], bool] | None = None,
) -> Any:
    """Set each dotted key of ``overrides`` in ``data`` (in place), pointing the source map at its origin.

    Every key an override creates, at every level, is located at the override, so that an unknown key
    from ``--set`` is reported as coming from ``--set``, not from a line of the file. A path that goes
    into a shorthand kind (``position: rope2d`` and ``encoder.position.base``) expands it first into the
    mapping it stands for, ``{kind: rope2d}``.

    Args:
        data: the parsed spec.
        source: its source map, updated.
        overrides: dotted key -> value; a :class:`Overrides` also names each key's origin.
        shorthand: whether a string at a key path is a shorthand kind there (none is, without it).

    Raises:
        SpecError: for a key that does not lead to a place in the spec.
    """
    if not isinstance(data, dict):
        return data
    origin = getattr(overrides, "origin", {})
    for key, value in overrides.items():
        label = (
            Location(origin.get(key, f"<override {key}>")) if isinstance(key, str) else Location("<override>")
        )
        parts = _check_key(key, label)
        node: Any = data
        for i, part in enumerate(parts):
            here = tuple(parts[: i + 1])
            if isinstance(node, list) and isinstance(part, int) and part < len(node):
                if i < len(parts) - 1:
                    node[part] = _expanded(node[part], here, source, shorthand)
            elif isinstance(node, dict) and isinstance(part, str):
                if part not in node and i < len(parts) - 1:
                    source.keys[here] = label
                    source.values[here] = label
                    node[part] = {}
                elif i < len(parts) - 1:
                    node[part] = _expanded(node[part], here, source, shorthand)
            else:
                raise _no_key(key, parts[:i], node, label)
            if i == len(parts) - 1:
                node[part] = value
            else:
                node = node[part]
        path = tuple(parts)
        for p in [p for p in source.values if p[: len(path)] == path]:
            del source.values[p]
        source.values[path] = label
        source.keys[path] = label
    return data


def _expanded(
    node: Any, path: KeyPath, source: SourceMap, shorthand: Callable[[KeyPath, str], bool] | None
) -> Any:
    """A shorthand kind (``rope2d`` at ``encoder.position``) as the mapping it stands for, its ``kind``
    located where the shorthand was; anything else as it is."""
    if not (isinstance(node, str) and shorthand is not None and shorthand(path, node)):
        return node
    at = source.values.get(path)
    if at is not None:
        source.keys[(*path, "kind")] = source.values[(*path, "kind")] = at
    return {"kind": node}


def _no_key(key: Any, before: list[str | int], node: Any, label: Location) -> SpecError:
    """The error for an override path that goes on past a value, or into a list at no item of it."""
    where = dotted(tuple(before))
    if isinstance(node, list):
        why, hint = f"{where} is a list of {len(node)}", f"index it from 0 to {len(node) - 1}"
    elif isinstance(node, dict):
        why, hint = f"{where or 'the top level'} is a mapping", "write its keys by name"
    else:
        shown = quote(node) if isinstance(node, str) else repr(node)
        why = f"{where} is the value {shown}, not a section"
        hint = f"it has no keys to set; set {where} itself"
    return SpecError.at(
        f"the override path {quote(str(key))} does not lead to a key of the spec: {why}",
        path=where,
        hint=hint,
        location=label,
    )
