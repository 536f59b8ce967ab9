"""``specvit serve``: a live spec editor in the browser.

The page holds an editor of the spec (CodeMirror 5, served from the package) and beside it the interactive
diagram of ``specvit render -o model.html``, the summary table and the problems. As the user types, the
page sends the text (debounced) and the server validates and lowers it: problems come back located, and
are marked at their line and column, all at once; a valid spec updates the diagram and the table; an
invalid one leaves the last good diagram greyed. Save writes the file atomically, and refuses when the file
changed on disk since it was loaded. Buttons download the diagram (SVG, PNG, HTML) and the ejected PyTorch
file, and a "diff with" field compares with another spec or preset.

The server is the standard library's (nothing to install); it binds 127.0.0.1 unless told otherwise, and
serves only its own files and the spec files under the opened folder (see :mod:`specvit.serve.server`).

Example:
    >>> from specvit.serve import open_server
    >>> server = open_server("specs/mnist_vit.yaml", port=0)   # port 0: any free port
    >>> server.url.startswith("http://127.0.0.1:")
    True
    >>> server.server_close()
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from specvit.serve.server import Server, is_loopback, missing_assets
from specvit.serve.workspace import SUFFIXES, Workspace

__all__ = ["DEFAULT_PORT", "ServeError", "folder_of", "open_server", "serve"]

DEFAULT_PORT = 8765


class ServeError(Exception):
    """Why the server cannot start (a spec that is not a file or folder, a port in use), said in one line."""


def folder_of(spec: str | os.PathLike[str] | None) -> tuple[Path, str | None]:
    """The folder to serve and the spec file to open first, from ``specvit serve``'s argument.

    Args:
        spec: a spec file (existing, or new in an existing folder), a folder, or None (the working
            directory).

    Raises:
        ServeError: ``spec`` is none of these.
    """
    if spec is None:
        return Path.cwd(), None
    path = Path(spec)
    if path.is_dir():
        return path, None
    if path.suffix.lower() not in SUFFIXES:
        raise ServeError(
            f"{spec} is not a spec file (.yaml) or a folder. To start from a preset, write a file holding "
            f"'extends: NAME.yaml' and serve it"
        )
    if path.exists() and not path.is_file():
        raise ServeError(f"{spec} is not a regular file")
    if not path.parent.resolve().is_dir():
        raise ServeError(f"the folder of {spec} does not exist")
    return path.parent, path.name


def open_server(
    spec: str | os.PathLike[str] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    log: TextIO | None = None,
) -> Server:
    """The server of ``spec``'s folder, bound and ready (``server.serve_forever()`` runs it).

    Args:
        spec: a spec file, a folder or None (see :func:`folder_of`).
        host: the address to bind; anything but this machine's own (127.0.0.1, ::1, localhost) makes the
            specs readable and writable by whoever reaches it.
        port: the port; 0 picks a free one.
        log: where to write a line per failed request.

    Raises:
        ServeError: the spec or folder cannot be served, the page's files are missing, or the port is taken.
    """
    missing = missing_assets()
    if missing:
        raise ServeError(
            f"this installation lacks the page's files ({', '.join(missing[:3])}): reinstall specvit with "
            "pip install --force-reinstall 'specvit[serve]'"
        )
    root, opened = folder_of(spec)
    try:
        return Server((host, port), Workspace(root, opened), log=log)
    except OSError as exc:
        if exc.errno in (98, 48, 10048):  # EADDRINUSE on Linux, macOS, Windows
            raise ServeError(
                f"port {port} is in use: give another with --port N (0 picks a free one)"
            ) from None
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve(
    spec: str | os.PathLike[str] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    out: TextIO | None = None,
) -> None:
    """Run the editor's server until interrupted (Ctrl-C), printing its address first.

    Args:
        spec: a spec file, a folder or None (see :func:`folder_of`).
        host: the address to bind (a warning is printed for one other machines can reach).
        port: the port; 0 picks a free one.
        out: where to print (default standard error for the warning, standard output for the address).
    """
    server = open_server(spec, host=host, port=port, log=out or sys.stderr)
    if not is_loopback(host):
        print(warning(host, server.workspace.root), file=out or sys.stderr)
    opened = f"#{server.workspace.opened}" if server.workspace.opened else ""
    print(f"specvit serve: {server.workspace.root} at {server.url}{opened} (Ctrl-C stops)", file=out or sys.stdout,
          flush=True)  # fmt: skip
    try:
        server.serve_forever()
    finally:
        server.server_close()


def warning(host: str, root: Path) -> str:
    """The warning printed when the server listens on an address other machines can reach.

    Args:
        host: the address.
        root: the folder served.
    """
    return (
        f"specvit serve: warning: listening on {host}, reachable from other machines: anyone who reaches it "
        f"can read and overwrite the specs in {root}. Leave out --host to listen on 127.0.0.1 only."
    )
