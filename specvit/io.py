"""Writing files whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_open", "atomic_write"]


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temporary file (binary) beside ``path``; on success it replaces ``path`` in one rename.

    If the body raises, the temporary file is removed and ``path`` keeps its old content.

    Args:
        path: the file to write.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file in the same directory, then rename).

    Args:
        path: the file to write.
        data: text (written as UTF-8) or bytes.
    """
    with atomic_open(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
