"""timm and transformers importable on a CPU-only torch whose torchvision C++ ops do not load.

PyPI's torchvision wheel is a CUDA build; with the CPU-only torch wheel its ``_C`` extension fails to load,
and torchvision then fails at import, in ``torchvision/_meta_registrations.py``, registering fake kernels
for ``torchvision::nms`` and ``torchvision::qnms``, two operators only ``_C`` defines: "operator
torchvision::nms does not exist". timm imports torchvision, and so do many transformers classes
(``LlamaForCausalLM`` included), so neither imports.

:func:`torchvision_ops` makes them import: at the moment torchvision imports ``_meta_registrations``
(after it has tried to load ``_C``), it defines the schemas of those two operators if, and only if, they
are missing. Nothing else changes: a torchvision whose ops load is never touched, and the two operators
get no kernel, so calling ``torchvision.ops.nms`` still raises torchvision's own "Couldn't load custom C++
ops". ``import specvit`` calls it: it imports nothing (torch included) until torchvision is imported, so
a user's script works when it imports specvit before timm or transformers.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

__all__ = ["SCHEMAS", "defined_ops", "torchvision_ops"]

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
"""The operators torchvision's Python side registers fake kernels for, as its ``_C`` defines them."""

_TRIGGER = "torchvision._meta_registrations"
"""Imported by ``torchvision/__init__.py`` right after ``torchvision.extension`` has tried to load ``_C``."""

_LIBRARIES: list[Any] = []  # a torch.library.Library drops its definitions when it is garbage-collected
_DEFINED: list[str] = []


def _define_missing() -> list[str]:
    """Define those of the :data:`SCHEMAS` that no library defines in the ``torchvision`` namespace.

    Returns:
        The names of the operators defined: none when torchvision's ``_C`` loaded.
    """
    import torch

    missing = []
    for schema in SCHEMAS:
        name = schema.partition("(")[0]
        try:
            getattr(torch.ops.torchvision, name)
        except (AttributeError, RuntimeError):  # torch raises either, by version
            missing.append(schema)
    if missing:
        library = torch.library.Library("torchvision", "FRAGMENT")
        for schema in missing:
            library.define(schema)
        _LIBRARIES.append(library)
        _DEFINED.extend(f"torchvision::{schema.partition('(')[0]}" for schema in missing)
    return [schema.partition("(")[0] for schema in missing]


class _BeforeMetaRegistrations:
    """A finder that finds nothing: asked for :data:`_TRIGGER`, it defines the missing schemas first. (A
    meta path finder needs only ``find_spec``; subclassing ``importlib.abc.MetaPathFinder`` would import
    ``importlib.resources`` into every ``import specvit``.)"""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """Define the schemas when torchvision is about to register kernels for them; find nothing.

        Args:
            fullname: the module being imported.
            path: the parent package's ``__path__`` (unused).
            target: the module being reloaded, if any (unused).
        """
        if fullname == _TRIGGER:
            _define_missing()
        return None


_FINDER = _BeforeMetaRegistrations()


def torchvision_ops() -> None:
    """Let ``import timm`` and ``import transformers`` work where torchvision's C++ ops do not load.

    Installs (once) an import hook that defines the two operator schemas torchvision's import needs when
    its ``_C`` extension has failed to load; see the module's docstring. Cheap: imports nothing until
    torchvision is imported. Call it before the first ``import timm`` / ``import transformers`` (``import
    specvit`` does). If torchvision was imported already, this changes nothing.
    """
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def defined_ops() -> list[str]:
    """The operators the hook defined in this process, ``["torchvision::nms", "torchvision::qnms"]``; empty
    when torchvision's own ops loaded, or torchvision has not been imported since the hook was installed."""
    return list(_DEFINED)
