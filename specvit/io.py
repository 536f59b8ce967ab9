"""Writing files whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_open", "atomic_save", "atomic_write"]


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temporary file (binary) beside ``path``; on success it replaces ``path`` in one rename.

    If the body raises, the temporary file is removed and ``path`` keeps its old content. Missing parent
    directories are created.

    Args:
        path: the file to write.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        os.chmod(tmp, _mode_for(target))  # mkstemp makes 0600; give the file the mode a plain open would
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _mode_for(target: Path) -> int:
    """The existing file's mode, or 0666 less the umask for a new file."""
    try:
        return target.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file in the same directory, then rename).

    Args:
        path: the file to write.
        data: text (written as UTF-8) or bytes.
    """
    with atomic_open(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def atomic_save(path: str | os.PathLike[str], save: Callable[[Path], object]) -> Path:
    """Let ``save`` write ``path`` (and any side files it adds, such as ONNX external weights), then put
    them in place whole: each written in a temporary directory beside ``path``, then renamed over.

    Side files land before ``path`` itself, so a reader never sees ``path`` without them. Every file gets
    the mode a plain ``open`` would give it (0644 under the usual umask). If ``save`` raises, nothing in
    place changes.

    Args:
        path: the main file to write.
        save: writes the main file at the path it is given (same name, another directory).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp:
        staged = Path(tmp) / target.name
        save(staged)
        if not staged.is_file():
            raise FileNotFoundError(f"nothing was written to {target}")
        for written in sorted(Path(tmp).iterdir(), key=lambda p: p == staged):  # the main file last
            final = target.parent / written.name
            with open(written, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(written, _mode_for(final))
            os.replace(written, final)
    return target
