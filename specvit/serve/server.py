"""The HTTP server of ``specvit serve``: the standard library's ``ThreadingHTTPServer``, guarded.

It serves the page and its assets (from the package, never a CDN) and a small JSON API over the opened
folder (:mod:`specvit.serve.workspace`) and the analysis of spec text (:mod:`specvit.serve.analyse`):

=======================  ==========================================================================
``GET /``                the page
``GET /static/NAME``     an asset of the package (a fixed list; nothing else is served)
``GET /api/files``       the folder's spec files, the one opened, the presets' names
``GET /api/file?name=``  a spec file's text and version (modification time, SHA-256)
``POST /api/validate``   ``{name, text}``: the problems only (fast: no lowering)
``POST /api/check``      ``{name, text}``: the problems, or the diagram's data and the summary
``POST /api/layouts``    ``{name, text, signature}``: every laid-out state of the diagram
``POST /api/save``       ``{name, text, version, force}``: atomic; 409 if the file changed on disk
``POST /api/diff``       ``{name, text, other}``: ``specvit diff``'s rows from ``other`` to the text
``POST /api/download``   ``{name, text, format}``: svg, png, html or the ejected py
=======================  ==========================================================================

Guards: request bodies over :data:`MAX_BODY` are refused unread; a POST must be JSON (``Content-Type``),
which a page of another site cannot send without the browser asking first, and carry no ``Origin`` of
another site; a request must name this server in its ``Host`` (a page of another site reached through
DNS rebinding names its own); at most :data:`MAX_CONNECTIONS` requests are served at once; a client has
:data:`TIMEOUT` seconds to send its request. Any failure is answered with a JSON error and the server
goes on.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, TextIO
from urllib.parse import parse_qs, urlsplit

from specvit.serve.analyse import Analyst
from specvit.serve.workspace import Refused, Version, Workspace
from specvit.spec.yamlread import MAX_BYTES
from specvit.text import escape

__all__ = ["ASSETS", "MAX_BODY", "MAX_CONNECTIONS", "TIMEOUT", "Server", "is_loopback", "missing_assets"]

MAX_BODY = 8 * MAX_BYTES
"""The largest request body read (JSON escapes can make a spec's text up to six times its size)."""
MAX_CONNECTIONS = 32
TIMEOUT = 20.0

_TYPES = {
    "js": "text/javascript; charset=utf-8",
    "css": "text/css; charset=utf-8",
    "html": "text/html; charset=utf-8",
}
ASSETS = {
    "index.html": ("specvit.serve", "page.html"),
    "app.js": ("specvit.serve", "app.js"),
    "app.css": ("specvit.serve", "app.css"),
    "view.js": ("specvit.diagram", "view.js"),
    "view.css": ("specvit.diagram", "view.css"),
    **{
        name: ("specvit.serve", f"vendor/codemirror/{name}")
        for name in ("codemirror.js", "codemirror.css", "yaml.js", "show-hint.js", "show-hint.css", "LICENSE")
    },
}
"""Every file the server sends: URL name -> (package, file in it)."""

POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def missing_assets() -> list[str]:
    """The page's files this installation lacks (none, unless it was installed without its package data)."""
    out = []
    for package, name in ASSETS.values():
        try:
            if not resources.files(package).joinpath(name).is_file():
                out.append(f"{package.replace('.', '/')}/{name}")
        except (ModuleNotFoundError, OSError):
            out.append(f"{package.replace('.', '/')}/{name}")
    return out


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address of this machine only (127.0.0.0/8, ::1, ``localhost``).

    Args:
        host: the address to bind.
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Server(ThreadingHTTPServer):
    """The server: the workspace, the analyst, the assets read once, and a bound on requests at once.

    Args:
        address: ``(host, port)``; port 0 picks a free one.
        workspace: the opened folder.
        log: where to write one line per failed request (None: nowhere).
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], workspace: Workspace, log: TextIO | None = None):
        self.workspace = workspace
        self.analyst = Analyst(workspace)
        self.log = log
        self.assets = {
            url: resources.files(package).joinpath(name).read_bytes()
            for url, (package, name) in ASSETS.items()
        }
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.loopback = is_loopback(address[0])
        super().__init__(address, Handler)

    @property
    def url(self) -> str:
        """The address the page is at."""
        host, port = str(self.server_address[0]), int(self.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    def hosts(self) -> set[str]:
        """The ``Host`` headers a request to this server may carry when bound to this machine only."""
        port = self.server_address[1]
        return {f"{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]", str(self.server_address[0]))}

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # too many at once: refused at once, not queued
            with contextlib.suppress(OSError):
                request.sendall(
                    b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n\r\n"
                )
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line for a request that failed below the handler (a reset connection), never a traceback."""
        exc = sys.exc_info()[1]
        if self.log is not None:
            print(escape(f"specvit serve: {client_address[0]}: {type(exc).__name__}: {exc}"), file=self.log)


class Handler(BaseHTTPRequestHandler):
    """One request: routed, guarded, answered with JSON (or an asset, or a download)."""

    server: Server
    timeout = TIMEOUT
    server_version = "specvit-serve"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: requests are not logged (failures are, by :meth:`_fail`)."""

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's own errors (a request line it cannot parse, headers too long) as JSON too."""
        short = message or self.responses.get(code, ("error",))[0]
        self.close_connection = True
        with contextlib.suppress(OSError):
            self._json(code, {"error": f"{code} {short}" + (f": {explain}" if explain else "")})

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def do_PUT(self) -> None:
        self._answer("PUT")

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT

    def do_HEAD(self) -> None:
        self._answer("HEAD")

    def _answer(self, method: str) -> None:
        try:
            self._guard(method)
            self._route(method, urlsplit(self.path))
        except Refused as exc:
            self._json(exc.status, {"error": exc.message})
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as exc:  # a bug: said to the page and logged in one line; the server goes on
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if self.server.log is not None:
            print(escape(f"specvit serve: {self.command} {self.path[:200]}: {type(exc).__name__}: {exc}"),
                  file=self.server.log)  # fmt: skip
        try:
            self._json(500, {"error": f"specvit failed on this request ({type(exc).__name__}: {exc})"})
        except OSError:
            self.close_connection = True

    def _guard(self, method: str) -> None:
        host = self.headers.get("Host", "")
        if self.server.loopback and host not in self.server.hosts():
            raise Refused(
                403, f"this server answers requests for {self.server.url} only (Host: {host[:100]!r})"
            )
        origin = self.headers.get("Origin")
        if origin is not None and origin != f"http://{host}":
            raise Refused(403, "requests from pages of other sites are refused")
        if method == "POST" and self.headers.get_content_type() != "application/json":
            raise Refused(415, "send the request as JSON (Content-Type: application/json)")

    def _route(self, method: str, url: Any) -> None:
        path = url.path
        if method in ("GET", "HEAD"):
            if path in ("/", "/index.html"):
                return self._send(
                    200, self.server.assets["index.html"], _TYPES["html"], head=method == "HEAD"
                )
            if path.startswith("/static/") and path[len("/static/") :] in self.server.assets:
                name = path[len("/static/") :]
                kind = _TYPES.get(name.rsplit(".", 1)[-1], "text/plain; charset=utf-8")
                return self._send(200, self.server.assets[name], kind, head=method == "HEAD")
            if path == "/api/files":
                return self._json(200, self._files())
            if path == "/api/file":
                name = parse_qs(url.query).get("name", [""])[0]
                text, version = self.server.workspace.read(name)
                return self._json(200, {"name": name, "text": text, "version": version.as_dict()})
            raise Refused(404, f"nothing at {path[:200]}")
        if method != "POST":
            raise Refused(405, f"{method} is not answered here")
        return self._post(path, self._body())

    def _files(self) -> dict[str, Any]:
        from specvit.spec.presets import preset_names

        ws = self.server.workspace
        files = ws.files()
        opened = ws.opened or (files[0] if files else None)
        return {"root": str(ws.root), "files": files, "opened": opened, "presets": preset_names()}

    def _post(self, path: str, body: dict[str, Any]) -> None:
        analyst, ws = self.server.analyst, self.server.workspace
        name, text = body.get("name"), body.get("text")
        if path == "/api/validate":
            return self._json(200, analyst.validate(name, text))
        if path == "/api/check":
            return self._json(200, analyst.check(name, text))
        if path == "/api/layouts":
            return self._json(200, analyst.layouts(name, text, body.get("signature")))
        if path == "/api/diff":
            return self._json(200, analyst.diff(name, text, body.get("other")))
        if path == "/api/save":
            version = ws.save(name, text, Version.of(body.get("version")), force=body.get("force") is True)
            return self._json(200, {"name": name, "version": version.as_dict()})
        if path == "/api/download":
            data, kind, filename = analyst.download(name, text, body.get("format"))
            return self._send(200, data, kind, attachment=filename)
        raise Refused(404, f"nothing at {path[:200]}")

    def _body(self) -> dict[str, Any]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise Refused(411, "send the body with a Content-Length, not chunked")
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            raise Refused(411, "a request body needs a Content-Length") from None
        if length < 0 or length > MAX_BODY:
            self.close_connection = True  # the body is not read
            raise Refused(413, f"the request body is {length:,} bytes, over the {MAX_BODY:,}-byte limit")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise Refused(400, f"the request body is not JSON: {str(exc)[:200]}") from None
        if not isinstance(body, dict):
            raise Refused(400, "the request body must be a JSON object")
        return body

    def _json(self, status: int, data: Any) -> None:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)  # ASCII: a lone surrogate as \\ud800
        self._send(status, text.encode("ascii"), "application/json; charset=utf-8")

    def _send(self, status: int, data: bytes, kind: str, *, head: bool = False, attachment: str = "") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy", POLICY)
        if attachment:
            safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in attachment)
            self.send_header("Content-Disposition", f'attachment; filename="{safe}"')
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            self.wfile.write(data)
