"""specvit: a declarative architecture-spec compiler for attention models.

YAML spec -> validated :class:`Spec` -> :class:`ArchGraph` -> diagram, summary and ``nn.Module``.
Importing specvit does not import torch; only building a model does.
"""

from specvit.errors import Location, Problem, SpecError
from specvit.graph import ArchGraph, build_graph
from specvit.spec import Spec, load_spec, parse_spec

__all__ = ["ArchGraph", "Location", "Problem", "Spec", "SpecError", "build_graph", "load_spec", "parse_spec"]
__version__ = "0.1.0"
