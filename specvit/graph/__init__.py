"""The architecture graph: the IR (:mod:`~specvit.graph.ir`), its verifier, and the lowering of specs into it.

``build_graph`` and ``graph_of`` (the lowering, which reads specs) load on first use, so the compiler can
import the IR without importing the spec language.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from specvit.graph.ir import ArchGraph, SummaryRow
from specvit.graph.verify import verify

if TYPE_CHECKING:
    from specvit.graph.lower import build_graph, graph_of

__all__ = ["ArchGraph", "SummaryRow", "build_graph", "graph_of", "verify"]


def __getattr__(name: str) -> Any:
    if name in ("build_graph", "graph_of"):
        return getattr(importlib.import_module("specvit.graph.lower"), name)
    raise AttributeError(f"module 'specvit.graph' has no attribute {name!r}")
