"""Plain-words explanations of YAML layout mistakes (a key indented wrong, a `: ` inside a value), with the
columns to use, and the characters that pass for YAML's own but are not, for :mod:`specvit.spec.yamlread`."""

from __future__ import annotations

import re
import unicodedata
from typing import Any, NamedTuple

import yaml

__all__ = ["PLAIN_TAGS", "Stray", "clip", "layout_problem", "stray_characters", "yaml11_problem"]

PLAIN_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
}
_YAML12_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*|0o[0-7]+|0x[0-9a-fA-F]+)")
_DECIMAL = re.compile(r"[-+]?[0-9]+")

_BREAKS = "\u0085\u2028\u2029"
"""Line breaks to YAML 1.1 (PyYAML) that editors draw as nothing: every later line number would be off."""
_SPACES = "\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000"
"""Spaces other than U+0020, which YAML does not read as the space its syntax needs."""
_INDENT = re.compile(f"^ *[{_SPACES}][ {_SPACES}]*")
_AFTER_KEY = re.compile(f"^ *(?:- +)*([A-Za-z_][\\w.-]*) *(?:(\uff1a|\ufe55|\ufe13)|:([{_SPACES}]))")
"""``key：`` with a fullwidth (or small, or vertical) colon, or ``key:`` followed by a no-break space."""


_NAMES = {"\u0085": "NEL next-line character"}


def _named(ch: str) -> str:
    name = _NAMES.get(ch) or unicodedata.name(ch, "").lower()
    return f"a {name} (U+{ord(ch):04X})"


class Stray(NamedTuple):
    """A character that passes for YAML syntax but is not one, where an editor shows it (1-based)."""

    line: int
    column: int
    message: str
    hint: str
    breaks_lines: bool
    """A line break to YAML an editor does not show: refused wherever it is, as every later line would be
    numbered wrong; the others are pointed out when the document does not parse."""


def stray_characters(text: str) -> list[Stray]:
    """Each character that looks like YAML syntax to a reader but is not, in the order of the text.

    Line breaks editors do not show (U+2028, U+2029, NEL) anywhere; spaces other than U+0020 in indentation
    or after a key's colon; a fullwidth colon after a key. Lines and columns count as editors do (only
    ``\\n`` breaks a line).

    Args:
        text: the YAML document.
    """
    found: list[Stray] = []
    for number, line in enumerate(text.split("\n"), 1):
        for match in re.finditer(f"[{_BREAKS}]", line):
            found.append(Stray(number, match.start() + 1, f"{_named(match.group())}: a line break to YAML that "
                               "editors do not show, so every later line would be numbered wrong",
                               f"delete it; inside double quotes, write it as the escape \\u{ord(match.group()):04x}",
                               True))  # fmt: skip
        indent = _INDENT.match(line)
        if indent:
            odd = next(c for c in indent.group() if c != " ")
            found.append(Stray(number, indent.group().index(odd) + 1, f"{_named(odd)} in the indentation",
                               "indent with plain spaces: retype the start of the line", False))  # fmt: skip
        key = _AFTER_KEY.match(line)
        if key and key.group(2):
            found.append(Stray(number, key.start(2) + 1, f"{_named(key.group(2))} after '{key.group(1)}'",
                               f"write an ASCII colon: '{key.group(1)}: '", False))  # fmt: skip
        elif key and key.group(3):
            found.append(Stray(number, key.start(3) + 1, f"{_named(key.group(3))} after '{key.group(1)}:'",
                               "write a plain space after the colon", False))  # fmt: skip
    return found


def layout_problem(problem: str, mark: Any, context_mark: Any, text: str) -> tuple[str, str] | None:
    """PyYAML's parser words for the two usual layout slips, in a person's words (message, hint).

    A key indented less (or more) than its siblings reads to PyYAML as "expected <block end>, but found
    '<block mapping start>'"; a key indented under a key that already has a value, or a ``: `` inside an
    unquoted value, as "mapping values are not allowed here".
    """
    if mark is None:
        return None
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    indent = len(line) - len(line.lstrip(" "))
    if problem.startswith("expected <block end>") and context_mark is not None:
        options = [f"{n} spaces, as '{key}' at line {i + 1}" for i, n, key in _open_keys(lines, mark.line)]
        return (
            f"this line is indented {indent} spaces, which matches no mapping above it",
            "keys of one mapping start in the same column: indent it " + " or ".join(options[:3])
            if options
            else "keys of one mapping start in the same column",
        )
    if problem.startswith("mapping values are not allowed"):
        above = next(
            (ln for ln in reversed(lines[: mark.line]) if ln.strip() and not ln.lstrip().startswith("#")), ""
        )
        above_indent = len(above) - len(above.lstrip(" "))
        if line[:indent].strip() == "" and mark.column > indent and indent > above_indent and ":" in above:
            key = above.strip().split(":")[0]
            return (
                f"this key is indented deeper than '{key}' above it, which already has a value",
                f"indent it as '{key}' ({above_indent} spaces); to nest it under '{key}', leave '{key}:' "
                "without a value",
            )
        return (
            "a ': ' inside a value, which YAML reads as a new key",
            "put the value in quotes, or end the line after the key's colon",
        )
    return None


def _open_keys(lines: list[str], before: int) -> list[tuple[int, int, str]]:
    """(line index, indent, key) of the nearest key at each shallower indent above line ``before``."""
    out: list[tuple[int, int, str]] = []
    for i in range(before - 1, -1, -1):
        ln = lines[i]
        if not ln.strip() or ln.lstrip().startswith(("#", "-")) or ":" not in ln:
            continue
        n = len(ln) - len(ln.lstrip(" "))
        if not out or n < out[-1][1]:
            out.append((i, n, ln.strip().split(":")[0]))
        if n == 0:
            break
    return out


def yaml11_problem(node: yaml.ScalarNode, scalars: Any) -> tuple[str, str] | None:
    """The message and fix for a plain scalar that YAML 1.1 and YAML 1.2 read as different values.

    ``012`` is 10 in YAML 1.1 (octal) and 12 in 1.2; ``1_000`` and ``1:30`` are numbers in 1.1 (1000,
    90) and strings in 1.2; ``yes`` and ``off`` are booleans in 1.1 and strings in 1.2; ``089`` is a
    string in 1.1 and 89 in 1.2. A spec must mean one thing to every reader, so these are refused.

    Args:
        node: a scalar node.
        scalars: a YAML 1.1 constructor (PyYAML's SafeConstructor), to read the value 1.1 gives it.
    """
    text, tag = node.value, node.tag
    if node.style is not None or tag not in PLAIN_TAGS:
        return None
    quoted = f"quote the value for a string: '{clip(text)}'"
    if tag == "tag:yaml.org,2002:bool" and text.lower() not in ("true", "false"):
        word = "true" if text.lower() in ("yes", "on", "y") else "false"
        return (
            f"{clip(text)} is the boolean {word} in YAML 1.1 but a string in YAML 1.2",
            f"write {word} for the boolean, or {quoted}",
        )
    if tag == "tag:yaml.org,2002:str" and _DECIMAL.fullmatch(text):
        number = clip(text.lstrip("+0") or "0")
        return (
            f"{clip(text)} is a string in YAML 1.1 (a leading zero) but the number {number} in YAML 1.2",
            f"write {number} for the number, or {quoted}",
        )
    numeric = tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    if not numeric or (tag.endswith("int") and _YAML12_INT.fullmatch(text)):
        return None
    if tag.endswith("float") and "_" not in text and ":" not in text:
        return None
    try:
        old = scalars.construct_object(node)
    except (ArithmeticError, LookupError, TypeError, ValueError, yaml.YAMLError):
        return None  # reported by _scalar
    if _DECIMAL.fullmatch(text.replace("_", "")) and not text.replace("_", "").lstrip("+-").startswith("0"):
        return (
            f"{clip(text)} is the number {old} in YAML 1.1 but a string in YAML 1.2 (the '_')",
            f"write {old} without '_', or {quoted}",
        )
    if ":" in text:
        return (
            f"{clip(text)} is the base-60 number {old} in YAML 1.1 but a string in YAML 1.2",
            f"write {old}, or {quoted}",
        )
    if text.lstrip("+-").startswith(("0b", "0B")):
        return (
            f"{clip(text)} is the binary number {old} in YAML 1.1 but a string in YAML 1.2",
            f"write {old}, or {quoted}",
        )
    digits = text.replace("_", "")
    if _DECIMAL.fullmatch(digits):
        sign = "-" if digits.startswith("-") else ""
        twelve = sign + (digits.lstrip("+-").lstrip("0") or "0")
        return (
            f"{clip(text)} is the octal number {old} in YAML 1.1 (a leading zero) but {twelve} in YAML 1.2",
            f"write {twelve} without the leading zero (or {sign}0o{twelve.lstrip('-')} for octal), or {quoted}",
        )
    return (
        f"{clip(text)} is the number {old} in YAML 1.1 but a string in YAML 1.2 (the '_')",
        f"write {old} without '_', or {quoted}",
    )


def clip(text: str, limit: int = 40) -> str:
    """``text``, cut to ``limit`` characters with an ellipsis.

    Args:
        text: the text.
        limit: the most characters shown.
    """
    return text if len(text) <= limit else text[: limit - 3] + "..."
