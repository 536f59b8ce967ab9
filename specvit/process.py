"""The command line's process environment: errors of its working directory and of its standard output
said by name, since the OSError they raise names no file (``specvit validate: : No such file or
directory``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["STDOUT", "describe", "named_stdout"]

STDOUT = "standard output"


def _cwd_gone() -> bool:
    try:
        os.getcwd()
    except OSError:
        return True
    return False


def describe(exc: OSError) -> str:
    """``exc`` as ``NAME: what is wrong``, naming the working directory or standard output where it is.

    Args:
        exc: an error of the file system or of a stream.
    """
    name = os.fsdecode(exc.filename) if exc.filename is not None else ""
    reason = exc.strerror or str(exc)
    if _cwd_gone() and not os.path.isabs(name):
        where = f"{name}: " if name else ""
        return (
            f"{where}the working directory no longer exists (it was deleted or moved), so no relative path "
            "can be read or written in it; cd to a directory that exists, or give absolute paths"
        )
    if name == STDOUT:
        return f"cannot write to {STDOUT}: {reason} (is the disk full, or the pipe closed?)"
    return f"{name or 'an unnamed file'}: {reason}"


class _Named:
    """A text stream whose write errors name it (``standard output``)."""

    def __init__(self, stream: TextIO, name: str):
        self._stream, self._name = stream, name

    def _named(self, exc: OSError) -> OSError:
        return type(exc)(exc.errno, exc.strerror or str(exc), self._name)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise self._named(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise self._named(exc) from None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._stream, attr)


@contextlib.contextmanager
def named_stdout() -> Iterator[None]:
    """Inside the body, an error writing ``sys.stdout`` names it; all it holds is flushed at the end.

    When the output cannot be written (a full disk, ``> /dev/full``), what is left in its buffer is
    dropped, so that Python's own flush at exit does not print a second, raw error.
    """
    stream = sys.stdout
    sys.stdout = _Named(stream, STDOUT)
    try:
        yield
        sys.stdout.flush()
    except OSError as exc:
        if exc.filename == STDOUT:
            _drop(stream)
        raise
    finally:
        sys.stdout = stream


def _drop(stream: TextIO) -> None:
    """Point the stream's file descriptor at the null device, so its unwritable buffer goes nowhere."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)
