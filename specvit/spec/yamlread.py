"""Reading YAML safely: plain data only, bounded in size, nesting and expansion, with the file:line:col of
every value.

A spec file is untrusted input. It is read as plain YAML only (mappings, lists, strings, numbers,
booleans, null): tags that would construct objects are refused, duplicate keys are errors, and
size, nesting depth and alias expansion are bounded so that no file can hang or exhaust memory.
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Callable
from typing import Any

import yaml

from specvit.errors import Location, Problem, SpecError
from specvit.spec.yamlhints import PLAIN_TAGS, Stray, clip, layout_problem, stray_characters, yaml11_problem
from specvit.text import quote

__all__ = [
    "MAX_BYTES",
    "MAX_NESTING",
    "MAX_VALUES",
    "KeyPath",
    "SourceMap",
    "dotted",
    "dump_yaml",
    "read_yaml",
    "split_path",
    "too_big",
]

MAX_BYTES = 1 << 20  # 1 MiB: a spec is a page of YAML; anything larger is refused before parsing
MAX_NESTING = 64
MAX_VALUES = 10_000  # values after alias expansion (a spec has ~100): bounds "billion laughs" documents
TooMany = Callable[[], SpecError] | None  # the error of a document over its values (an extends chain's)

KeyPath = tuple[str | int, ...]

_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_NOT_IMPLICIT = {"tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:value", "tag:yaml.org,2002:yaml"}


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


# YAML 1.2 where it differs from PyYAML's YAML 1.1: `2024-05-01` and `=` are strings (1.1 makes a timestamp
# and a "value" tag of them), `0o17` is an integer; the forms 1.1 and 1.2 read as different values (`012`,
# `1_000`, `1:30`, `0b1`, `yes`, `off`) are refused by yamlhints.yaml11_problem, with the fix.
_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in _NOT_IMPLICIT]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?0o[0-7]+$"), list("-+0"))


def _short_tag(tag: str) -> str:
    return "!!" + tag.removeprefix("tag:yaml.org,2002:") if tag.startswith("tag:yaml.org,2002:") else tag


def _loc(file: str, mark: Any) -> Location:
    return Location(file, mark.line + 1, mark.column + 1)


def dotted(path: KeyPath) -> str:
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
        self.files: list[str] = []  # the files read, the spec's own first (its extends chain after it)

    def locate(self, path: KeyPath | str, *, key: bool = False) -> Location | None:
        """The location of ``path``, or of its nearest ancestor that the source spells out."""
        parts: KeyPath = tuple(split_path(path)) if isinstance(path, str) else path
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
    plain = layout_problem(problem, mark, getattr(exc, "context_mark", None), text)
    if plain is not None:
        return Problem("", plain[0], plain[1], location)
    context = getattr(exc, "context", None)
    message = f"YAML syntax error: {problem}" + (f" ({context})" if context else "")
    hint = "fix the YAML at this position"
    if "\t" in problem or "'\\t'" in problem:
        message = "a tab character where YAML expects indentation or a value"
        hint = "YAML does not allow tabs for indentation; indent with spaces"
    return Problem("", message, hint, location)


def _check_nesting(
    text: str, file: str, limit: int = MAX_VALUES, too_many: TooMany = None
) -> list[yaml.Event]:
    """Walk the event stream (iterative, cheap) so that deep nesting never reaches a recursive composer.

    It also counts the values (nodes not mapping keys) and stops past ``limit``: a long document is refused
    after scanning that many values rather than parsed and composed whole. Where PyYAML has libyaml, its C
    parser walks the text first (a 300 KB list of 100,000 values is refused in milliseconds, not the half
    second PyYAML's own scanner takes); a text it cannot parse is left to PyYAML's, whose messages the
    friendly ones are made from. Returns PyYAML's events, for :class:`_Replay` to compose without parsing
    the text again."""
    if _C_LOADER is not None:
        with contextlib.suppress(yaml.YAMLError):
            _walk(yaml.parse(text, Loader=_C_LOADER), file, limit, too_many, keep=False)
    return _walk(yaml.parse(text, Loader=_Loader), file, limit, too_many, keep=True)


_C_LOADER = getattr(yaml, "CSafeLoader", None)


def _walk(stream: Any, file: str, limit: int, too_many: TooMany, keep: bool) -> list[yaml.Event]:
    """:func:`_check_nesting`'s walk over one parser's events; the events, if ``keep``."""
    events: list[yaml.Event] = []
    values = 0
    open_: list[bool | None] = []  # per open collection: None for a list; for a mapping, is a key next?
    for event in stream:
        if keep:
            events.append(event)
        if isinstance(event, yaml.NodeEvent):
            is_key = bool(open_) and open_[-1] is True
            if open_ and open_[-1] is not None:
                open_[-1] = not open_[-1]
            values += not is_key
            if values > limit:
                if too_many is not None:
                    raise too_many()
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
    return events


class _Replay(_Loader):
    """The composer of :class:`_Loader` over events :func:`_check_nesting` parsed: the text is parsed once
    (parsing is most of what reading a spec costs)."""

    def __init__(self, events: list[yaml.Event]):
        yaml.composer.Composer.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self._events = collections.deque(events)

    def check_event(self, *choices: Any) -> bool:
        if not self._events:
            return False
        return not choices or isinstance(self._events[0], choices)

    def peek_event(self) -> yaml.Event:
        return self._events[0]

    def get_event(self) -> yaml.Event:
        return self._events.popleft()

    def dispose(self) -> None:
        pass


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
        if isinstance(node, yaml.ScalarNode) and node.tag in PLAIN_TAGS:
            return self._scalar(node, path)
        self.problems.append(
            Problem(
                dotted(path),
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
                path=dotted(path),
                hint="an anchored mapping or list cannot include itself; write the values out",
                location=_loc(self.file, node.start_mark),
            )
        if self.depth >= MAX_NESTING:  # the text nests <= 64 deep, but aliases and merges can stack anchors
            raise SpecError.at(
                f"the document nests deeper than {MAX_NESTING} levels once its aliases are expanded",
                path=dotted(path),
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
        ambiguous = yaml11_problem(node, self.scalars)
        if ambiguous is not None:
            message, hint = ambiguous
            self.problems.append(Problem(dotted(path), message, hint, _loc(self.file, node.start_mark)))
            return None
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
                message = f"{clip(node.value)!r} is not a valid {_short_tag(node.tag)}"
                hint = "remove the tag or correct the value"
            self.problems.append(Problem(dotted(path), message, hint, _loc(self.file, node.start_mark)))
            return None

    def _mapping(self, node: yaml.MappingNode, path: KeyPath) -> dict[str, Any]:
        out: dict[str, Any] = {}
        merged: dict[str, Any] = {}
        first_merge: Location | None = None
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG and first_merge is not None:
                self.problems.append(
                    Problem(
                        dotted(path),
                        f"a second merge key (<<) in one mapping (first at line {first_merge.line})",
                        "a mapping has one merge key; merge several mappings with one: <<: [*a, *b]",
                        _loc(self.file, key_node.start_mark),
                    )
                )
                continue
            if key_node.tag == _MERGE_TAG:
                first_merge = _loc(self.file, key_node.start_mark)
                for source in value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]:
                    value = self.convert(source, path)
                    if isinstance(value, dict):
                        for k, v in value.items():
                            merged.setdefault(k, v)
                    else:
                        self.problems.append(
                            Problem(
                                dotted(path),
                                "a merge key (<<) needs a mapping",
                                "merge an anchored mapping: <<: *name",
                                _loc(self.file, source.start_mark),
                            )
                        )
                continue
            if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:str"):
                self.problems.append(
                    Problem(
                        dotted(path),
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
                        dotted(child),
                        f"duplicate key {quote(key)} (first at line {self.source.keys[child].line})",
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


def _show_node(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return quote(clip(str(node.value)))


def read_yaml(
    text: str | bytes, file: str = "<string>", *, limit: int = MAX_VALUES, too_many: TooMany = None
) -> tuple[Any, SourceMap]:
    """Parse one YAML document into plain data and the location of every value.

    Args:
        text: the document, as text or as UTF-8 bytes.
        file: the name used in error locations.
        limit: the values it may hold (less for a base of an extends chain, whose files share the limit).
        too_many: the error for a document over ``limit`` (default: the document's own).

    Raises:
        SpecError: on anything that is not a single, plain, bounded YAML document.
    """
    if isinstance(text, bytes):
        raw = text
        if len(raw) > MAX_BYTES:
            raise too_big(len(raw), file)
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
        raise too_big(len(text), file)
    strays = [] if text.isascii() else stray_characters(text)
    if any(s.breaks_lines for s in strays):
        raise SpecError([_stray(s, file) for s in strays if s.breaks_lines])
    try:
        node = _Replay(_check_nesting(text, file, limit, too_many)).get_single_node()
    except _TooDeep as exc:
        raise _too_deep(_loc(file, exc.mark)) from None
    except yaml.YAMLError as exc:  # a look-alike of YAML's syntax is the cause when there is one
        raise SpecError([_stray(s, file) for s in strays] or _yaml_problem(exc, file, text)) from None
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


def _stray(stray: Stray, file: str) -> Problem:
    return Problem("", stray.message, stray.hint, Location(file, stray.line, stray.column))


def too_big(size: int, file: str) -> SpecError:
    return SpecError.at(
        f"the file is {size:,} bytes, over the {MAX_BYTES:,}-byte limit for a spec",
        hint="a spec is a page of YAML; is this the right file?",
        location=Location(file, 1, 1),
    )


def dump_yaml(data: Any) -> str:
    """Plain YAML for ``data``, keys in insertion order."""
    return yaml.dump(data, Dumper=_PlainDumper, sort_keys=False, default_flow_style=None, width=100)


class _PlainDumper(yaml.SafeDumper):
    """A safe dumper that writes a value used twice twice, never as an anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def split_path(path: str) -> list[str | int]:
    """``"encoder.layers.0"`` -> ``["encoder", "layers", 0]``; only ASCII digits make a list index."""
    return [int(p) if p.isascii() and p.isdigit() else p for p in path.split(".")] if path else []
