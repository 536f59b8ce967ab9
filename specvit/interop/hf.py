"""HF transformers interop: the spec of a config (:func:`from_hf`), and the weight layout of its models.

transformers is optional: :func:`from_hf` reads a config object, a dict or a ``config.json`` without it.
Every config field that changes what the model computes is either stated in the spec or checked to have a
value the spec states; anything else is refused with a :class:`~specvit.errors.SpecError` naming it.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specvit.errors import Problem, SpecError
from specvit.interop import registry
from specvit.interop.layout import Layout
from specvit.interop.registry import FAMILIES, Config, Family
from specvit.spec.loader import parse_spec
from specvit.spec.schema import Spec
from specvit.spec.yamlread import dump_yaml

__all__ = ["from_hf", "hf_layout", "spec_dict"]

for _module in pkgutil.iter_modules([str(Path(registry.__file__).parent)]):
    if _module.name.startswith("hf_"):
        importlib.import_module(f"specvit.interop.{_module.name}")


def _config(config: Any) -> Config:
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SpecError(
                Problem("", f"cannot read {path}: {exc}", "give the path of a config.json")
            ) from None
        if not isinstance(values, dict):
            raise SpecError(Problem("", f"{path} is not a JSON object", "give the path of a config.json"))
    elif isinstance(config, dict):
        values = dict(config)
    elif hasattr(config, "to_dict"):
        values = config.to_dict()
    else:
        raise TypeError(
            f"from_hf takes a transformers config, a dict or a config.json path, got {type(config)}"
        )
    model_type = values.get("model_type")
    if not isinstance(model_type, str):
        raise SpecError(
            Problem("config.model_type", "the config has no model_type", "give a transformers config")
        )
    return Config(model_type, values)


def _family(model_type: str) -> Family:
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise SpecError(
        Problem(
            "config.model_type",
            f"model_type {model_type!r} has no specvit family",
            f"specvit reads {', '.join(known)}",
        )
    )


def spec_dict(config: Any) -> dict[str, Any]:
    """The spec of a config as written to a file: the fields that differ from the defaults.

    Args:
        config: a transformers config object, a dict of its fields, or the path of a config.json.
    """
    cfg = _config(config)
    return _without_defaults(_family(cfg.model_type).spec(cfg))


_KEEP = {"specvit", "name", "description", "model", "kind"}


def _without_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys whose value is the default (the spec stays equal), and ``{kind: k}``
    written as ``k`` where the language allows it."""
    whole = parse_spec(data, source="<from_hf>")

    def prune(node: dict[str, Any]) -> None:
        for key in list(node):
            value = node[key]
            if isinstance(value, dict):
                prune(value)
            if key in _KEEP:
                continue
            node.pop(key)
            try:
                if parse_spec(data, source="<from_hf>") == whole:
                    continue
            except SpecError:
                pass
            node[key] = value

    prune(data)
    for stack in ("encoder", "decoder"):
        section = data.get(stack, {})
        if isinstance(section.get("position"), dict) and list(section["position"]) == ["kind"]:
            section["position"] = section["position"]["kind"]
    if isinstance(data.get("head"), dict) and list(data["head"]) == ["kind"]:
        data["head"] = data["head"]["kind"]
    return data


def from_hf(config: Any) -> Spec:
    """The spec of exactly the architecture a transformers config describes.

    Args:
        config: a transformers config object (``LlamaConfig(...)``, ``AutoConfig.from_pretrained(...)``),
            a dict of its fields, or the path of a config.json.

    Returns:
        The validated spec; ``build_model(spec)`` loads the HF model's weights through
        ``convert_state_dict(state_dict, "hf", spec)``.

    Raises:
        SpecError: the model type has no specvit family, or a field has a value specvit cannot state;
            the problem names the field and its value.
    """
    data = spec_dict(config)
    return parse_spec(data, source=f"{data['name']} (from a {data['model']} HF config)")


def hf_layout(spec: Spec, keys: Sequence[str]) -> Layout | None:
    """The layout of an HF state dict with these keys, if a registered family reads it."""
    for f in FAMILIES:
        if f.reads(keys):
            return f.layout(spec, keys)
    return None


def to_yaml(config: Any) -> str:
    """The readable YAML spec of a config (defaults left out), as ``specvit import hf`` writes it."""
    return dump_yaml(spec_dict(config))
