"""A diagram held in memory, for notebooks: ``specvit.render(spec)`` without a path displays inline."""

from __future__ import annotations

import os
from pathlib import Path

from specvit.diagram.graphviz import ENGINE_FORMATS, Direction, RenderError, View, _engine, draw_dot
from specvit.diagram.html import to_html
from specvit.diagram.mermaid import to_mermaid
from specvit.graph.ir import ArchGraph
from specvit.io import atomic_write
from specvit.units import FLOPS, FlopUnit

__all__ = ["Diagram"]


class Diagram:
    """A model's diagram: Jupyter and IPython show it as SVG (``_repr_svg_``) or PNG (``_repr_png_``, for
    front ends and exports that take no SVG); ``save`` writes a file.

    Args:
        graph: the lowered model.
        dot: the Graphviz source of the diagram.
        view: the view it was drawn in (``collapsed`` or ``expanded``), for :meth:`save`.
        direction: ``TB`` or ``LR``, for :meth:`save`.
        unit: what FLOPs are printed in, for :attr:`mermaid`.
        plumbing: whether the run-time plumbing is drawn, for :attr:`mermaid`.
    """

    def __init__(
        self,
        graph: ArchGraph,
        dot: str,
        view: View,
        direction: Direction,
        unit: FlopUnit = FLOPS,
        *,
        plumbing: bool = False,
    ):
        self.graph = graph
        self.dot = dot
        self.view = view
        self.direction = direction
        self.unit = unit
        self.plumbing = plumbing
        self._svg: str | None = None
        self._png: bytes | None = None

    def _draw(self, fmt: str) -> bytes:
        """The diagram laid out by Graphviz in ``fmt``."""
        engine = _engine()
        if engine is None:
            raise RenderError(
                "no Graphviz to lay out the diagram: install pygraphviz (its wheel bundles Graphviz) "
                "or Graphviz; Diagram.dot and Diagram.mermaid hold the sources meanwhile"
            )
        return engine(self.dot, fmt)

    @property
    def svg(self) -> str:
        """The diagram as SVG text, laid out by Graphviz on first use.

        Raises:
            RenderError: when neither pygraphviz nor the system ``dot`` is available.
        """
        if self._svg is None:
            self._svg = self._draw("svg").decode("utf-8")
        return self._svg

    @property
    def png(self) -> bytes:
        """The diagram as PNG bytes (96 dpi), laid out by Graphviz on first use.

        Raises:
            RenderError: when neither pygraphviz nor the system ``dot`` is available.
        """
        if self._png is None:
            self._png = self._draw("png")
        return self._png

    @property
    def mermaid(self) -> str:
        """The diagram as a Mermaid flowchart (for Markdown pages)."""
        return to_mermaid(self.graph, self.view, self.direction, self.unit, plumbing=self.plumbing)

    def _repr_svg_(self) -> str | None:
        """What Jupyter displays; None (so the text repr is shown) where Graphviz is missing."""
        try:
            return self.svg
        except RenderError:
            return None

    def _repr_png_(self) -> bytes | None:
        """The PNG Jupyter keeps beside the SVG (nbconvert to PDF, viewers without SVG); None where Graphviz
        is missing."""
        try:
            return self.png
        except RenderError:
            return None

    def __repr__(self) -> str:
        g = self.graph
        return f"<specvit Diagram of {g.name}: {len(g)} nodes, {self.view} view; .save(path) writes it>"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the diagram, as :func:`specvit.render` with a path does (svg, png, pdf, dot, mmd, html).

        Args:
            path: the file; its extension picks the format.
        """
        target = Path(path)
        suffix = target.suffix.lower()
        if suffix == ".mmd":
            atomic_write(target, self.mermaid)
        elif suffix == ".dot":
            atomic_write(target, self.dot)
        elif suffix == ".html":
            atomic_write(target, to_html(self.graph, self.view, self.direction, self.unit))
        elif suffix in ENGINE_FORMATS:
            draw_dot(self.dot, target)
        else:
            formats = ", ".join([*ENGINE_FORMATS, ".dot", ".mmd", ".html"])
            raise RenderError(f"cannot write {target}: the extension must be one of {formats}")
        return target
