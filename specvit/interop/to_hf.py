"""Back to transformers: a spec that is exactly an HF family, written as the directory its classes load.

The config is the family table read backwards (:meth:`F.write`, :attr:`D.inverse`) and then read forwards
again: only a config whose table reads back the very spec is written, so a spec no HF class computes is
refused with the keys that differ, never written as another model. The weights are the table's names run
backwards (a concatenation split at the HF shapes, a reshape undone).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specvit.errors import Problem, SpecError
from specvit.interop import hf  # noqa: F401  (registers every family's table)
from specvit.interop.layout import RowShare, Transform, Undoable, batched, cat, conv1d, flat, same, unbatched
from specvit.interop.registry import FAMILIES, Config
from specvit.interop.table import TABLES, D, F, Head, Table
from specvit.spec.loader import parse_spec
from specvit.spec.schema import Spec

if TYPE_CHECKING:
    from specvit.model import SpecModel

__all__ = ["hf_config", "to_hf"]

_INVERSE: dict[Transform, Callable[[Tensor], Tensor]] = {
    same: lambda t: t,
    batched: lambda t: t.squeeze(0),
    conv1d: lambda t: t.t().contiguous() if t.ndim == 2 else t,
    flat: lambda t: t.reshape(1, -1),
    unbatched: lambda t: t.unsqueeze(0),
}
"""Transforms of one source undone; a concatenation is split at the HF shapes."""

_NAMES = ("name", "description")

Shapes = dict[str, tuple[int, ...]]
Weights = dict[str, Tensor]


def _at(data: Any, key: str) -> Any:
    """The value at a dotted key of a spec's dump, None where there is none."""
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _written(table: Table, suffix: str, head: Head, dump: dict[str, Any]) -> dict[str, Any]:
    """The config fields that ``table``'s class ``suffix`` of ``head`` reads as the spec dumped in ``dump``."""
    config: dict[str, Any] = {"model_type": table.model_types[0], "architectures": [table.name + suffix]}
    config |= dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id"))  # a spec has no token ids
    for key, entry in {**table.spec, **head.spec}.items():
        value = _at(dump, key)
        if isinstance(entry, F):
            config |= entry.write(value)
        elif isinstance(entry, D) and entry.inverse is not None:
            with contextlib.suppress(  # another family's spec (its keys of other shapes): read back differs
                TypeError, ValueError, KeyError, AttributeError
            ):
                config |= entry.inverse(value, lambda k: _at(dump, k))
    return config


def _differences(a: Any, b: Any, at: str = "") -> list[str]:
    """The dotted keys where two dumps differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{at}{k}.")]
    return [] if a == b else [f"{at[:-1]} is {a!r} in the spec, {b!r} in HF's"]


def hf_config(spec: Spec) -> tuple[Table, dict[str, Any]]:
    """The HF family and config.json fields that state exactly ``spec``.

    Args:
        spec: the spec, imported (``from_hf``) or written.

    Raises:
        SpecError: no family's table reads any config back as this spec; the message names the family that
            comes closest and every key where it differs.
    """
    dump = spec.model_dump(exclude=set(_NAMES))
    best: tuple[tuple[bool, int], str, list[str]] | None = (
        None  # the own family's, then the fewest differences
    )
    own = spec.name.removesuffix("_from_hf")  # an imported spec goes back to its own family first
    tables = {id(t): t for t in sorted(TABLES.values(), key=lambda t: own not in t.model_types)}.values()
    for table in tables:
        if spec.model != table.role:
            continue
        variants = table.variants()  # its own class first (QA is a token classifier)
        variants.sort(key=lambda v: f"({table.name}{v[0]})" not in (spec.description or ""))
        for suffix, head, pooler in variants:
            config = _written(table, suffix, head, dump)
            c = Config(config["model_type"], config, "<to_hf>")
            c.pooler = pooler  # HF's default: the base class builds its pooler
            try:
                back = parse_spec(table.read(c), source="<to_hf>")
            except SpecError as exc:
                diffs = [f"{p.path}: {p.message}" for p in exc.problems]
            else:
                diffs = _differences(dump, back.model_dump(exclude=set(_NAMES)))
                if not diffs:
                    return table, config
            rank = (own not in table.model_types, len(diffs))
            if best is None or rank < best[0]:
                best = (rank, table.name + suffix, diffs)
    closest = f"; the closest, HF {best[1]}, differs: " + "; ".join(best[2][:6]) if best else ""
    untabled = [f.name for f in FAMILIES if own in f.model_types and own not in TABLES]
    if untabled:  # MAE pre-training is read by a function, not a table
        closest = (
            f" (HF {untabled[0]} is read by a converter that is no table, so cannot run backwards)" + closest
        )
    raise SpecError(
        Problem(
            "",
            f"spec {spec.name!r} is no HF model class specvit's tables state{closest}",
            "change those keys to the family's, or keep the model in specvit's own format (save_pretrained)",
        )
    )


def _hf_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every persistent entry of the HF model of ``config``, built on the meta device."""
    try:
        import transformers
    except ImportError:
        raise SpecError(Problem("", "to_hf needs transformers", "pip install transformers")) from None
    hf_config = transformers.AutoConfig.for_model(**config)
    cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = cls(hf_config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _undone(key: str, tensor: Tensor, entry: tuple[tuple[str, ...], Transform], shapes: Shapes) -> Weights:
    """One specvit weight as the HF weights it was made of (a concatenation split at their shapes); a
    :class:`RowShare` as its part, by index, under the HF name."""
    names, transform = entry
    if transform is cat:
        return dict(zip(names, tensor.split([shapes[n][0] for n in names]), strict=True))
    if isinstance(transform, Undoable):
        return {names[0]: transform.undo(tensor)}
    if transform in _INVERSE:
        return {names[0]: _INVERSE[transform](tensor)}
    raise SpecError(Problem(key, f"{key} is made of {names} in a way to_hf cannot undo", "report this"))


def _joined(table: Table, parts: dict[str, dict[int, Tensor]], shares: dict[str, RowShare]) -> Weights:
    """The HF weights whose rows several specvit weights are (SigLIP's head's q and k/v ``in_proj``)."""
    missing = [n for n, got in parts.items() if sorted(got) != list(range(len(shares[n].shares)))]
    if missing:
        raise SpecError(
            Problem("", f"HF {table.name} weights {missing} lack a part in the spec", "report this")
        )
    return {n: torch.cat([got[i] for i in range(len(got))]) for n, got in parts.items()}


def hf_state_dict(model: SpecModel, table: Table, config: dict[str, Any]) -> dict[str, Tensor]:
    """``model``'s weights under the HF names of ``config``'s class.

    Args:
        model: the specvit model of the spec ``hf_config`` accepted.
        table: the family.
        config: its config fields.
    """
    shapes = _hf_shapes(config)
    layout = table.layout(model.spec, list(shapes))
    out: Weights = {}
    parts: dict[str, dict[int, Tensor]] = {}
    shares: dict[str, RowShare] = {}
    for key, tensor in model.state_dict().items():
        entry = layout.sources(key)
        if entry is None:
            raise SpecError(Problem(key, f"HF {table.name} has no weight for {key}", "report this"))
        if isinstance(share := entry[1], RowShare):
            parts.setdefault(entry[0][0], {})[share.part], shares[entry[0][0]] = tensor, share
            continue
        undone = _undone(key, tensor, entry, shapes)
        for name, weight in undone.items():
            if name in out and not torch.equal(out[name], weight):  # Falcon-7B's one norm is specvit's two
                raise SpecError(
                    Problem(
                        key,
                        f"HF {table.name} has one weight {name} where the spec has two, and they differ",
                        "make them equal, or keep the model in specvit's own format (save_pretrained)",
                    )
                )
        out |= undone
    out |= _joined(table, parts, shares)
    for key, want in layout.fixed.items():  # frozen tables the spec computes (Marian's sinusoids)
        if key in shapes:
            out[key] = want(shapes[key]) if callable(want) else want
    missing = sorted(set(shapes) - set(out) - set(layout.tied) - {k for k in shapes if layout.ignored(k)})
    if missing:
        raise SpecError(_unwritten(table, config, missing))
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def _unwritten(table: Table, config: dict[str, Any], missing: list[str]) -> Problem:
    """The refusal of HF weights no specvit weight is: a base model's pooler, or a part no table names."""
    cls = config["architectures"][0]
    if all(".pooler." in f".{k}" for k in missing):
        return Problem(
            "head",
            f"HF {cls} builds a pooler ({', '.join(missing[:4])}) that the spec's head does not compute: the "
            "class leaves it out only when add_pooling_layer=False is passed to it, which a config cannot say",
            "give the spec the pooler's head (from_hf of the model built with its pooler: a classifier head "
            "with tokens: true), or keep the model in specvit's own format (save_pretrained)",
        )
    return Problem("", f"HF {cls} weights with no specvit counterpart: {missing[:6]}", "report this")


def to_hf(model: SpecModel, directory: str | os.PathLike[str]) -> Path:
    """Write ``model`` as an HF model directory (config.json + model.safetensors) transformers loads.

    Args:
        model: a specvit model whose spec is exactly an HF family (imported with ``from_hf``, or written).
        directory: where to write; created if missing, its two files replaced atomically.

    Returns:
        The directory; ``transformers.AutoModelForCausalLM.from_pretrained`` (or the class in
        config.json's ``architectures``) loads it with the same outputs.

    Raises:
        SpecError: the spec is no HF family (the keys that differ from the closest are named).
    """
    from safetensors.torch import save

    from specvit.io import atomic_write

    table, config = hf_config(model.spec)
    weights = hf_state_dict(model, table, config)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / "model.safetensors", save(weights, metadata={"format": "pt"}))
    atomic_write(path / "config.json", json.dumps(config, indent=2) + "\n")
    return path
