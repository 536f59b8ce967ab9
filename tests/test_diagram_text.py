"""Labels fit their boxes: in Graphviz's own SVG, measured with the metrics of the font it names (DejaVu
Sans, which fontconfig gives Graphviz's Pango and librsvg alike), and drawn by a second renderer, librsvg's
``rsvg-convert``, where it is installed (Debian: ``apt-get install librsvg2-bin``).

Pango, in the Graphviz pygraphviz bundles, measures text with each glyph's advance rounded to whole pixels;
at 10 points that makes long labels up to 4.5% narrower than other renderers draw them, and they overflow
their boxes. The controls draw at 10 points and must find the overflow."""

from __future__ import annotations

import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from specvit.diagram import graphviz as gv
from specvit.diagram import render

ImageFont = pytest.importorskip("PIL.ImageFont")

ROOT = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
Box = tuple[float, float, float, float]


@cache
def _font(weight: str) -> Any:
    """DejaVu Sans (``book`` or ``bold``) as fontconfig finds it, at 1000 units per em."""
    found = (
        shutil.which("fc-match")
        and subprocess.run(
            ["fc-match", "-f", "%{file}", f"DejaVu Sans:{weight}"], capture_output=True, text=True
        ).stdout
    )
    if not found or "DejaVuSans" not in found:
        pytest.skip("DejaVu Sans is not installed: Graphviz measured the labels with another font")
    return ImageFont.truetype(found, 1000)


def _width(text: str, size: float, bold: bool) -> float:
    """The width of ``text`` at ``size`` points, as a renderer placing glyphs at their advances draws it."""
    return float(_font("bold" if bold else "book").getlength(text)) * size / 1000


def _bbox(el: ET.Element) -> Box:
    if el.tag == SVG + "ellipse":
        cx, cy, rx, ry = (float(el.get(k, "0")) for k in ("cx", "cy", "rx", "ry"))
        return cx - rx, cy - ry, cx + rx, cy + ry
    pts = [float(v) for v in NUMBER.findall(el.get("points") or el.get("d") or "")]
    return min(pts[0::2]), min(pts[1::2]), max(pts[0::2]), max(pts[1::2])


def _boxes_and_texts(svg: str) -> tuple[list[Box], list[Box], list[tuple[ET.Element, Box]]]:
    """The drawn boxes (nodes and legend swatches), every enclosing shape (clusters and the page too), and
    each text with its extent (x0, y0, x1, y1) at DejaVu Sans's metrics."""
    root = ET.fromstring(svg)
    boxes: list[Box] = []
    shapes: list[Box] = []
    texts: list[tuple[ET.Element, Box]] = []
    for g in root.iter(SVG + "g"):
        kind = g.get("class")
        if kind not in ("node", "cluster", "graph"):
            continue
        for el in list(g) if kind == "graph" else g.iter():
            if el.tag in (SVG + "path", SVG + "polygon", SVG + "ellipse"):
                filled = el.get("fill") not in (None, "none")
                if kind != "graph" or filled:
                    shapes.append(_bbox(el))
                if filled and (kind == "node" or (kind == "graph" and el.get("fill") != "white")):
                    boxes.append(_bbox(el))
            elif el.tag == SVG + "text":
                x, y, size = float(el.get("x", "0")), float(el.get("y", "0")), float(el.get("font-size", "0"))
                w = _width(el.text or "", size, el.get("font-weight") == "bold")
                x0 = x - w / 2 if el.get("text-anchor") == "middle" else x
                texts.append((el, (x0, y - size * 0.75, x0 + w, y)))
    return boxes, shapes, texts


def overflows(svg: str) -> list[str]:
    """Each text running past the left or right side of the smallest shape around it (its node's box, a
    legend swatch, a cluster, the page), with by how much."""
    _, shapes, texts = _boxes_and_texts(svg)
    out = []
    for el, (x0, y0, x1, y1) in texts:
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        around = [s for s in shapes if s[0] <= cx <= s[2] and s[1] <= cy <= s[3]]
        s = min(around, key=lambda s: (s[2] - s[0]) * (s[3] - s[1]), default=None)
        if s is None or x0 < s[0] - 0.05 or x1 > s[2] + 0.05:
            out.append(
                f"{el.text!r} spans {x0:.1f}..{x1:.1f}, its shape {s and (round(s[0], 1), round(s[2], 1))}"
            )
    return out


SPECS = ["deberta_v3_base", "t5_small", "pvt_v2_b0", "swinv2_tiny_window16_256", "mnist_vit"]
"""Models with the longest labels of the presets (DeBERTa's disentangled attention, T5's buckets, PVT's
reduced keys, Swin-V2's CPB), a model of stages, and a small one."""


@pytest.mark.parametrize("direction", ["TB", "LR"])
@pytest.mark.parametrize("spec", SPECS)
def test_labels_fit_their_boxes_in_graphvizs_svg(spec: str, direction: str, tmp_path: Path) -> None:
    svg = render(spec, tmp_path / "m.svg", direction=direction).read_text()
    assert 'font-family="DejaVu Sans,' in svg
    assert overflows(svg) == []


def test_at_10_points_pango_measures_long_labels_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: the size the diagrams used to draw at overflows, by the same check."""
    monkeypatch.setattr(gv, "TEXT", "10")
    found = overflows(render("deberta_v3_base", tmp_path / "m.svg").read_text())
    assert any("content→position and position→content scores" in line for line in found)


def _ink_beside_boxes(svg: Path, tmp_path: Path) -> list[Box]:
    """The boxes of ``svg`` beside which librsvg draws text: the text alone is rendered (every shape removed),
    at 2 px a point, and a strip 1 to 3 points outside each side of each box must stay blank."""
    from PIL import Image

    text = svg.read_text()
    boxes, _, _ = _boxes_and_texts(text)
    only_text = re.sub(r"<(path|polygon|polyline|ellipse)\b[^>]*/>", "", text)
    (tmp_path / "text.svg").write_text(only_text)
    png = tmp_path / "text.png"
    subprocess.run(
        ["rsvg-convert", "-d", "72", "-p", "72", "-z", "2", str(tmp_path / "text.svg"), "-o", str(png)],
        check=True,
    )
    shift = re.search(
        r'class="graph" transform="scale\(1 1\) rotate\(0\) translate\(([\d.]+) ([\d.]+)\)"', text
    )
    assert shift is not None
    dx, dy = float(shift[1]), float(shift[2])
    alpha = Image.open(png).getchannel("A")
    bad = []
    for x0, y0, x1, y1 in boxes:
        rows = range(round((y0 + dy + 1) * 2), round((y1 + dy - 1) * 2))
        for a, b in ((x0 - 3, x0 - 1), (x1 + 1, x1 + 3)):
            strip = alpha.crop((round((a + dx) * 2), rows.start, round((b + dx) * 2), rows.stop))
            if strip.getextrema()[1] > 96:
                bad.append((x0, y0, x1, y1))
    return bad


@pytest.mark.skipif(shutil.which("rsvg-convert") is None, reason="librsvg's rsvg-convert is not installed")
def test_labels_fit_their_boxes_drawn_by_librsvg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = render("deberta_v3_base", tmp_path / "m.svg")
    assert len(_boxes_and_texts(drawn.read_text())[0]) > 10
    assert _ink_beside_boxes(drawn, tmp_path) == []
    monkeypatch.setattr(gv, "TEXT", "10")  # the control: drawn at 10 points, long labels leave their boxes
    assert _ink_beside_boxes(render("deberta_v3_base", tmp_path / "m10.svg"), tmp_path) != []
