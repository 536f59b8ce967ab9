"""timm interop: the spec of a timm model instance (:func:`from_timm`), and the weight layout of its models.

timm is optional: this module reads a model's attributes and never imports timm. A family module
(``specvit/interop/timm_*.py``) registers one :class:`TimmFamily` per model class it covers: how to read
the instance into a spec, the module classes such a model may contain, and how its state dict is named.

Exactness is checked twice. Every submodule's class must be one the family knows (a custom norm, a
different block class or an attention pool is refused by name, never skipped), and every attribute that
changes what the model computes is either written into the spec or checked to have a value the spec
states; anything else is refused with a :class:`~specvit.errors.SpecError` naming it
(``model.blocks.3.attn.scale``).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specvit.errors import Problem, SpecError
from specvit.interop.layout import Layout
from specvit.spec.loader import parse_spec
from specvit.spec.schema import Spec

__all__ = ["TIMM_FAMILIES", "Reader", "TimmFamily", "from_timm", "timm_family", "timm_layouts"]

COMMON_MODULES = frozenset(
    {"Linear", "Conv2d", "Dropout", "Identity", "DropPath", "Sequential", "ModuleList", "LayerNorm"}
)
"""Module classes any family may contain; what each computes is read from its attributes."""


class Reader:
    """A timm model read attribute by attribute; refusals name the attribute's path.

    Args:
        model: the timm model instance.
    """

    def __init__(self, model: Any):
        self.model = model
        self.cls = type(model).__name__

    def at(self, path: str) -> Any:
        """The attribute at a dotted path (``blocks.0.attn.num_heads``)."""
        obj = self.model
        for part in path.split("."):
            obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
        return obj

    def refuse(self, path: str, value: Any, why: str, fix: str) -> SpecError:
        """The error for an attribute whose value specvit cannot state exactly."""
        return SpecError(Problem(f"model.{path}", f"{self.cls} has {path}={value!r}: {why}", fix))

    def classifier(self) -> dict[str, Any]:
        """A classifier head's ``classes`` and the bias of timm's ``head`` linear; ``num_classes=0`` is
        ``classes: None`` (the pooled features, timm's ``head`` an ``nn.Identity``)."""
        classes = self.model.num_classes or None
        return {"classes": classes} | ({"bias": self.at("head").bias is not None} if classes else {})

    def only(self, path: str, allowed: Sequence[Any], why: str) -> Any:
        """An attribute whose value must be one of ``allowed``; anything else is refused."""
        value = self.at(path)
        if value not in allowed:
            raise self.refuse(path, value, why, f"build it with {' or '.join(repr(a) for a in allowed)}")
        return value

    def absent(self, path: str, why: str) -> None:
        """An optional submodule that must be ``nn.Identity`` (or None): what it would compute has no spec."""
        value = self.at(path)
        if value is not None and type(value).__name__ != "Identity":
            raise self.refuse(path, type(value).__name__, why, "build the model without it")

    def same(self, paths: Sequence[str], read: Callable[[str], Any], what: str) -> Any:
        """``read(path)`` for every path (one per block), refused unless all are equal.

        Args:
            paths: the module paths to read (``blocks.0``, ``blocks.1``...).
            read: reads one module's value.
            what: what the value is, for the message.
        """
        values = [read(p) for p in paths]
        for path, value in zip(paths, values, strict=True):
            if value != values[0]:
                raise self.refuse(
                    path,
                    value,
                    f"its {what} differs from {paths[0]}'s ({values[0]!r})",
                    "write such a model as a spec with blocks:/overrides: by hand",
                )
        return values[0]

    def norm(self, path: str) -> dict[str, Any]:
        """The spec's ``norm`` fields of a LayerNorm or RmsNorm at ``path``."""
        module = self.at(path)
        name = type(module).__name__
        if not getattr(module, "elementwise_affine", True) and name != "RmsNorm":
            raise self.refuse(
                path, "elementwise_affine=False", "a norm without weights", "use an affine norm"
            )
        if name == "LayerNorm":
            return {"kind": "layernorm", "eps": float(module.eps), "bias": module.bias is not None}
        if name == "RmsNorm" and module.weight is not None:
            return {"kind": "rmsnorm", "eps": float(module.eps)}
        raise self.refuse(path, name, "specvit has layernorm and rmsnorm", "build it with either")

    def activation(self, path: str) -> str:
        """The spec's MLP activation for the activation module at ``path``."""
        module = self.at(path)
        name = type(module).__name__
        if name == "GELU":
            return "gelu_tanh" if getattr(module, "approximate", "none") == "tanh" else "gelu"
        table = {"GELUTanh": "gelu_tanh", "QuickGELU": "quick_gelu", "SiLU": "silu", "ReLU": "relu"}
        if name not in table:
            raise self.refuse(
                path, name, "specvit has no such activation", f"use one of GELU, {', '.join(table)}"
            )
        return table[name]

    def scale(self, path: str, head_dim: int) -> float | None:
        """``attention_scale`` for the attention at ``path``: None when it is the default 1/sqrt(head_dim)."""
        scale = float(self.at(path + ".scale"))
        return None if math.isclose(scale, head_dim**-0.5, rel_tol=1e-12) else scale

    def drop_path(self, blocks: Sequence[str], name: str = "drop_path1") -> float:
        """The stack's ``drop_path``: timm's per-block rates must rise linearly from 0 to it."""
        rates = [float(getattr(self.at(f"{b}.{name}"), "drop_prob", 0.0)) for b in blocks]
        last = rates[-1]
        n = len(rates)
        for i, (path, rate) in enumerate(zip(blocks, rates, strict=True)):
            expected = last * i / (n - 1) if n > 1 else last
            if not math.isclose(rate, expected, rel_tol=1e-6, abs_tol=1e-9):
                raise self.refuse(
                    f"{path}.{name}.drop_prob",
                    rate,
                    f"specvit's stochastic depth rises linearly from 0 to {last} ({expected:g} here)",
                    "build the model with drop_path_rate (timm's linear schedule)",
                )
        return last

    def dropout(self, path: str) -> float:
        module = self.at(path)
        return float(module.p) if type(module).__name__ == "Dropout" else 0.0


@dataclass(frozen=True)
class TimmFamily:
    """One timm model class.

    Args:
        classes: the timm model class names it reads (``VisionTransformer``).
        modules: the class names of the submodules such a model may contain, besides
            :data:`COMMON_MODULES`; any other is refused.
        keys: a regular expression some key of its state dicts matches and no other family's does, or
            None for the family read when no other one matches (``VisionTransformer``).
        spec: a :class:`Reader` -> the spec's fields.
        layout: (spec, state dict keys) -> where each specvit parameter comes from.
    """

    classes: tuple[str, ...]
    modules: frozenset[str]
    keys: str | None
    spec: Callable[[Reader], dict[str, Any]]
    layout: Callable[[Spec, Sequence[str]], Layout]

    def reads(self, keys: Sequence[str]) -> bool:
        return self.keys is not None and any(re.match(self.keys, k) for k in keys)


TIMM_FAMILIES: list[TimmFamily] = []


def timm_family(f: TimmFamily) -> TimmFamily:
    """Register a family."""
    TIMM_FAMILIES.append(f)
    return f


for _module in pkgutil.iter_modules([str(Path(__file__).parent)]):
    if _module.name.startswith("timm_"):
        importlib.import_module(f"specvit.interop.{_module.name}")


def _family_of(model: Any) -> TimmFamily:
    name = type(model).__name__
    for f in TIMM_FAMILIES:
        if name in f.classes:
            return f
    known = sorted(c for f in TIMM_FAMILIES for c in f.classes)
    raise SpecError(
        Problem("model", f"specvit has no family for timm's {name}", f"specvit reads {', '.join(known)}")
    )


def _check_modules(model: Any, family: TimmFamily) -> None:
    allowed = family.modules | COMMON_MODULES
    for path, module in model.named_modules():
        name = type(module).__name__
        if path and name not in allowed:
            raise SpecError(
                Problem(
                    f"model.{path}",
                    f"{type(model).__name__} has {path}: {name}, a module specvit does not read",
                    f"specvit reads {type(model).__name__}s built of {', '.join(sorted(allowed))}",
                )
            )


def from_timm(model: Any) -> Spec:
    """The spec of exactly the architecture of a timm model instance.

    Args:
        model: a timm model (``timm.create_model(name, **kwargs)`` or the class built directly), with
            any weights; only its structure and hyper-parameters are read.

    Returns:
        The validated spec; ``build_model(spec)`` loads the model's weights through
        ``convert_state_dict(model.state_dict(), "timm", spec)``.

    Raises:
        SpecError: the model class has no specvit family, or it contains a module or an attribute value
            specvit cannot state; the problem names its path (``model.blocks.0.attn.q_norm``).
    """
    family = _family_of(model)
    _check_modules(model, family)
    data = family.spec(Reader(model))
    return parse_spec(data, source=f"{data['name']} (from a timm {type(model).__name__})")


def timm_layouts(keys: Sequence[str]) -> list[Callable[[Spec, Sequence[str]], Layout]]:
    """The layouts that may name a timm state dict with these keys, most specific first: every family
    whose keys it has (BEiT and EVA share ``q_bias`` and ``gamma_1``), then the default family."""
    found = [f.layout for f in TIMM_FAMILIES if f.reads(keys)]
    return found + [f.layout for f in TIMM_FAMILIES if f.keys is None]
