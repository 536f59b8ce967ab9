"""What the page asks of a spec's text: its problems, or its diagram data and summary; the diagram's other
layouts; a diff; the files to download.

The text is never executed: it is read as plain YAML and validated (:func:`~specvit.spec.loader.load_text`,
with every ``extends`` base inside the served folder or a bundled preset), then lowered into the graph,
which needs no torch. The same bounds hold as for the command line: the spec's size, nesting and values,
its depth and widths (the schema's limits), and the time laying out the expanded pictures may take
(:data:`~specvit.diagram.html.BUDGET`). One spec is lowered at a time, and a check overtaken by a newer
one of the same file before its turn comes is answered ``stale`` without being done, as is a request for
the expanded layouts overtaken by a newer one, so typing fast queues no work. Layouts are cached by what they draw: the folded picture by its DOT text, the expanded
ones by the graph's signature (every node's path, op, label and shape, and the edges).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from specvit.errors import Problem, SpecError
from specvit.serve.workspace import Refused, Workspace, utf8

__all__ = ["FORMATS", "Analyst", "problem_json"]

FORMATS = {
    "svg": ("image/svg+xml", ".svg"),
    "png": ("image/png", ".png"),
    "html": ("text/html; charset=utf-8", ".html"),
    "py": ("text/x-python; charset=utf-8", ".py"),
}
"""The downloads: the diagram (svg, png, the interactive html) and the ejected PyTorch file."""


def problem_json(p: Problem, name: str) -> dict[str, Any]:
    """One problem as the page shows it: where (``here``: in the edited file), key, message and fix.

    Args:
        p: the problem.
        name: the edited file's name, as its problems are located.
    """
    loc = p.location
    return {
        "file": loc.file if loc else "",
        "line": loc.line if loc else 0,
        "col": loc.col if loc else 0,
        "here": bool(loc and loc.file == name),
        "path": p.path,
        "message": p.message,
        "hint": p.hint,
        "text": str(p),
    }


class _Cache(OrderedDict[str, Any]):
    """A small least-recently-used cache."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_(self, key: str) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        return None

    def put(self, key: str, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def _key(name: str, text: str) -> str:
    return hashlib.sha256(f"{name}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()


def _memo(graph: Any) -> Any:
    """``graph`` with its :meth:`~specvit.graph.ir.ArchGraph.fold` computed once: the view's data, its folded
    picture and the summary each ask for it (twice, some), and for a 96-layer spec each asking costs as much
    as lowering it."""
    from specvit.graph.ir import ArchGraph

    class Folded(ArchGraph):
        def __init__(self, graph: ArchGraph):
            self.__dict__.update(graph.__dict__)
            self._folded = graph.fold()

        def fold(self) -> dict[str, Any]:
            return dict(self._folded)

    return Folded(graph)


def _signature(data: dict[str, Any]) -> str:
    """What the pictures of a view depend on, hashed: each node's path, op, kind, label and shape, the edges
    and the runs."""
    nodes = [(p, n["op"], n["kind"], n["label"], n["shape"], n["box"]) for p, n in data["nodes"].items()]
    groups = [(g["id"], g["blocks"], g["reps"]) for g in data["groups"]]
    text = json.dumps([data["title"], data["subtitle"], nodes, data["edges"], groups], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Analyst:
    """Answers the page's questions about a spec's text, one lowering at a time.

    Args:
        workspace: the served folder.
    """

    def __init__(self, workspace: Workspace):
        self.workspace = workspace
        self._lower = threading.Lock()
        self._draw = threading.Lock()
        self._latest: dict[str, int] = {}  # file -> the newest check's ticket
        self._drawing: dict[str, int] = {}  # file -> the newest layout request's ticket
        self._folded = _Cache(64)  # DOT text hash -> SVG
        self._full = _Cache(16)  # signature -> Pictures
        self._graphs = _Cache(4)  # signature -> the graph a check lowered
        self._specs = _Cache(8)  # (name, text) hash -> the spec a validation found valid

    def spec(self, name: Any, text: Any) -> Any:
        """The validated spec of ``text`` saved as ``name`` (SpecError with every problem).

        Args:
            name: the file's name in the folder.
            text: its text (possibly unsaved).
        """
        from specvit.spec.loader import load_text

        path = self.workspace.path(name, exists=False)
        return load_text(utf8(text), path, shown=name, within=self.workspace.root)

    def validate(self, name: Any, text: Any) -> dict[str, Any]:
        """The problems of ``text`` only (no lowering): what the editor marks, at once.

        It takes no lock, so a lowering under way does not delay it; the spec is kept for the check of the
        same text that follows.

        Args:
            name: the file's name in the folder.
            text: the editor's text.
        """
        start = time.perf_counter()
        try:
            spec = self.spec(name, text)
        except SpecError as exc:
            problems = [problem_json(p, name) for p in exc.problems]
        else:
            problems = []
            self._specs.put(_key(name, text), spec)
        ms = round((time.perf_counter() - start) * 1000, 1)
        return {"ok": not problems, "problems": problems, "timings": {"validate": ms}}

    def check(self, name: Any, text: Any) -> dict[str, Any]:
        """The problems of ``text``, or its view data (with the folded picture), summary and timings.

        Args:
            name: the file's name in the folder.
            text: the editor's text.
        """
        self.workspace.path(name, exists=False)  # a bad name or text is refused before any work
        utf8(text)
        ticket = self._latest[name] = self._latest.get(name, 0) + 1
        with self._lower:
            if self._latest.get(name) != ticket:
                return {"stale": True}
            return self._check(name, text)

    def _check(self, name: str, text: str) -> dict[str, Any]:
        from specvit.graph import build_graph

        times: dict[str, float] = {}
        start = time.perf_counter()
        try:
            spec = self._specs.pop(_key(name, text), None) or self.spec(name, text)  # used once: bases change
            times["validate"] = time.perf_counter() - start
            graph = _memo(build_graph(spec))
        except SpecError as exc:
            return {"ok": False, "problems": [problem_json(p, name) for p in exc.problems]}
        except Exception as exc:  # a bug of specvit's: said on the page, and the server goes on
            message = f"specvit failed on this spec ({type(exc).__name__}: {exc})"
            return {"ok": False, "problems": [_bug(name, message)]}
        times["lower"] = time.perf_counter() - start - times["validate"]
        out = {"ok": True, "problems": [], **self._view(graph, name, text, times)}
        out["summary"] = _summary(graph)
        times["total"] = time.perf_counter() - start
        out["timings"] = {k: round(v * 1000, 1) for k, v in times.items()}
        return out

    def _view(self, graph: Any, name: str, text: str, times: dict[str, float]) -> dict[str, Any]:
        from specvit.diagram.graphviz import RenderError
        from specvit.diagram.html import draw_svg, folded_dot, folded_scene
        from specvit.diagram.viewdata import view_data

        t = time.perf_counter()
        scene = folded_scene(graph)
        data = view_data(graph, scene=scene)
        lines = text.splitlines()
        for node in data["nodes"].values():  # the editor's line, not the file's on disk
            s = node["source"]
            if s and s["file"] == name:
                s["text"] = lines[s["line"] - 1] if 0 < s["line"] <= len(lines) else None
        signature = _signature(data)
        self._graphs.put(signature, graph)  # for the layouts the page asks for next
        times["view"] = time.perf_counter() - t
        t = time.perf_counter()
        full = self._full.get_(signature)
        error = ""
        if full is not None:
            _pictures(data, full)
        else:
            dot = folded_dot(scene)
            digest = hashlib.sha256(dot.encode()).hexdigest()
            svg = self._folded.get_(digest)
            try:
                if svg is None:
                    svg = draw_svg(dot)
                    self._folded.put(digest, svg)
                data["layouts"] = {"": svg}
            except RenderError as exc:
                data["layouts"], error = {}, str(exc)
            for group in data["groups"]:
                group["expandable"], group["why"] = False, "being laid out"
        times["layout"] = time.perf_counter() - t
        return {"data": data, "signature": signature, "complete": full is not None, "diagram_error": error}

    def layouts(self, name: Any, text: Any, signature: Any = None) -> dict[str, Any]:
        """Every laid-out state of the view of ``text`` (:func:`~specvit.diagram.html.layouts`), cached.

        Args:
            name: the file's name in the folder.
            text: the editor's text.
            signature: the signature a check gave for it: its graph is reused, not lowered again.
        """
        from specvit.diagram.html import layouts
        from specvit.diagram.viewdata import view_data
        from specvit.graph import build_graph

        self.workspace.path(name, exists=False)
        ticket = self._drawing[name] = self._drawing.get(name, 0) + 1
        graph = self._graphs.get_(signature) if isinstance(signature, str) else None
        if graph is None:
            with self._lower:
                try:
                    graph = _memo(build_graph(self.spec(name, text)))
                except SpecError:
                    return {"ok": False}
                signature = _signature(view_data(graph))
        with self._draw:  # one layout job at a time; a second asking for the same waits for the first
            full = self._full.get_(signature)
            if full is None and self._drawing.get(name) != ticket:  # the text changed meanwhile
                return {"ok": False, "stale": True}
            if full is None:
                full = layouts(graph)
                self._full.put(signature, full)
        groups = [{"id": r.id} for r in _runs(graph)]
        data = {"groups": groups}
        _pictures(data, full)
        return {"ok": True, "signature": signature, "layouts": data["layouts"], "groups": groups}

    def diff(self, name: Any, text: Any, other: Any) -> dict[str, Any]:
        """``specvit diff``'s rows from ``other`` (a spec of the folder or a preset) to the edited text.

        Args:
            name: the edited file's name.
            text: its text.
            other: a spec file of the folder, or a preset's name.
        """
        from specvit.diagram.diff import diff_graphs, diff_json, format_diff
        from specvit.graph import build_graph

        before = self._other(other)
        with self._lower:
            try:
                a, b = build_graph(before), build_graph(self.spec(name, text))
            except SpecError as exc:
                return {"ok": False, "problems": [problem_json(p, name) for p in exc.problems]}
            rows = diff_graphs(a, b)
            return {"ok": True, **diff_json(a, b, rows), "text": format_diff(a, b, rows)}

    def _other(self, other: Any) -> Any:
        from specvit.spec.loader import load_spec
        from specvit.spec.presets import preset_path

        if not isinstance(other, str) or not other.strip():
            raise Refused(400, "name the spec to compare with: a file of the folder or a preset")
        other = other.strip()
        if "/" not in other and not other.lower().endswith((".yaml", ".yml")) and preset_path(other):
            return load_spec(other)
        try:
            text, _ = self.workspace.read(other)
        except Refused as exc:
            if exc.status == 404 and preset_path(other):
                return load_spec(other)
            raise
        try:
            return self.spec(other, text)
        except SpecError as exc:
            raise Refused(422, f"{other} is not a valid spec: {exc.problems[0]}") from None

    def download(self, name: Any, text: Any, fmt: Any) -> tuple[bytes, str, str]:
        """A file of the edited spec: its diagram (svg, png, html) or its ejected PyTorch module (py).

        Args:
            name: the edited file's name.
            text: its text.
            fmt: a key of :data:`FORMATS`.

        Returns:
            The bytes, their content type and a file name.
        """
        if fmt not in FORMATS:
            raise Refused(400, f"format must be one of {', '.join(FORMATS)}")
        kind, suffix = FORMATS[fmt]
        filename = Path(name).stem + suffix if isinstance(name, str) else "model" + suffix
        with self._lower:
            try:
                spec = self.spec(name, text)
            except SpecError as exc:
                raise Refused(422, f"the spec is invalid: {exc.problems[0]}") from None
        if fmt == "py":
            from specvit.compile import eject

            return eject(spec).encode("utf-8"), kind, filename
        from specvit.diagram import RenderError, render

        with tempfile.TemporaryDirectory(prefix="specvit-serve-") as tmp:
            try:
                written = render(spec, Path(tmp) / f"model{suffix}")
            except RenderError as exc:
                raise Refused(503, str(exc)) from None
            return written.read_bytes(), kind, filename


def _runs(graph: Any) -> list[Any]:
    from specvit.diagram.viewdata import runs

    return runs(graph)


def _pictures(data: dict[str, Any], pictures: Any) -> None:
    """Put the laid-out states into view data, and say of each run whether it expands (as ``to_html``)."""
    from specvit.diagram.html import key

    data["layouts"] = pictures.svg
    for group in data["groups"]:
        alone = key([group["id"]])
        group["expandable"] = alone in pictures.svg
        group["why"] = pictures.skipped.get(alone, "")


def _bug(name: str, message: str) -> dict[str, Any]:
    hint = "a bug in specvit: please report it with the spec"
    return problem_json(Problem("", message, hint), name)


def _summary(graph: Any) -> dict[str, Any]:
    """The summary table's rows (folded) and the lines under it, as ``specvit summary`` prints them."""
    from specvit.diagram.scene import format_shape
    from specvit.diagram.text import format_table
    from specvit.units import FLOPS, format_count, format_params

    rows = []
    for r in graph.summary():
        rows.append(
            {
                "path": r.path,
                "op": r.op,
                "shape": format_shape(r.shape),
                "params": format_params(r.params) if r.params else "",
                "flops": format_count(r.flops) if r.flops else "",
                "useful": format_count(r.useful_flops) if r.useful_flops != r.flops else "",
                "count": r.count,
            }
        )
    table = format_table(graph)
    return {"unit": FLOPS.name, "rows": rows, "totals": table.split("\n\n", 1)[-1].splitlines()}
