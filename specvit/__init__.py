"""specvit: a declarative architecture-spec compiler for attention models.

YAML spec -> validated :class:`Spec` -> :class:`ArchGraph` -> diagram, summary and ``nn.Module``.
``import specvit`` imports neither torch nor networkx: the names that need them (``build_graph``,
``build_model``, ``optimize``, ``export_onnx``, ``SpecModel``, ``render``...) load on first use, so
validation stays fast. Every public name is a function or class here, never a submodule of the same name
(``tests/test_api.py``).

``import specvit`` also installs :func:`specvit.interop.compat.torchvision_ops`, so that timm and
transformers, imported after it, import on a CPU-only torch whose torchvision C++ ops do not load. It is
safe to do on import: the hook imports nothing until torchvision is imported, and then only defines two
operator schemas torchvision needs and failed to load (a working torchvision is never touched).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from specvit.errors import Location, Problem, SpecError
from specvit.interop.compat import torchvision_ops

torchvision_ops()

__all__ = [
    "ArchGraph",
    "CheckpointError",
    "Location",
    "Problem",
    "Spec",
    "SpecError",
    "SpecModel",
    "__version__",
    "build_graph",
    "build_model",
    "convert_state_dict",
    "eject",
    "example_inputs",
    "export_onnx",
    "export_program",
    "from_hf",
    "from_pretrained",
    "from_timm",
    "load_pretrained",
    "load_spec",
    "optimize",
    "parse_spec",
    "render",
    "save_pretrained",
    "to_dot",
    "to_hf",
    "to_mermaid",
]
__version__ = "0.1.0"

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
    from specvit.checkpoint import CheckpointError, save_pretrained
    from specvit.compile import build_graph, build_model, eject, load_pretrained
    from specvit.convert import convert_state_dict
    from specvit.diagram import render, to_dot, to_mermaid
    from specvit.export import example_inputs, export_onnx, export_program
    from specvit.graph import ArchGraph
    from specvit.inference import optimize
    from specvit.interop.hf import from_hf
    from specvit.interop.timm import from_timm
    from specvit.interop.to_hf import to_hf
    from specvit.model import SpecModel
    from specvit.pretrained import from_pretrained
    from specvit.spec import Spec, load_spec, parse_spec

_LAZY = {
    "Spec": "specvit.spec",
    "load_spec": "specvit.spec",
    "parse_spec": "specvit.spec",
    "ArchGraph": "specvit.graph",
    "build_graph": "specvit.compile",  # takes mappings and preset names too; specvit.graph's takes a Spec
    "build_model": "specvit.compile",
    "eject": "specvit.compile",
    "load_pretrained": "specvit.compile",
    "CheckpointError": "specvit.checkpoint",
    "save_pretrained": "specvit.checkpoint",
    "convert_state_dict": "specvit.convert",
    "from_hf": "specvit.interop.hf",
    "from_timm": "specvit.interop.timm",
    "to_hf": "specvit.interop.to_hf",
    "from_pretrained": "specvit.pretrained",  # model directories, Hub ids, timm names with weights
    "SpecModel": "specvit.model",
    "render": "specvit.diagram",  # the function; the package is specvit.diagram
    "to_dot": "specvit.diagram",
    "to_mermaid": "specvit.diagram",
    "optimize": "specvit.inference",
    "example_inputs": "specvit.export",
    "export_onnx": "specvit.export",
    "export_program": "specvit.export",
}


def __getattr__(name: str) -> Any:
    """The lazy public names, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specvit' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the lazy ones, for completion in shells and notebooks."""
    return sorted(set(globals()) | set(__all__))
