"""Pydantic's validation errors -> problems a person can act on: the key path, the file:line:col, a message
in plain words and the fix (did-you-mean on keys and kinds, the number without quotes)."""

from __future__ import annotations

import difflib
import re
import unicodedata
from typing import Any

from specvit.errors import Problem
from specvit.spec.foreign import foreign_key_hint, foreign_value_hint
from specvit.spec.navigate import fields_at, kinds_at, sections_below
from specvit.spec.yamlread import KeyPath, SourceMap, dotted
from specvit.text import quote, with_oddities

__all__ = ["problem", "problems", "show", "unknown_key"]


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
                    "[" in part
                    or part
                    in {"tuple", "function-after", "function-before", "single", "stages", "one", "many"}
                )
            )
        ):
            continue
        else:
            path.append(part)
            node = None
    return tuple(path), node


# Names other libraries and papers use for what specvit writes differently: value -> the hint.
_ALIASES = {
    "gelu_new": "there is no gelu_new; for HF's gelu_new (GPT-2's tanh GELU) write gelu_tanh",
    "gelu_pytorch_tanh": "there is no gelu_pytorch_tanh; for the tanh GELU write gelu_tanh",
    "gelu_fast": "there is no gelu_fast; for the tanh GELU write gelu_tanh",
    "swish": "there is no swish; it is SiLU: write silu (or swiglu for the gated MLP)",
    "gated-gelu": "there is no gated-gelu; for T5 v1.1's gated GELU write geglu_tanh",
    "layer_norm": "write layernorm",
    "ln": "write layernorm",
    "rms_norm": "write rmsnorm",
    "t5_layernorm": "there is no t5_layernorm; T5's norm is RMSNorm: write rmsnorm",
    "absolute": "there is no absolute; for learned absolute positions write learned, for fixed ones sincos",
    "rotary": "write rope",
    "sinusoidal": "write sincos (1D) or sincos2d (images)",
    "t5": "there is no t5; for T5's bucketed relative bias write relative",
    "relative_bias": "write relative",
    "prenorm": "write pre",
    "postnorm": "write post",
    "pre_norm": "write pre",
    "post_norm": "write post",
    "parallel": "there is no parallel here; for parallel attention and MLP (GPT-J, GPT-NeoX) write "
    "parallel: true in the block",
    "attention": "write self_attention (or masked_self_attention for causal, cross_attention)",
    "causal_self_attention": "write masked_self_attention",
    "causal_attention": "write masked_self_attention",
    "ffn": "write mlp",
    "feed_forward": "write mlp",
    "sliding_window": "there is no sliding_window kind; write sliding_window: N in the block",
    "mean_pool": "write mean",
    "avg": "write mean",
}


def _number_hint(value: str, kind: str) -> str:
    """The fix for a string where a number goes: unquote it if it is one, else say what a number looks like."""
    odd = with_oddities(value)
    if odd:  # `２` (fullwidth), `2` + a no-break space: Python's float() reads them, YAML does not
        folded = unicodedata.normalize("NFKC", value).strip()
        return (
            f"write {folded}: {odd}"
            if folded.isascii() and _numeric(folded)
            else f"write it in ASCII digits: {odd}"
        )
    if _numeric(value):
        return f"write the number without quotes: {value.strip()}"
    if any(c.isdigit() for c in value):  # `2024-05-01` is a string (YAML 1.2), not a number to unquote
        return "write a number"
    return "write it in digits, e.g. 6" if kind == "int_type" else "write it in digits, e.g. 0.1"


def _home(key: Any, parent: KeyPath, data: Any) -> tuple[str, list[KeyPath]]:
    """``heads belongs under encoder.block``: where an unknown key is a real key, one or two levels down
    (every such place, nearest first: ``ratio`` is MAE's masking ratio and the MLP's), or in an enclosing
    section; with those places."""
    homes = [path for path, cls in sections_below(parent, data, 2) if key in cls.model_fields]
    if homes:
        return f"{key} belongs under {' or '.join(map(dotted, homes))}", homes
    for depth in range(len(parent) - 1, 0, -1):  # a key of an enclosing section (a stack's position)
        if key in fields_at(parent[:depth], data):
            home = f"{key} belongs under {dotted(parent[:depth])}, not {dotted(parent)}"
            in_block = {"block", "blocks"} & set(parent)
            return home + (_PER_BLOCK.get(key, "") if in_block else ""), [parent[:depth]]
    return "", []


_PER_BLOCK = {
    "position": "; a block varies the stack's rotary positions by its rope: {base: theta} or rope: false, "
    "in blocks: or overrides:",
}
"""What a block may vary of a stack key written in it, said after where the key belongs."""


def _closest(word: Any, options: list[str]) -> str | None:
    """The option ``word`` is most likely a slip for: the same but for case and dashes, or a close spelling."""
    folded = {o.lower().replace("-", "_"): o for o in options}
    text = str(word).lower().replace("-", "_")
    if text in folded:  # RMSNorm -> rmsnorm, SwiGLU -> swiglu
        return folded[text]
    close = difflib.get_close_matches(str(word).lower(), list(folded), n=1, cutoff=0.6)
    return folded[close[0]] if close else None


def _suggest(word: Any, options: list[str]) -> str:
    text = str(word)
    if text.lower() in _ALIASES and text.lower() not in options:
        return _ALIASES[text.lower()]
    close = _closest(word, options)
    return f"did you mean '{close}'?" if close else ""


def unknown_key(key: Any, value: Any, parent: KeyPath, data: Any) -> tuple[str, KeyPath | None]:
    """The fix for an unknown key, and the key path it stands for when that is known.

    In order: another library's name for a specvit key (``embed_dim`` is ``width``), a specvit key written
    in the wrong section (``depth belongs under encoder``), a misspelt key (``postion``), the valid keys.

    Args:
        key: the unknown key.
        value: its value.
        parent: the key path of the section it is in.
        data: the spec's data.

    Returns:
        The hint, and the key path the key stands for (a foreign name's or a misspelt key's), or None.
    """
    options = fields_at(parent, data)
    foreign = foreign_key_hint(key, value, parent, data)
    meant: KeyPath | None = None
    if foreign is not None:
        hint, meant = foreign
    else:
        hint, homes = _home(key, parent, data)
        if len(homes) == 1:
            meant = (*homes[0], key)
        elif not hint:
            close = None if str(key).lower() in _ALIASES else _closest(key, options)
            meant = (*parent, close) if close else None
            hint = _suggest(key, options) or (f"valid keys: {', '.join(options)}" if options else "remove it")
    return "; ".join(h for h in (with_oddities(str(key)), hint) if h), meant


def problems(errors: list[Any], data: Any, source: SourceMap) -> list[Problem]:
    """The problems of Pydantic's errors, one per root cause.

    A required key reported missing is left out when an unknown key beside it stands for it (``postion``,
    or timm's ``embed_dim`` for ``width``): the unknown key's hint says what to write.

    Args:
        errors: ``ValidationError.errors()``.
        data: the spec's data.
        source: where each key path is in the files.
    """
    meant = set()
    for err in errors:
        path = _walk(data, tuple(err["loc"]))[0]
        if err["type"] == "extra_forbidden" and path:
            meant.add(unknown_key(path[-1], err.get("input"), path[:-1], data)[1])
    return [
        problem(err, data, source)
        for err in errors
        if not (err["type"] == "missing" and _walk(data, tuple(err["loc"]))[0] in meant)
    ]


def _mapping_hint(path: KeyPath, value: Any) -> str:
    """The fix for a value where a mapping belongs; a list of blocks gets the schedule syntax."""
    if isinstance(value, list) and path and path[-1] == "block":
        role = dotted(path[:-1])
        return (
            f"a stack has one base block; for blocks that differ along the depth, name them under "
            f"{role}.blocks (each the keys it changes) and order them with {role}.schedule, "
            "e.g. schedule: [local, local, global]"
        )
    return "write the keys of this section indented below it"


def problem(err: Any, data: Any, source: SourceMap) -> Problem:
    kind = err["type"]
    path, _ = _walk(data, tuple(err["loc"]))
    if path and isinstance(path[-1], int) and not isinstance(_walk(data, path[:-1])[1], list):
        path = path[:-1]  # `patch: 0` expands to (0, 0): one problem, not one per side
    value = err.get("input")
    ctx = err.get("ctx") or {}
    key_path = dotted(path)
    message = err["msg"]
    hint = ""
    location = source.locate(path)
    if kind == "extra_forbidden":
        key = path[-1] if path else "?"
        message = f"unknown key {quote(str(key))}"
        hint = unknown_key(key, value, path[:-1], data)[0]
        location = source.locate(path, key=True)
    elif kind == "missing":
        key = path[-1] if path else "?"
        message = f"missing required key '{key}'"
        hint = f"add {key}: under {dotted(path[:-1]) or 'the top level'}"
        if path == ("specvit",):
            hint = "start the file with 'specvit: 1', the format version"
        location = source.locate(path[:-1], key=True)
    elif kind in ("literal_error", "union_tag_invalid"):
        expected = ctx.get("expected_tags") or ctx.get("expected", "")
        options = re.findall(r"'([^']*)'", str(expected)) or re.findall(r"[\w.-]+", str(expected))
        shown = ctx.get("tag", value)
        message = f"{show(shown)} is not one of {', '.join(options)}"
        field = next((p for p in reversed(path) if isinstance(p, str) and p != "kind"), "")
        hint = (
            foreign_value_hint(field, shown) or _suggest(shown, options) or f"use one of {', '.join(options)}"
        )
        if isinstance(shown, str):
            hint = "; ".join(h for h in (with_oddities(shown), hint) if h)
        if kind == "union_tag_invalid":
            path = (*path, "kind") if isinstance(value, dict) and "kind" in value else path
            location = source.locate(path)
            key_path = dotted(path)
    elif kind == "union_tag_not_found":
        message = "needs a 'kind' key"
        hint = f"add kind: one of {', '.join(kinds_at(path, data))}"
    elif kind in ("int_type", "float_type", "bool_type", "string_type"):
        want = {
            "int_type": "an integer",
            "float_type": "a number",
            "bool_type": "true or false",
            "string_type": "a string",
        }[kind]
        message = f"expected {want}, got {show(value)}"
        if isinstance(value, str) and kind in ("int_type", "float_type"):
            hint = _number_hint(value, kind)
        elif isinstance(value, bool) and kind in ("int_type", "float_type"):
            hint = "booleans are not numbers here; write a number"
        elif kind == "bool_type" and isinstance(value, str):
            hint = "write true or false without quotes"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[
            kind
        ]
        bound = next(iter(ctx.values())) if ctx else "?"
        message = f"must be {op} {bound}, got {show(value)}"
    elif kind == "finite_number":
        message = f"must be a finite number, got {show(value)}"
    elif kind in ("too_short", "too_long"):
        bound = ctx.get("min_length") if kind == "too_short" else ctx.get("max_length")
        message = f"needs {'at least' if kind == 'too_short' else 'at most'} {bound} item{'s' * (bound != 1)}, got {ctx.get('actual_length')}"
    elif kind == "string_pattern_mismatch" and path == ("name",):
        message = f"{show(value)} is not a valid name"
        hint = "use only letters, digits, '_', '.' and '-': the name becomes a file name"
    elif kind == "model_type" or kind == "model_attributes_type" or kind == "dict_type":
        message = f"expected a mapping of keys, got {show(value)}"
        hint = _mapping_hint(path, value)
    elif kind == "tuple_type" or kind == "list_type":
        message = f"expected a list, got {show(value)}"
    else:
        message = message[0].lower() + message[1:]
    return Problem(key_path, message, hint, location)


def _numeric(text: str) -> bool:
    """Whether ``text`` reads as a number (so that the fix is to drop its quotes)."""
    try:
        float(text.strip())
    except ValueError:
        return False
    return True


def show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return str(value)
