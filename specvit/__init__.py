"""specvit: a declarative architecture-spec compiler for attention models.

YAML spec -> validated :class:`Spec` -> :class:`ArchGraph` -> diagram, summary and ``nn.Module``.
``import specvit`` imports neither torch nor networkx: the names that need them (``build_graph``,
``build_model``, ``load_pretrained``, ``convert_state_dict``, ``SpecModel``, ``render``) load on first use,
so validation stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from specvit.errors import Location, Problem, SpecError

__all__ = [
    "ArchGraph",
    "CheckpointError",
    "Location",
    "Problem",
    "Spec",
    "SpecError",
    "SpecModel",
    "build_graph",
    "build_model",
    "convert_state_dict",
    "eject",
    "from_hf",
    "load_pretrained",
    "load_spec",
    "parse_spec",
    "render",
]
__version__ = "0.1.0"

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
    from specvit.checkpoint import CheckpointError
    from specvit.compile import build_model, eject, load_pretrained
    from specvit.convert import convert_state_dict
    from specvit.diagram import render
    from specvit.graph import ArchGraph, build_graph
    from specvit.interop.hf import from_hf
    from specvit.model import SpecModel
    from specvit.spec import Spec, load_spec, parse_spec

_LAZY = {
    "Spec": "specvit.spec",
    "load_spec": "specvit.spec",
    "parse_spec": "specvit.spec",
    "ArchGraph": "specvit.graph",
    "build_graph": "specvit.graph",
    "build_model": "specvit.compile",
    "eject": "specvit.compile",
    "load_pretrained": "specvit.compile",
    "CheckpointError": "specvit.checkpoint",
    "convert_state_dict": "specvit.convert",
    "from_hf": "specvit.interop.hf",
    "SpecModel": "specvit.model",
    "render": "specvit.diagram",  # the function; the package is specvit.diagram
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specvit' has no attribute {name!r}")
