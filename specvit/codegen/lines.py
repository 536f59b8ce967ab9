"""Lines of ejected source as ruff's formatter writes them: a statement too long for the line split at its
brackets (one argument a line, a trailing comma), and statements an edit shortened joined back onto one line.
"""

from __future__ import annotations

import ast
import re

__all__ = ["WIDTH", "reflow", "rejoin", "rejoin_lines", "split_args", "split_line"]

WIDTH = 110
"""The line width of the ejected file (specvit's own, ``ruff format --line-length 110``)."""


def split_args(text: str) -> list[str]:
    """Top-level comma-separated parts of an argument list."""
    parts, depth, start, quote = [], 0, 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
            continue
        if ch in "\"'":
            quote = ch
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _closing(text: str, i: int) -> int:
    """The index of the bracket closing the one at ``i``, or -1 (strings are skipped)."""
    depth, quote = 0, ""
    for j in range(i, len(text)):
        ch = text[j]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return -1


def split_line(code: str, indent: str, suffix: str = "") -> list[str]:
    """``indent + code + suffix`` as ruff's formatter writes it: as is if it fits in :data:`WIDTH`, else
    split at the last bracket that closes at its end: the contents on one indented line when they fit,
    otherwise one item a line, each with a trailing comma (so the split is stable), split again as needed.

    Args:
        code: one statement or expression, on one line, without its comment.
        indent: its indentation.
        suffix: what follows it (a comma, a comment).
    """
    if len(indent) + len(code) + len(suffix) <= WIDTH:
        return [indent + code + suffix]
    opening = next(
        (i for i in range(len(code)) if code[i] in "([{" and _closing(code, i) == len(code) - 1), -1
    )
    if opening < 0:  # a bracket closing before the end: split at the last one that opens a call at the end
        return _split_tuple_value(code, indent, suffix)
    head, body, tail = code[: opening + 1], code[opening + 1 : -1], code[-1]
    inner = indent + "    "
    if len(inner) + len(body) <= WIDTH:
        return [indent + head, inner + body, indent + tail + suffix]
    lines = [indent + head]
    for item in split_args(body):
        lines += split_line(item, inner, ",")
    return [*lines, indent + tail + suffix]


def _split_tuple_value(code: str, indent: str, suffix: str) -> list[str]:
    """``a, b = x, y`` too long for a line as ruff writes it: the values in parentheses, one a line."""
    try:
        stmt = ast.parse(code).body[0] if code.isascii() else None  # offsets are bytes: ascii only
    except SyntaxError:
        return [indent + code + suffix]
    value = stmt.value if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
    if not isinstance(value, ast.Tuple) or code[value.col_offset] == "(" or not value.elts:
        return [indent + code + suffix]
    lines = [f"{indent}{code[: value.col_offset]}("]
    for item in value.elts:
        lines += split_line(code[item.col_offset : item.end_col_offset], indent + "    ", ",")
    return [*lines, f"{indent}){suffix}"]


def reflow(lines: list[str]) -> list[str]:
    """A one-line statement longer than :data:`WIDTH` split as ruff splits it (:func:`split_line`)."""
    if len(lines) != 1 or len(lines[0]) <= WIDTH:
        return lines
    line = lines[0]
    indent = line[: len(line) - len(line.lstrip())]
    code, _, comment = line.strip().partition("  # ")
    return split_line(code, indent, f"  # {comment}" if comment else "")


def _joined(lines: list[str]) -> str:
    """Lines of one bracketed statement joined into one, as ruff writes it when it fits (without the
    parentheses that only split a value: ``return (a if b else c)`` is ``return a if b else c``)."""
    out = lines[0].rstrip()
    for line in lines[1:]:
        part = line.strip()
        glue = "" if out.endswith(("(", "[", "{")) or part.startswith((")", "]", "}")) else " "
        out += glue + part
    match = re.fullmatch(r"(\s*(?:return|[\w.]+ =) )\((.*)\)(\s*#.*)?", out)
    if match and _closing(out, len(match.group(1))) == len(out) - len(match.group(3) or "") - 1:
        bare = match.group(1) + match.group(2) + (match.group(3) or "")
        try:
            if ast.dump(ast.parse(bare.strip())) == ast.dump(ast.parse(out.strip())):
                return bare
        except SyntaxError:
            pass
    return out


def rejoin_lines(lines: list[str]) -> list[str]:
    """One statement's lines joined when they fit on one line and nothing (a magic trailing comma, a comment)
    keeps them apart."""
    if (
        len(lines) < 2
        or any("#" in line for line in lines[:-1])
        or any(x.rstrip().endswith(",") for x in lines)
    ):
        return lines
    joined = _joined(lines)
    return [joined] if len(joined) <= WIDTH else lines


def rejoin(source: str) -> str:
    """Statements split over lines that fit on one (after an edit shortened them) joined, unless a magic
    trailing comma or a comment keeps them split."""
    lines = source.splitlines()
    for node in sorted(ast.walk(ast.parse(source)), key=lambda n: -getattr(n, "lineno", 0)):
        if not isinstance(node, ast.Assign | ast.AnnAssign | ast.Expr | ast.Return):
            continue
        first, last = node.lineno, node.end_lineno or node.lineno
        if last == first:
            continue
        span = lines[first - 1 : last]
        if any("#" in line for line in span[:-1]) or any(line.rstrip().endswith(",") for line in span):
            continue
        joined = _joined(span)
        if len(joined) <= WIDTH:
            lines[first - 1 : last] = [joined]
    return "\n".join(lines) + "\n"
