"""``specvit serve`` at the HTTP level: what it reads and writes (only spec files under its folder, saves
whole and never over a file changed on disk), what it refuses (traversal, links out, oversized or malformed
requests, other sites' pages), what the page gets (located problems, the diagram's data, the summary, diff
rows, downloads), and the command line (address, warning, missing files). The page in a real browser is
tests/test_serve_browser.py."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import specvit
from specvit.diagram.diff import diff_graphs, diff_json
from specvit.graph import build_graph
from specvit.serve import ServeError, open_server
from specvit.serve.server import MAX_BODY, Server
from specvit.spec.yamlread import MAX_BYTES

ROOT = Path(__file__).resolve().parents[1]
TINY = (ROOT / "specs" / "mnist_vit.yaml").read_text()


class Client:
    """Requests to a running server, each on its own connection."""

    def __init__(self, server: Server):
        self.host, self.port = server.server_address[:2]

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers={**sent, **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        kind = r.getheader("Content-Type", "")
        return r.status, json.loads(raw) if kind.startswith("application/json") else (
            raw,
            dict(r.getheaders()),
        )

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        return self.request("POST", path, body, **kw)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "specs"
    root.mkdir()
    (root / "tiny.yaml").write_text(TINY)
    (root / "sub").mkdir()
    (root / "sub" / "child.yaml").write_text("extends: ../tiny.yaml\nname: child\nencoder:\n  depth: 3\n")
    (tmp_path / "outside.yaml").write_text(TINY)
    return root


@pytest.fixture
def running(folder: Path) -> Iterator[tuple[Server, Client]]:
    server = open_server(folder / "tiny.yaml", port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, Client(server)
    server.shutdown()
    server.server_close()


# ------------------------------------------------------------------------------------------ reading


def test_lists_the_folders_specs_and_reads_one_with_its_version(
    running: tuple[Server, Client], folder: Path
) -> None:
    _, client = running
    status, files = client.get("/api/files")
    assert status == 200
    assert files["files"] == ["sub/child.yaml", "tiny.yaml"] and files["opened"] == "tiny.yaml"
    assert "vit_base_patch16_224" in files["presets"]
    status, got = client.get("/api/file?name=sub/child.yaml")
    assert status == 200 and got["text"] == (folder / "sub" / "child.yaml").read_text()
    assert len(got["version"]["sha256"]) == 64 and int(got["version"]["mtime_ns"]) > 0


@pytest.mark.parametrize(
    "name",
    [
        "../outside.yaml",
        "sub/../../outside.yaml",
        "/etc/passwd",
        "%2e%2e/outside.yaml",
        ".hidden.yaml",
        "..%2Foutside.yaml",
    ],
)
def test_a_path_leaving_the_folder_is_refused(running: tuple[Server, Client], name: str) -> None:
    _, client = running
    status, got = client.get(f"/api/file?name={name}")
    assert status == 403 and "is not a file of the folder" in got["error"] and set(got) == {"error"}


def test_only_the_packages_assets_are_served(running: tuple[Server, Client]) -> None:
    _, client = running
    status, (page, headers) = client.get("/")
    assert status == 200 and b"/static/codemirror.js" in page
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    status, (script, _) = client.get("/static/codemirror.js")
    assert status == 200 and b"CodeMirror" in script
    for path in (
        "/static/../pyproject.toml",
        "/static/__init__.py",
        "/static/vendor/codemirror/codemirror.js",
        "/tiny.yaml",
    ):
        assert client.get(path)[0] == 404, path


def test_a_link_out_of_the_folder_is_neither_read_nor_written(
    running: tuple[Server, Client], folder: Path
) -> None:
    _, client = running
    outside = folder.parent / "outside.yaml"
    (folder / "link.yaml").symlink_to(outside)
    (folder / "inner.yaml").symlink_to(folder / "tiny.yaml")  # a link that stays inside: the control
    assert client.get("/api/file?name=link.yaml")[0] == 403
    status, got = client.post(
        "/api/save", {"name": "link.yaml", "text": "pwned: 1\n", "version": None, "force": True}
    )
    assert status == 403 and "outside the folder" in got["error"]
    assert outside.read_text() == TINY
    assert "link.yaml" not in client.get("/api/files")[1]["files"]
    status, got = client.get("/api/file?name=inner.yaml")
    assert status == 200 and got["text"] == TINY


def test_extends_resolves_beside_the_file_and_stays_in_the_folder(running: tuple[Server, Client]) -> None:
    _, client = running
    status, got = client.post(
        "/api/check", {"name": "sub/child.yaml", "text": "extends: ../tiny.yaml\nname: child\n"}
    )
    assert status == 200 and got["ok"] and got["data"]["title"] == "child"
    status, got = client.post(
        "/api/check", {"name": "sub/child.yaml", "text": "extends: vit_tiny_patch16_224.yaml\n"}
    )
    assert (
        status == 200 and got["ok"] and got["data"]["title"] == "vit_tiny_patch16_224"
    )  # a preset by name, from anywhere
    status, got = client.post(
        "/api/check", {"name": "sub/child.yaml", "text": "name: c\nextends: ../../outside.yaml\n"}
    )
    assert status == 200 and not got["ok"]
    (problem,) = got["problems"]
    assert (problem["line"], problem["path"], problem["here"]) == (2, "extends", True)
    assert "outside the folder being served" in problem["message"]


def test_load_text_reads_unsaved_text_as_the_file_it_will_be(folder: Path) -> None:
    from specvit.spec.loader import load_text

    child = folder / "sub" / "child.yaml"
    text = "extends: ../tiny.yaml\nname: unsaved\nencoder:\n  depth: 2\n"
    spec = load_text(text, child, shown="sub/child.yaml")  # not the file on disk (depth 3, name child)
    assert (spec.name, spec.encoder.depth) == ("unsaved", 2)
    assert spec.locate("encoder.depth") == specvit.errors.Location("sub/child.yaml", 4, 10)
    outside = "extends: ../../outside.yaml\nname: x\n"
    assert load_text(outside, child).name == "x"  # anywhere, as load_spec reads a file
    with pytest.raises(
        specvit.SpecError, match=r"sub/child.yaml:1:10: extends: extends names '../../outside.yaml', outside"
    ):
        load_text(outside, child, shown="sub/child.yaml", within=folder)
    with pytest.raises(specvit.SpecError, match=r"over the 1,048,576-byte limit"):
        load_text("#" * (MAX_BYTES + 1), child, within=folder)


# ------------------------------------------------------------------------------------------ checking


def test_every_problem_comes_back_at_its_line_with_its_fix(running: tuple[Server, Client]) -> None:
    _, client = running
    text = TINY.replace("heads: 2", "heads: 3").replace("depth: 1", "depth: 0")
    assert text != TINY
    status, got = client.post("/api/check", {"name": "tiny.yaml", "text": text})
    assert status == 200 and got["ok"] is False
    lines = text.splitlines()
    found = {(p["path"], lines[p["line"] - 1].strip()) for p in got["problems"]}
    assert ("encoder.depth", "depth: 0") in found
    assert any(path.endswith("heads") and line.startswith("heads: 3") for path, line in found)
    assert all(p["here"] and p["message"] for p in got["problems"])
    assert any(p["hint"] for p in got["problems"])
    status, got = client.post("/api/check", {"name": "tiny.yaml", "text": TINY})  # the control: no problem
    assert got["ok"] and got["problems"] == []


def test_a_valid_spec_gives_the_diagrams_data_and_the_summary(
    running: tuple[Server, Client], folder: Path
) -> None:
    _, client = running
    text = TINY.replace("depth: 1", "depth: 4")
    status, got = client.post("/api/check", {"name": "tiny.yaml", "text": text})
    graph = build_graph(specvit.load_spec(folder / "tiny.yaml", overrides={"encoder.depth": 4}))
    assert got["ok"] and set(got["data"]["nodes"]) == set(graph)
    assert list(got["data"]["layouts"]) == [""] and got["data"]["layouts"][""].startswith("<svg")
    assert any(f"{graph.total_params:,}" in line for line in got["summary"]["totals"])
    assert next(r["count"] for r in got["summary"]["rows"] if r["path"].startswith("encoder.blocks.0-3")) == 4
    node = got["data"]["nodes"]["encoder.blocks.2.attn"]
    assert node["source"]["file"] == "tiny.yaml"  # the editor's line, not the file's on disk
    assert node["source"]["text"] == text.splitlines()[node["source"]["line"] - 1]
    status, full = client.post("/api/layouts", {"name": "tiny.yaml", "text": text})
    assert (
        status == 200
        and full["signature"] == got["signature"]
        and set(full["layouts"]) == {"", "encoder.blocks.0"}
    )
    assert full["groups"][0]["expandable"] is True
    status, again = client.post("/api/check", {"name": "tiny.yaml", "text": text})
    assert (
        status == 200 and again["complete"] is True and set(again["data"]["layouts"]) == set(full["layouts"])
    )  # cached


def test_the_clis_bounds_hold_for_requests(running: tuple[Server, Client]) -> None:
    _, client = running
    deep = TINY.replace("depth: 1", "depth: 100000")
    status, got = client.post("/api/check", {"name": "tiny.yaml", "text": deep})
    assert status == 200 and not got["ok"] and got["problems"][0]["path"] == "encoder.depth"
    big = TINY + "#" * MAX_BYTES
    status, got = client.post("/api/check", {"name": "tiny.yaml", "text": big})
    assert (
        status == 200 and not got["ok"] and "over the 1,048,576-byte limit" in got["problems"][0]["message"]
    )
    nested = "a: " + "[" * 200 + "]" * 200
    status, got = client.post("/api/check", {"name": "tiny.yaml", "text": nested})
    assert status == 200 and not got["ok"] and "nest" in got["problems"][0]["message"]


def test_a_check_overtaken_before_its_turn_is_not_done(folder: Path) -> None:
    server = open_server(folder, port=0)
    analyst, results = server.analyst, []
    try:
        with analyst._lower:  # a lowering under way: two checks of the file queue behind it
            first = threading.Thread(target=lambda: results.append(analyst.check("tiny.yaml", TINY)))
            first.start()
            while analyst._latest.get("tiny.yaml") != 1:
                time.sleep(0.01)
            second = threading.Thread(target=lambda: results.append(analyst.check("tiny.yaml", TINY)))
            second.start()
            while analyst._latest.get("tiny.yaml") != 2:
                time.sleep(0.01)
        first.join()
        second.join()
    finally:
        server.server_close()
    assert sorted(bool(r.get("stale")) for r in results) == [False, True]
    assert [r["ok"] for r in results if not r.get("stale")] == [True]


# ------------------------------------------------------------------------------------------ saving


def _version(client: Client, name: str) -> dict[str, str]:
    return dict(client.get(f"/api/file?name={name}")[1]["version"])


def test_save_writes_the_file_whole_and_gives_the_new_version(
    running: tuple[Server, Client], folder: Path
) -> None:
    _, client = running
    text = TINY.replace("depth: 1", "depth: 2")
    status, got = client.post(
        "/api/save", {"name": "tiny.yaml", "text": text, "version": _version(client, "tiny.yaml")}
    )
    assert status == 200 and (folder / "tiny.yaml").read_text() == text
    assert got["version"] == _version(client, "tiny.yaml")
    assert sorted(p.name for p in folder.iterdir()) == ["sub", "tiny.yaml"]  # no temporary file left
    status, got = client.post("/api/save", {"name": "sub/new.yaml", "text": text, "version": None})
    assert status == 200 and (folder / "sub" / "new.yaml").read_text() == text


def test_a_file_changed_on_disk_since_loaded_is_not_overwritten(
    running: tuple[Server, Client], folder: Path
) -> None:
    _, client = running
    loaded = _version(client, "tiny.yaml")
    (folder / "tiny.yaml").write_text(TINY + "# edited elsewhere\n")
    mine = TINY.replace("depth: 1", "depth: 2")
    status, got = client.post("/api/save", {"name": "tiny.yaml", "text": mine, "version": loaded})
    assert status == 409 and "changed on disk" in got["error"] and "overwrite" in got["error"]
    assert (folder / "tiny.yaml").read_text() == TINY + "# edited elsewhere\n"
    status, got = client.post("/api/save", {"name": "new.yaml", "text": mine, "version": None})
    assert status == 200
    status, got = client.post(
        "/api/save", {"name": "new.yaml", "text": mine, "version": None}
    )  # created since
    assert status == 409 and "was created on disk" in got["error"]
    status, got = client.post(
        "/api/save", {"name": "tiny.yaml", "text": mine, "version": loaded, "force": True}
    )
    assert status == 200 and (folder / "tiny.yaml").read_text() == mine


def test_a_failed_write_leaves_the_old_file(
    running: tuple[Server, Client], folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, client = running
    loaded = _version(client, "tiny.yaml")

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("specvit.io.os.replace", fail)
    status, got = client.post("/api/save", {"name": "tiny.yaml", "text": "half", "version": loaded})
    assert status == 403 and "No space left on device" in got["error"]
    assert (folder / "tiny.yaml").read_text() == TINY
    assert sorted(p.name for p in folder.iterdir()) == ["sub", "tiny.yaml"]


def test_save_refuses_what_is_not_a_spec_file(running: tuple[Server, Client], folder: Path) -> None:
    _, client = running
    for name, status in (("notes.txt", 403), ("../x.yaml", 403), ("", 400), (7, 400)):
        got = client.post("/api/save", {"name": name, "text": "a: 1\n", "version": None})
        assert got[0] == status, name
    assert (
        client.post("/api/save", {"name": "a.yaml", "text": "x" * (MAX_BYTES + 1), "version": None})[0] == 413
    )
    assert sorted(p.name for p in folder.iterdir()) == ["sub", "tiny.yaml"]


# ------------------------------------------------------------------------------------------ robustness


def test_an_oversized_body_is_refused_unread(running: tuple[Server, Client]) -> None:
    server, client = running
    with socket.create_connection(server.server_address[:2], timeout=10) as s:
        s.sendall(
            f"POST /api/check HTTP/1.1\r\nHost: 127.0.0.1:{client.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {MAX_BODY + 1}\r\n\r\n".encode()
        )
        answer = _all(s).decode()
    assert answer.startswith("HTTP/1.0 413") and "over the" in answer
    assert client.get("/api/files")[0] == 200  # and the server goes on


@pytest.mark.parametrize(
    ("body", "headers", "status", "says"),
    [
        (b"{not json", {}, 400, "not JSON"),
        (b"[1, 2]", {}, 400, "JSON object"),
        (b'{"name": "tiny.yaml", "text": "\\ud800"}', {}, 400, "no file can"),
        (b'{"name": "tiny.yaml", "text": 5}', {}, 400, "must be the spec's text"),
        (b"\xff\xfe\x00", {}, 400, "not JSON"),
        (b"{}", {"Content-Type": "text/plain"}, 415, "as JSON"),
        (b"{}", {"Origin": "http://evil.example"}, 403, "other sites"),
        (b"{}", {"Host": "evil.example:80"}, 403, "answers requests for"),
    ],
    ids=["broken", "list", "surrogate", "text-not-string", "bytes", "form", "origin", "rebinding"],
)
def test_malformed_and_foreign_requests_are_answered_and_survived(
    running: tuple[Server, Client], body: bytes, headers: dict[str, str], status: int, says: str
) -> None:
    _, client = running
    got = client.post("/api/check", body, headers=headers)
    assert got[0] == status and says in got[1]["error"]
    assert client.post("/api/check", {"name": "tiny.yaml", "text": TINY})[1]["ok"]  # the control


def _all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_garbage_on_the_wire_is_survived(running: tuple[Server, Client]) -> None:
    server, client = running
    for junk in (b"GARBAGE\r\n\r\n", b"\x00\x01\x02\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"):
        with socket.create_connection(server.server_address[:2], timeout=10) as s:
            s.sendall(junk)
            answer = _all(s)
            assert answer.startswith((b'{"error":"400 ', b"HTTP/1.0 4")), answer  # HTTP/0.9: no status line
            body = answer.split(b"\r\n\r\n")[-1]
            assert json.loads(body)["error"].startswith(("400", "414")), answer
    with socket.create_connection(server.server_address[:2], timeout=10) as s:  # no length on a POST
        s.sendall(
            f"POST /api/check HTTP/1.1\r\nHost: 127.0.0.1:{client.port}\r\nContent-Type: application/json\r\n\r\n".encode()
        )
        assert _all(s).startswith(b"HTTP/1.0 411")
    assert client.get("/api/files")[0] == 200


# ------------------------------------------------------------------------------------------ diff, downloads


def test_diff_gives_diffs_rows_from_the_other_spec(running: tuple[Server, Client], folder: Path) -> None:
    _, client = running
    text = TINY.replace("heads: 2", "heads: 4")
    status, got = client.post("/api/diff", {"name": "tiny.yaml", "text": text, "other": "tiny.yaml"})
    a = build_graph(specvit.load_spec(folder / "tiny.yaml"))
    b = build_graph(specvit.parse_spec(text))
    want = diff_json(a, b, diff_graphs(a, b))
    assert got["ok"] and [r["text"] for r in got["rows"]] == [r["text"] for r in want["rows"]] != []
    status, got = client.post("/api/diff", {"name": "tiny.yaml", "text": TINY, "other": "tiny.yaml"})
    assert status == 200 and got["same"] is True and got["rows"] == []
    status, got = client.post(
        "/api/diff", {"name": "tiny.yaml", "text": TINY, "other": "vit_tiny_patch16_224"}
    )
    assert status == 200 and got["ok"] and got["a"]["name"] == "vit_tiny_patch16_224"
    assert client.post("/api/diff", {"name": "tiny.yaml", "text": TINY, "other": "../outside.yaml"})[0] == 403


def test_downloads_are_the_diagram_and_the_ejected_file(running: tuple[Server, Client]) -> None:
    _, client = running
    status, (svg, headers) = client.post(
        "/api/download", {"name": "tiny.yaml", "text": TINY, "format": "svg"}
    )
    assert (
        status == 200
        and b"<svg" in svg
        and headers["Content-Disposition"] == 'attachment; filename="tiny.svg"'
    )
    status, (png, _) = client.post("/api/download", {"name": "tiny.yaml", "text": TINY, "format": "png"})
    assert png.startswith(b"\x89PNG")
    status, (py, headers) = client.post("/api/download", {"name": "tiny.yaml", "text": TINY, "format": "py"})
    assert status == 200 and headers["Content-Disposition"] == 'attachment; filename="tiny.py"'
    compile(py.decode(), "tiny.py", "exec")
    assert "class Model(" in py.decode()
    assert client.post("/api/download", {"name": "tiny.yaml", "text": TINY, "format": "exe"})[0] == 400
    bad = TINY.replace("depth: 1", "depth: 0")
    status, got = client.post("/api/download", {"name": "tiny.yaml", "text": bad, "format": "svg"})
    assert status == 422 and "encoder.depth" in got["error"]


# ------------------------------------------------------------------------------------------ command line


def _start(args: list[str], cwd: Path) -> tuple[str, str]:
    """Start ``specvit serve`` and stop it once it printed its address: (stdout's first line, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specvit.cli", "serve", *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    return line, err


def test_the_command_binds_this_machine_only_unless_told(folder: Path) -> None:
    line, err = _start(["tiny.yaml", "--port", "0"], folder)
    assert re.match(
        r"specvit serve: .*specs at http://127\.0\.0\.1:\d+/#tiny\.yaml \(Ctrl-C stops\)", line
    ), line
    assert "warning" not in err
    line, err = _start([".", "--port", "0", "--host", "0.0.0.0"], folder)
    assert re.match(r"specvit serve: .* at http://0\.0\.0\.0:\d+/ ", line), line
    assert "warning: listening on 0.0.0.0, reachable from other machines" in err


def test_the_command_says_what_is_wrong_without_a_traceback(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specvit.cli import main

    assert main(["serve", str(folder / "notes.txt"), "--port", "0"]) == 1
    assert "is not a spec file (.yaml) or a folder" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert main(["serve", str(folder), "--port", str(taken)]) == 1
    assert f"port {taken} is in use: give another with --port N" in capsys.readouterr().err


def test_missing_page_files_name_what_to_install(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import specvit.serve.server as served
    from specvit.cli import main

    monkeypatch.setitem(served.ASSETS, "codemirror.js", ("specvit.serve", "vendor/codemirror/gone.js"))
    with pytest.raises(
        ServeError, match=r"lacks the page's files \(specvit/serve/vendor/codemirror/gone\.js\)"
    ):
        open_server(folder, port=0)
    assert main(["serve", str(folder), "--port", "0"]) == 1
    assert "pip install --force-reinstall 'specvit[serve]'" in capsys.readouterr().err
    monkeypatch.undo()  # the control: with its files, it starts
    open_server(folder, port=0).server_close()
