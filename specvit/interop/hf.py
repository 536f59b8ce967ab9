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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specvit.errors import Location, Problem, SpecError, SpecFileError
from specvit.interop import registry
from specvit.interop.layout import Layout
from specvit.interop.registry import FAMILIES, Config, Family, show_value, untrace
from specvit.interop.table import TABLES
from specvit.io import Unreadable, read_regular
from specvit.spec.loader import parse_spec
from specvit.spec.schema import Spec
from specvit.spec.yamlread import dump_yaml

__all__ = ["from_hf", "hf_layouts", "spec_dict"]

for _module in pkgutil.iter_modules([str(Path(registry.__file__).parent)]):
    if _module.name.startswith("hf_"):
        importlib.import_module(f"specvit.interop.{_module.name}")


CONFIG_BYTES = 1 << 24  # 16 MiB: a config.json is a few KB (a large id2label included)


def _read_json(path: Path) -> Any:
    """The parsed config.json at ``path``: a regular file of at most :data:`CONFIG_BYTES`, valid JSON."""
    where = Location(str(path))
    try:
        raw = read_regular(path, CONFIG_BYTES, "HF config")
    except Unreadable as exc:
        hint = (
            "give the path of a config.json"
            if exc.reason in ("special", "directory", "missing")
            else exc.hint
        )
        raise SpecFileError(Problem("", exc.message, hint, where)) from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        problem = Problem(
            "", f"the file is not UTF-8 text ({exc.reason} at byte {exc.start})", "save it as UTF-8"
        )
    except json.JSONDecodeError as exc:
        problem = Problem("", f"not valid JSON: {exc.msg}", "give the config.json transformers wrote", where)
        where = Location(str(path), exc.lineno, exc.colno)
    except RecursionError:
        problem = Problem("", "the JSON nests too deeply to read", "a config.json is a few levels deep")
    except ValueError as exc:  # an integer of more digits than Python converts
        problem = Problem("", f"a value cannot be read: {exc}", "give the config.json transformers wrote")
    raise SpecError(Problem(problem.path, problem.message, problem.hint, where)) from None


def _config(config: Any, pooler: bool | None = None) -> Config:
    held = False  # a model's pooler, read where its family reads it
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        values = _read_json(path)
        source = str(path)
        if not isinstance(values, dict):
            raise SpecError(
                Problem(
                    "", "the file is not a JSON object", "give the path of a config.json", Location(source)
                )
            )
    elif isinstance(config, dict):
        values, source = dict(config), "<dict>"
    elif hasattr(config, "config") and hasattr(config, "state_dict"):  # a model: its class is the head
        values = config.config.to_dict() | {"architectures": [type(config).__name__]}
        source = f"<{type(config).__name__}>"
        held = _pooler(config, values, source)
    elif hasattr(config, "to_dict"):
        values, source = config.to_dict(), f"<{type(config).__name__}>"
    else:
        raise TypeError(
            f"from_hf takes a transformers model or config, a dict or a config.json path, got {type(config)}"
        )
    model_type = values.get("model_type")
    if not isinstance(model_type, str):
        raise SpecError(
            Problem(
                "config.model_type",
                "the config has no model_type",
                "give a transformers config",
                Location(source),
            )
        )
    cfg = Config(model_type, values, source)
    cfg.pooler = held if pooler is None else pooler
    return cfg


def _pooler(model: Any, values: dict[str, Any], source: str) -> bool:
    """Whether a base model holds its pooler: BertModel, ViTModel, AlbertModel and BeitModel build one
    unless given ``add_pooling_layer=False`` (then ``model.pooler`` is None); CLIPVisionModel and the
    other towers without that switch always compute their ``pooler_output``. A family that reads no pooler
    refuses a model holding one: its ``pooler_output`` is no part of the spec, its weights left over."""
    pooler = getattr(model, "pooler", True)
    table = TABLES.get(str(values.get("model_type")))
    if pooler is None or not type(model).__name__.endswith("Model"):
        return False
    if (table is not None and table.pooled is not None) or not callable(pooler):
        return True
    known = any(values.get("model_type") in f.model_types for f in FAMILIES)  # else the model type is refused
    if not known:
        return False
    keys = [f"pooler.{k}" for k in pooler.state_dict()] if hasattr(pooler, "state_dict") else []
    name, model_type = type(model).__name__, values.get("model_type")
    raise SpecError(
        Problem(
            "config.architectures",
            f"{model_type} config has architectures={[name]}: this {name} builds a pooler "
            f"({', '.join(keys) or 'pooler'}) whose pooler_output a spec without a head does not compute",
            f"build it with {name}(config, add_pooling_layer=False), whose last_hidden_state the spec computes",
            Location(source),
        )
    )


def _family(cfg: Config) -> Family:
    model_type = cfg.model_type
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise SpecError(
        Problem(
            "config.model_type",
            f"model_type {show_value(model_type)} has no specvit family",
            f"specvit reads {', '.join(known)}",
            Location(cfg.source),
        )
    )


def spec_dict(config: Any, *, pooler: bool | None = None) -> dict[str, Any]:
    """The spec of a config as written to a file: the fields that differ from the defaults.

    Args:
        config: a transformers config object, a dict of its fields, or the path of a config.json.
        pooler: as :func:`from_hf`'s.

    Raises:
        SpecError: naming ``config.<field>`` and the file, for a field of the wrong type or of a value
            specvit cannot state, or one the spec made of it refuses (``hidden_size: -64``).
    """
    cfg = _config(config, pooler)
    data, origin = untrace(_family(cfg).spec(cfg))
    try:
        parse_spec(data, source="<from_hf>")
    except SpecError as exc:
        raise SpecError([_blame(cfg, origin, data, p) for p in exc.problems]) from None
    return _without_defaults(data)


def _blame(cfg: Config, origin: dict[str, str], data: dict[str, Any], problem: Problem) -> Problem:
    """A problem of the spec made of ``cfg`` as a problem of the config field its value came from."""
    field = origin.get(problem.path)
    where = Location(cfg.source)
    if field is None:  # a value the family derived (a head_dim of width // heads): say whence it came
        message = f"{problem.message} (in the spec made of this {cfg.model_type} config)"
        return Problem(problem.path, message, problem.hint, where)
    value: Any = data
    for part in problem.path.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    message = f"{cfg.model_type} config has {field}={show_value(value)}: {problem.message}"
    return Problem(f"config.{field}", message, problem.hint, where)


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


def from_hf(config: Any, *, pooler: bool | None = None) -> Spec:
    """The spec of exactly the architecture a transformers config describes.

    A base model with its pooler (``BertModel(config)``, ``ViTModel``, ``CLIPVisionModel``; what
    ``AutoModel`` builds) is read as a ``classifier`` head with ``tokens: true``: the model returns
    ``{"last_hidden_state": ..., "pooler_output": ...}`` as HF's does. A config alone cannot say whether the
    pooler was built (``add_pooling_layer`` is an argument, not a field), so it reads as its base class
    without one (CLIP's towers as before: the text tower's tokens, the vision towers' pooled features),
    unless ``pooler=True``.

    Args:
        config: a transformers model (its class says the head: ``Qwen2ForSequenceClassification``), a
            config object (``LlamaConfig(...)``, ``AutoConfig.from_pretrained(...)``; its ``architectures``
            say the class), a dict of its fields, or the path of a config.json.
        pooler: whether the base model holds its pooler; None: a model says it (``model.pooler`` is None
            after ``add_pooling_layer=False``), a config reads as without. Other classes ignore it.

    Returns:
        The validated spec; ``build_model(spec)`` loads the HF model's weights through
        ``convert_state_dict(state_dict, "hf", spec)``.

    Raises:
        SpecError: the model type has no specvit family, or a field has a value specvit cannot state;
            the problem names the field and its value.
    """
    data = spec_dict(config, pooler=pooler)
    return parse_spec(data, source=f"{data['name']} (from a {data['model']} HF config)")


def hf_layouts(keys: Sequence[str]) -> list[Callable[[Spec, Sequence[str]], Layout]]:
    """The layouts of the registered families whose state dicts may have these keys, in registration order
    (families of one shared layout name most of their weights alike: the converter takes the first that
    places every key)."""
    return [f.layout for f in FAMILIES if f.reads(keys)]


def to_yaml(config: Any) -> str:
    """The readable YAML spec of a config (defaults left out), as ``specvit import hf`` writes it."""
    return dump_yaml(spec_dict(config))
