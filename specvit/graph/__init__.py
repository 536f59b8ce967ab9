"""The architecture graph: lowering, the IR and its verifier."""

from specvit.graph.ir import ArchGraph, SummaryRow
from specvit.graph.lower import build_graph
from specvit.graph.verify import verify

__all__ = ["ArchGraph", "SummaryRow", "build_graph", "verify"]
