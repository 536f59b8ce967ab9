"""The interactive diagram (``specvit render SPEC -o model.html``): its data, its layouts, its page (escaped,
self-contained), and the page in a real headless browser: Debian's chromium driven by Playwright, skipped
(with one line) where either is missing."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import specvit
from specvit.diagram import render
from specvit.diagram.html import COMBINED, key, layouts, to_html, variants
from specvit.diagram.viewdata import Run, view_data
from specvit.graph import build_graph
from specvit.units import MACS, format_flops

ROOT = Path(__file__).resolve().parents[1]
VIT = "vit_base_patch16_224"
HOSTILE = "</script><script>alert(1)</script> <img src=x onerror=alert(2)> & \u2028"


def _graph(name: str, **overrides: int) -> specvit.ArchGraph:
    return build_graph(specvit.load_spec(ROOT / "specs" / f"{name}.yaml", overrides=overrides))


def _data(page: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="specvit-data">(.*?)</script>', page, re.S)
    assert found is not None
    return dict(json.loads(found.group(1)))


def _titles(svg: str) -> set[str]:
    return set(re.findall(r"<title>([^<]*)</title>", svg))


def _hostile(tmp_path: Path) -> Path:
    text = (ROOT / "specs" / "mnist_vit.yaml").read_text()
    spec = tmp_path / "hostile.yaml"
    line = f"description: {json.dumps(HOSTILE)}"
    spec.write_text(re.sub(r"^description: .*$", lambda _: line, text, flags=re.M))
    return spec


# ---------------------------------------------------------------------------------------------- data


def test_view_data_holds_each_nodes_figures_settings_and_spec_line() -> None:
    graph = _graph(VIT)
    data = view_data(graph)
    assert data["order"] == list(graph) and set(data["nodes"]) == set(graph)
    path = "encoder.blocks.5.attn"
    attn, node = data["nodes"][path], graph[path]
    assert attn["shape"] == "B x 197 x 768" and attn["inputs"] == {"x": "B x 197 x 768"}
    assert attn["params"] == node["params"] == 2_362_368
    assert attn["flops"] == node["flops"] > 0 and data["unit"]["name"] == "FLOPs"
    assert attn["settings"]["heads"] == 12 and attn["settings"]["dim"] == 768
    at = graph.spec.locate(node["spec_key"])
    assert at is not None and at.line > 0
    assert (attn["source"]["file"], attn["source"]["line"]) == (at.file, at.line)
    assert attn["source"]["text"] == (ROOT / "specs" / f"{VIT}.yaml").read_text().splitlines()[at.line - 1]
    assert attn["run"] == "encoder.blocks.0" and attn["box"] == "encoder.blocks.0.attn"
    assert data["nodes"]["encoder.patch_embed"]["run"] is None
    (group,) = data["groups"]
    assert (group["label"], group["count"], group["reps"]) == (
        "encoder.blocks.0-11",
        12,
        ["encoder.blocks.0"],
    )
    assert group["members"] == [p for p in graph if (graph[p]["block"] or "").startswith("encoder.blocks.")]
    assert data["edges"] == [{"src": u, "dst": v, "port": p} for u, v, p in graph.nx.edges(data="port")]
    macs = view_data(graph, MACS)  # the control: another unit, other numbers under its name
    assert macs["nodes"][path]["flops"] * 2 == attn["flops"] and macs["unit"]["name"] == "MACs"


def test_a_repeated_pattern_is_one_run_with_a_box_per_pattern_block() -> None:
    data = view_data(_graph("swin_tiny_patch4_window7_224"))
    (run,) = [g for g in data["groups"] if g["count"] == 6]
    assert run["reps"] == [run["blocks"][0], run["blocks"][1]]  # plain and shifted windows, x3 each
    assert data["nodes"][run["blocks"][3] + ".attn"]["box"] == run["blocks"][1] + ".attn"


def test_variants_combine_a_few_runs_and_take_each_alone_beyond() -> None:
    few = [Run(f"r{i}", "", (), ()) for i in range(COMBINED)]
    assert len(variants(few)) == 2**COMBINED and ["r0", "r2"] in variants(few)
    many = [Run(f"r{i}", "", (), ()) for i in range(COMBINED + 2)]
    ids = [r.id for r in many]
    assert variants(many) == [[], *([i] for i in ids), ids]


def test_layouts_fold_and_expand_the_run_within_the_limits() -> None:
    graph = _graph(VIT)
    drawn = layouts(graph)
    assert set(drawn.svg) == {"", key(["encoder.blocks.0"])} and drawn.skipped == {}
    folded, expanded = _titles(drawn.svg[""]), _titles(drawn.svg["encoder.blocks.0"])
    assert "encoder.blocks.0.attn" in folded and "encoder.blocks.5.attn" not in folded
    assert {f"encoder.blocks.{i}.attn" for i in range(12)} <= expanded
    assert all(svg.startswith("<svg") for svg in drawn.svg.values())  # no DOCTYPE naming an outside address
    small = layouts(graph, limit=50)  # 12 blocks expanded draw more than 50 boxes
    assert set(small.svg) == {""} and small.skipped == {"encoder.blocks.0": "over 50 boxes"}
    late = layouts(graph, budget=0)  # no time to lay out the expanded picture: the folded one all the same
    assert set(late.svg) == {""} and late.skipped == {"encoder.blocks.0": "not laid out within 0 s"}
    data = _data(to_html(graph, limit=50))
    assert set(data["layouts"]) == {""}
    assert (data["groups"][0]["expandable"], data["groups"][0]["why"]) == (False, "over 50 boxes")


# ---------------------------------------------------------------------------------------------- page


def test_the_page_is_self_contained_and_escapes_the_spec(tmp_path: Path) -> None:
    page = to_html(build_graph(specvit.load_spec(_hostile(tmp_path))))
    assert "alert(1)</script>" not in page and "<img" not in page and "\u2028" not in page
    assert page.count("<script") == 2  # the data and the view's own script, nothing the spec wrote
    assert _data(page)["description"] == HOSTILE  # the text survives, as data
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched from anywhere
    script = re.search(r"<script>(.*?)</script>", page, re.S)
    policy = re.search(r'Content-Security-Policy" content="([^"]*)"', page)
    assert script is not None and policy is not None
    digest = base64.b64encode(hashlib.sha256(script.group(1).encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}';" in policy.group(1) and "default-src 'none'" in policy.group(1)


def test_render_and_the_cli_write_html(tmp_path: Path) -> None:
    out = render(ROOT / "specs" / "mnist_vit.yaml", tmp_path / "m.html", view="expanded")
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert _data(out.read_text())["initial"] == ""  # one block: no run to open expanded
    cli = tmp_path / "t5.html"
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "render", "t5_small", "-o", str(cli), "--view", "expanded"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"wrote {cli}"
    data = _data(cli.read_text())
    assert len(data["groups"]) == 2 and data["initial"] == key([g["id"] for g in data["groups"]])
    assert len(data["layouts"]) == 4  # two runs: each folded or expanded


def test_a_96_block_stack_writes_one_expanded_layout(tmp_path: Path) -> None:
    out = render(_graph(VIT, **{"encoder.depth": 96}), tmp_path / "deep.html")
    data = _data(out.read_text())
    assert data["groups"][0]["count"] == 96 and data["groups"][0]["expandable"]
    assert "encoder.blocks.95.mlp" in _titles(data["layouts"]["encoder.blocks.0"])
    assert out.stat().st_size < 8_000_000


# ------------------------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium: `apt-get install chromium` runs the browser tests")
    sync_api = pytest.importorskip("playwright.sync_api", reason="no playwright: pip install playwright")
    with sync_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium)
        yield launched
        launched.close()


class Page:
    """A page of the browser opened on an HTML file, recording console errors, requests and dialogs."""

    def __init__(self, browser: Any, path: Path):
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.url = path.resolve().as_uri()
        self.page.goto(self.url)
        self.page.wait_for_selector("g.node[data-path]")

    def node(self, path: str) -> Any:
        return self.page.locator(f'g.node[data-path="{path}"]')

    def field(self, name: str) -> str:
        return str(self.page.locator(f'.sv-details [data-field="{name}"]').inner_text())


def test_the_page_loads_expands_and_shows_a_clicked_nodes_details(browser: Any, tmp_path: Path) -> None:
    graph = _graph(VIT)
    view = Page(browser, render(graph, tmp_path / "vit.html"))
    assert view.errors == [] and view.requests == [view.url]
    assert view.node("encoder.blocks.0.attn").count() == 1 and view.node("encoder.blocks.5.attn").count() == 0
    view.page.locator('.sv-run[data-run="encoder.blocks.0"]').click()
    for i in range(12):
        assert view.node(f"encoder.blocks.{i}.attn").count() == 1
    view.node("encoder.blocks.5.attn").click()
    at = graph.spec.locate(graph["encoder.blocks.5.attn"]["spec_key"])
    assert at is not None
    assert view.field("path") == "encoder.blocks.5.attn"
    assert view.field("shape") == "B x 197 x 768"
    assert view.field("params") == "2,362,368 (2.4M)"
    flops = graph["encoder.blocks.5.attn"]["flops"]
    assert view.field("flops") == f"{format_flops(flops)} · {flops:,}"
    assert view.field("source").startswith(f"{at.file}:{at.line}:")
    assert view.field("line") == (ROOT / "specs" / f"{VIT}.yaml").read_text().splitlines()[at.line - 1]
    view.node("encoder.blocks.5.mlp").click()  # the control: another node, its own figures
    assert view.field("path") == "encoder.blocks.5.mlp"
    assert view.field("params") == f"{graph['encoder.blocks.5.mlp']['params']:,} (4.7M)"
    view.node("encoder.blocks.5.norm1").hover()
    assert view.page.locator(".sv-tip").inner_text().startswith("encoder.blocks.5.norm1\n")
    view.page.locator('.sv-run[data-run="encoder.blocks.0"]').click()  # fold it again
    assert view.node("encoder.blocks.5.attn").count() == 0
    view.page.locator("g.node.sv-folded").first.click()  # the folded block's caption expands it too
    assert view.node("encoder.blocks.11.mlp").count() == 1
    assert view.errors == [] and view.requests == [view.url]


def test_the_search_box_finds_a_folded_node_by_path(browser: Any, tmp_path: Path) -> None:
    view = Page(browser, render(_graph(VIT), tmp_path / "vit.html"))
    search = view.page.locator(".sv-search")
    search.fill("blocks.7.ml")
    assert view.page.locator(".sv-result button").all_inner_texts() == ["encoder.blocks.7.mlp mlp"]
    search.press("Enter")
    assert view.field("path") == "encoder.blocks.7.mlp"
    assert "sv-selected" in str(view.node("encoder.blocks.7.mlp").get_attribute("class"))
    assert view.node("encoder.blocks.6.mlp").get_attribute("class") == "node"  # only the one found
    view.page.evaluate(  # what a live editor does with new data: the view keeps its state
        'document.getElementById("specvit-view").specvit.update('
        'JSON.parse(document.getElementById("specvit-data").textContent))'
    )
    assert view.field("path") == "encoder.blocks.7.mlp" and view.node("encoder.blocks.7.mlp").count() == 1
    search.fill("no.such.node")
    assert view.page.locator(".sv-results").inner_text() == "no node has that in its path"
    assert view.errors == []


def test_fit_fills_the_canvas_width(browser: Any, tmp_path: Path) -> None:
    """Graphviz sizes the SVG in pt; "fit" makes its drawn width the canvas's (less the 16 px margin)."""
    view = Page(browser, render(_graph("swin_tiny_patch4_window7_224"), tmp_path / "swin.html"))
    view.page.locator(".sv-zoom button", has_text="fit").click()
    drawn, room = view.page.evaluate(
        "() => [document.querySelector('.sv-canvas svg').getBoundingClientRect().width,"
        " document.querySelector('.sv-canvas').clientWidth - 16]"
    )
    assert abs(drawn - room) < 1.0, (drawn, room)
    view.page.locator(".sv-zoom button", has_text="100%").click()  # the control: actual size is not the fit
    drawn = view.page.evaluate("() => document.querySelector('.sv-canvas svg').getBoundingClientRect().width")
    assert abs(drawn - room) > 10, (drawn, room)


def test_a_hostile_description_is_shown_as_text(browser: Any, tmp_path: Path) -> None:
    out = tmp_path / "hostile.html"
    render(_hostile(tmp_path), out)
    view = Page(browser, out)
    assert view.page.locator(".sv-description").text_content() == HOSTILE
    assert view.dialogs == [] and view.errors == [] and view.requests == [view.url]


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted((ROOT / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_preset_loads_and_each_run_expands_without_errors(
    browser: Any, preset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "model.html"
    out.write_text(to_html(build_graph(specvit.load_spec(preset)), budget=10))
    view = Page(browser, out)
    data = _data(out.read_text())
    for group in data["groups"]:
        if group["expandable"]:
            view.page.locator(f'.sv-run[data-run="{group["id"]}"]').click()
            assert view.node(group["members"][-1]).count() == 1
            view.page.locator(f'.sv-run[data-run="{group["id"]}"]').click()
    view.node(data["order"][-1]).click()
    assert view.field("path") == data["order"][-1]
    assert view.errors == [] and view.requests == [view.url]
