"""Pydantic's validation errors -> problems a person can act on: the key path, the file:line:col, a message
in plain words and the fix (did-you-mean on keys and kinds, the number without quotes)."""

from __future__ import annotations

import difflib
import re
from typing import Any

from specvit.errors import Problem
from specvit.spec.schema import Spec
from specvit.spec.yamlread import KeyPath, SourceMap, dotted
from specvit.text import quote, with_oddities

__all__ = ["problem", "show"]


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
    if _numeric(value):
        return f"write the number without quotes: {value.strip()}"
    if any(c.isdigit() for c in value):  # `2024-05-01` is a string (YAML 1.2), not a number to unquote
        return "write a number"
    return "write it in digits, e.g. 6" if kind == "int_type" else "write it in digits, e.g. 0.1"


def _home(key: Any, parent: KeyPath, data: Any) -> str:
    """``heads belongs under encoder.block``: where an unknown key is a real key, one or two levels down
    (every such place, nearest first: ``ratio`` is MAE's masking ratio and the MLP's)."""
    from typing import get_origin

    from pydantic import BaseModel

    cls = _fields_of(parent, data, model=True)
    if cls is None:
        return ""
    homes: list[str] = []
    frontier: list[tuple[str, Any]] = [(dotted(parent), cls)]
    for _ in range(2):
        below: list[tuple[str, Any]] = []
        for prefix, model in frontier:
            for name, field in model.model_fields.items():
                if get_origin(field.annotation) in (dict, list):  # named or listed blocks: not one home
                    continue
                sub = _model_in(field.annotation, None)
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    where = f"{prefix}.{name}" if prefix else name
                    if key in sub.model_fields:
                        homes.append(where)
                    below.append((where, sub))
        frontier = below
    if homes:
        return f"{key} belongs under {' or '.join(homes)}"
    for depth in range(len(parent) - 1, 0, -1):  # a key of an enclosing section (a stack's position)
        outer = _fields_of(parent[:depth], data, model=True)
        if outer is not None and key in outer.model_fields:
            home = f"{key} belongs under {dotted(parent[:depth])}, not {dotted(parent)}"
            in_block = {"block", "blocks"} & set(parent)
            return home + (_PER_BLOCK.get(key, "") if in_block else "")
    return ""


_PER_BLOCK = {
    "position": "; a block varies the stack's rotary positions by its rope: {base: theta} or rope: false, "
    "in blocks: or overrides:",
}
"""What a block may vary of a stack key written in it, said after where the key belongs."""


def _suggest(word: Any, options: list[str]) -> str:
    text = str(word)
    if text.lower() in _ALIASES and text.lower() not in options:
        return _ALIASES[text.lower()]
    folded = {o.lower().replace("-", "_"): o for o in options}
    if text.lower().replace("-", "_") in folded:  # RMSNorm -> rmsnorm, SwiGLU -> swiglu
        return f"did you mean '{folded[text.lower().replace('-', '_')]}'?"
    close = difflib.get_close_matches(text.lower(), list(folded), n=1, cutoff=0.6)
    return f"did you mean '{folded[close[0]]}'?" if close else ""


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
        options = _fields_of(path[:-1], data)
        message = f"unknown key {quote(str(key))}"
        hint = (
            _home(key, path[:-1], data)
            or _suggest(key, options)
            or (f"valid keys: {', '.join(options)}" if options else "remove it")
        )
        hint = "; ".join(h for h in (with_oddities(str(key)), hint) if h)
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
        hint = _suggest(shown, options) or f"use one of {', '.join(options)}"
        if isinstance(shown, str):
            hint = "; ".join(h for h in (with_oddities(shown), hint) if h)
        if kind == "union_tag_invalid":
            path = (*path, "kind") if isinstance(value, dict) and "kind" in value else path
            location = source.locate(path)
            key_path = dotted(path)
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
