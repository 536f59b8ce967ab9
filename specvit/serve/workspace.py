"""The folder ``specvit serve`` opened: its spec files listed, read and saved, and nothing outside it.

Every name a request gives is relative to the folder and resolved (symbolic links followed) before use: a
name that leaves the folder (``..``, an absolute path, a link to a file elsewhere) is refused, as is one
that is not a ``.yaml``/``.yml`` file or has a hidden part. A save is atomic (a temporary file beside the
spec, then one rename: never a half-written spec) and refused when the file changed on disk since the page
loaded it, unless the page says to overwrite.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specvit.io import Unreadable, atomic_write, read_regular
from specvit.spec.yamlread import MAX_BYTES

__all__ = ["MAX_FILES", "SUFFIXES", "Refused", "Version", "Workspace", "utf8"]

SUFFIXES = (".yaml", ".yml")
MAX_FILES = 2000
"""The most spec files a folder's listing holds (a folder of thousands is not a spec folder)."""
MAX_LEVELS = 6
"""How deep the listing looks into sub-folders."""
MAX_NAME = 1024


class Refused(Exception):
    """A request the server answers with an error: its HTTP status and a message for the page.

    Args:
        status: the HTTP status (400, 403, 404, 409, 413 ...).
        message: what is wrong and how to go on, one sentence or two.
    """

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Version:
    """What a file held when the page loaded it: its modification time and the SHA-256 of its bytes.

    Args:
        mtime_ns: the modification time, in nanoseconds.
        sha256: the hex digest of the bytes.
    """

    mtime_ns: int
    sha256: str

    def as_dict(self) -> dict[str, Any]:
        """JSON data (the time as a string: a JavaScript number cannot hold it exactly)."""
        return {"mtime_ns": str(self.mtime_ns), "sha256": self.sha256}

    @classmethod
    def of(cls, data: Any) -> Version | None:
        """The version a request sent back (None for a file the page created), or :class:`Refused` (400).

        Args:
            data: ``None`` or ``{"mtime_ns": "...", "sha256": "..."}``.
        """
        if data is None:
            return None
        try:
            return cls(int(str(data["mtime_ns"])), str(data["sha256"]))
        except (KeyError, TypeError, ValueError):
            raise Refused(
                400, "version must be null or {mtime_ns, sha256}, as the file request gave"
            ) from None


def utf8(text: Any) -> bytes:
    """The UTF-8 bytes of a request's spec text, or :class:`Refused` (400) for anything but text.

    Args:
        text: the ``text`` of a request.
    """
    if not isinstance(text, str):
        raise Refused(400, "text must be the spec's text, a string")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON can carry a lone surrogate (\ud800), which no file holds
        raise Refused(400, f"the text holds a character no file can ({exc.reason} at {exc.start})") from None


def _version(path: Path, raw: bytes) -> Version:
    return Version(path.stat().st_mtime_ns, hashlib.sha256(raw).hexdigest())


class Workspace:
    """The opened folder.

    Args:
        root: the folder (resolved here).
        opened: the spec file to show first (a name under ``root``), or None.
    """

    def __init__(self, root: str | os.PathLike[str], opened: str | None = None):
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"{root} is not a directory")
        self.opened = opened
        self._lock = threading.Lock()  # saves one at a time: the check and the rename are one step

    def path(self, name: Any, *, exists: bool = True) -> Path:
        """The resolved file ``name`` names under the folder.

        Args:
            name: a ``/``-separated path relative to the folder, as the listing gives.
            exists: whether the file must exist (reading) or may be new (saving).

        Raises:
            Refused: 400 for a malformed name, 403 for one outside the folder or not a spec file, 404 for a
                file that is not there.
        """
        if not isinstance(name, str) or not name or len(name) > MAX_NAME or "\0" in name or "\\" in name:
            raise Refused(400, "name a spec file by its path in the folder, such as model.yaml")
        parts = name.split("/")
        if name.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise Refused(
                403, f"{name!r} is not a file of the folder being served (no .., absolute or hidden paths)"
            )
        if not name.lower().endswith(SUFFIXES):
            raise Refused(
                403, f"{name!r} is not a spec: the server reads and writes .yaml and .yml files only"
            )
        target = (self.root / name).resolve()  # follows links, also a link to a file elsewhere
        if not target.is_relative_to(self.root):
            raise Refused(403, f"{name!r} leads outside the folder being served ({self.root})")
        if exists and not target.is_file():
            raise Refused(404, f"{name!r} is not a file in {self.root}")
        return target

    def files(self) -> list[str]:
        """The spec files under the folder (at most :data:`MAX_FILES`, :data:`MAX_LEVELS` deep), sorted; hidden
        files and folders and links leading outside are left out."""
        found: list[str] = []

        def walk(folder: Path, prefix: str, level: int) -> None:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                return
            for entry in entries:
                if len(found) >= MAX_FILES or entry.name.startswith("."):
                    continue
                name = f"{prefix}{entry.name}"
                try:
                    real = Path(entry.path).resolve()
                    if not real.is_relative_to(self.root):
                        continue
                    if entry.is_dir() and not entry.is_symlink() and level < MAX_LEVELS:
                        walk(Path(entry.path), f"{name}/", level + 1)
                    elif entry.name.lower().endswith(SUFFIXES) and real.is_file():
                        found.append(name)
                except OSError:
                    continue

        walk(self.root, "", 0)
        return found

    def read(self, name: Any) -> tuple[str, Version]:
        """The text of a spec file and its version.

        Args:
            name: the file, relative to the folder.

        Raises:
            Refused: the name is refused (see :meth:`path`), or the file is not a readable UTF-8 spec.
        """
        path = self.path(name)
        try:
            raw = read_regular(path, MAX_BYTES, "spec", shown=name)
            return raw.decode("utf-8"), _version(path, raw)
        except Unreadable as exc:
            raise Refused(413 if exc.reason == "too_big" else 403, str(exc)) from None
        except UnicodeDecodeError:
            raise Refused(415, f"{name} is not UTF-8 text; save it as UTF-8 to edit it here") from None
        except OSError as exc:
            raise Refused(403, f"cannot read {name}: {exc.strerror or exc}") from None

    def current(self, path: Path) -> Version | None:
        """The version of the file on disk now, or None when there is none."""
        try:
            raw = read_regular(path, MAX_BYTES, "spec")
            return _version(path, raw)
        except Unreadable as exc:
            if exc.reason == "missing":
                return None
            raise Refused(409, f"the file on disk cannot be read back: {exc}") from None

    def save(self, name: Any, text: Any, base: Version | None, *, force: bool = False) -> Version:
        """Write ``text`` to the file atomically; refused when the file changed since ``base`` was read.

        Args:
            name: the file, relative to the folder (a new file is created).
            text: the whole spec, at most the size a spec may have.
            base: the version the page loaded (None: the page created the file, which must not exist).
            force: overwrite whatever is on disk.

        Raises:
            Refused: 409 when the file changed on disk (or appeared, or was deleted) since it was loaded;
                413 for a text over the size limit; 400/403 for a bad name or text.
        """
        data = utf8(text)
        if len(data) > MAX_BYTES:
            raise Refused(
                413, f"the spec is {len(data):,} bytes, over the {MAX_BYTES:,}-byte limit for a spec"
            )
        path = self.path(name, exists=False)
        with self._lock:
            now = self.current(path)
            if not force and now != base:
                raise Refused(409, _conflict(name, base, now))
            try:
                atomic_write(path, data)
            except OSError as exc:
                raise Refused(403, f"cannot write {name}: {exc.strerror or exc}") from None
            saved = self.current(path)
        assert saved is not None
        return saved


def _conflict(name: str, base: Version | None, now: Version | None) -> str:
    """Why a save is refused: the file on disk is not the one the page loaded."""
    keep = "Reload it to see that version, or overwrite it with yours."
    if now is None:
        return f"not saved: {name} was deleted on disk since it was loaded. Overwrite to write it again."
    when = time.strftime("%H:%M:%S", time.localtime(now.mtime_ns / 1e9))
    if base is None:
        return f"not saved: {name} was created on disk (at {when}) while you edited a new file. {keep}"
    if now.sha256 == base.sha256:
        return f"not saved: {name} was rewritten on disk at {when} (same text, new time). {keep}"
    return f"not saved: {name} changed on disk at {when}, since it was loaded here. {keep}"
