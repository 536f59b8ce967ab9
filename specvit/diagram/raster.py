"""The size of a PNG before it is drawn: dpi x layout, bounded in pixels.

Graphviz draws a PNG into a cairo surface of 4 bytes a pixel, held whole in memory. The pixels are the
layout's size in inches times the dpi, squared in effect: ``render --dpi 2400`` of a small ViT diagram
asks for about 600 million pixels (2.5 GB, 40 s), and a side over cairo's 32,767 pixels is silently
shrunk to fit, so the image would not have the resolution asked for either. :func:`check_raster` lays
the diagram out (Graphviz's ``plain`` output: the size in inches, no pixels drawn) and refuses a raster
over :data:`MAX_PIXELS` or :data:`MAX_SIDE`, naming the largest dpi that fits.
"""

from __future__ import annotations

import math
import os

__all__ = ["MAX_PIXELS", "MAX_SIDE", "check_raster", "layout_inches", "raster_pixels"]

MAX_PIXELS = 100_000_000
"""The most pixels a PNG may have: 10,000 x 10,000, 400 MB while Graphviz draws it (a few seconds)."""

MAX_SIDE = 32_767
"""cairo's largest side in pixels: Graphviz shrinks a larger image to fit, losing the dpi asked for."""

PAD_INCHES = 4 / 72
"""Graphviz's default ``pad`` around the drawing (4 points), on each side of the image."""


def layout_inches(dot: str) -> tuple[float, float]:
    """The width and height in inches of ``dot`` laid out by Graphviz, without drawing it.

    Args:
        dot: DOT text.

    Raises:
        RenderError: when Graphviz is missing or fails.
    """
    from specvit.diagram.graphviz import RenderError, _engine

    engine = _engine()
    if engine is None:
        raise RenderError("no Graphviz to lay out the diagram (install pygraphviz or Graphviz)")
    try:
        first = engine(dot, "plain").split(b"\n", 1)[0].split()
    except Exception as exc:
        raise RenderError(f"Graphviz failed to lay out the diagram: {exc}") from exc
    if len(first) != 4 or first[0] != b"graph":  # plain output starts "graph SCALE WIDTH HEIGHT"
        raise RenderError(f"Graphviz's layout gave an unexpected first line: {first!r:.80}")
    scale, width, height = (float(v) for v in first[1:])
    return width * scale, height * scale


def raster_pixels(inches: tuple[float, float], dpi: int) -> tuple[int, int]:
    """The width and height in pixels of a layout of ``inches`` drawn at ``dpi``, padding included.

    Args:
        inches: the layout's width and height in inches (:func:`layout_inches`).
        dpi: dots per inch.
    """
    width, height = inches
    return (math.ceil((width + 2 * PAD_INCHES) * dpi), math.ceil((height + 2 * PAD_INCHES) * dpi))


def _fitting_dpi(inches: tuple[float, float]) -> int:
    """The largest dpi whose raster of a layout of ``inches`` is within both bounds."""
    width, height = (v + 2 * PAD_INCHES for v in inches)
    dpi = math.floor(min(math.sqrt(MAX_PIXELS / (width * height)), MAX_SIDE / max(width, height)))
    while dpi > 1 and (  # rounding up of the sides: step down until it fits
        math.prod(raster_pixels(inches, dpi)) > MAX_PIXELS or max(raster_pixels(inches, dpi)) > MAX_SIDE
    ):
        dpi -= 1
    return max(dpi, 1)


def check_raster(dot: str, dpi: int, target: str | os.PathLike[str]) -> tuple[int, int]:
    """Refuse to draw ``dot`` at ``dpi`` into a PNG of more than :data:`MAX_PIXELS` pixels or a side over
    :data:`MAX_SIDE`, before a pixel is drawn; the message names the bound and the largest dpi that fits.

    Args:
        dot: the diagram's DOT text.
        dpi: the resolution asked for.
        target: the PNG file, for the message.

    Returns:
        The width and height in pixels the PNG will have.

    Raises:
        RenderError: the raster is over a bound, or Graphviz cannot lay the diagram out.
    """
    from specvit.diagram.graphviz import RenderError

    inches = layout_inches(dot)
    width, height = raster_pixels(inches, dpi)
    if width * height <= MAX_PIXELS and max(width, height) <= MAX_SIDE:
        return width, height
    bound = (
        f"over the limit of {MAX_PIXELS:,} pixels (Graphviz holds 4 bytes a pixel while it draws: "
        f"{4 * width * height / 1e9:.1f} GB)"
        if width * height > MAX_PIXELS
        else f"a side over {MAX_SIDE:,} pixels, the most cairo draws (Graphviz would shrink the image)"
    )
    raise RenderError(
        f"cannot draw {os.fspath(target)} at {dpi} dpi: the diagram is {inches[0]:.1f} x {inches[1]:.1f} "
        f"inches, {width:,} x {height:,} pixels, {bound}; use --dpi {_fitting_dpi(inches)} or less, or "
        "write .svg or .pdf, which scale to any size"
    )
