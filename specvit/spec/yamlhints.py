"""Plain-words explanations of YAML layout mistakes (a key indented wrong, a `: ` inside a value), with the
columns to use, for :mod:`specvit.spec.yamlread`."""

from __future__ import annotations

from typing import Any

__all__ = ["layout_problem"]


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
