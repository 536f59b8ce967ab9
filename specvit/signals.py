"""Signals during writes: what a signal interrupts is cleaned up, and what must be whole is not interrupted.

Python turns SIGINT into ``KeyboardInterrupt``, so ``finally`` clauses remove temporary files; but SIGTERM,
SIGHUP and the other signals whose default action ends the process end it at once, leaving them behind.
:func:`cleanup_on_signals` makes those signals raise :class:`Terminated` inside its body, so the same
clean-up runs, then ends the process with the signal as it would have ended (its exit status says so).
:func:`deferred_signals` holds every such signal, SIGINT included, for the few renames that put a
checkpoint in place, so that it is either all old or all new. :func:`temporary` creates a temporary file or
directory that is removed whatever interrupts its creation, its use or its removal.

Handlers can only be set in the main thread; elsewhere both do nothing (Python runs signal handlers in
the main thread, so a signal never interrupts another thread's body anyway).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["TERMINATING", "Terminated", "cleanup_on_signals", "deferred_signals", "temporary"]

TERMINATING: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name)
    for name in (
        "SIGHUP",
        "SIGQUIT",
        "SIGTERM",
        "SIGUSR1",
        "SIGUSR2",
        "SIGALRM",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
    )
    if hasattr(signal, name)
)
"""The signals whose default action ends the process (SIGINT aside, which Python turns into an exception)."""


class Terminated(BaseException):
    """A terminating signal arrived inside :func:`cleanup_on_signals` (a BaseException, as KeyboardInterrupt).

    Args:
        signum: the signal.
    """

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """Inside the body, a terminating signal left at its default action raises :class:`Terminated`.

    After the body's ``finally`` clauses and context managers have run, the process is sent the signal
    again with its default action restored, so it ends as the signal meant it to. Signals with a handler
    of the program's own are left to it.
    """
    if not _main_thread():
        yield
        return
    installed: dict[int, Any] = {}
    for sig in TERMINATING:
        if signal.getsignal(sig) is signal.SIG_DFL:
            installed[sig] = signal.signal(sig, _raise)
    try:
        yield
    except (Terminated, KeyboardInterrupt) as exc:
        _restore(installed)
        _remove_temporaries()  # any a signal kept from their own clean-up
        if isinstance(exc, Terminated) and exc.signum in installed:
            os.kill(os.getpid(), exc.signum)  # the default action: the process ends here
        raise
    finally:
        _restore(installed)


def _restore(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT and the terminating signals during the body; deliver each one that came after it.

    For short steps that must not stop half-way (renaming a checkpoint's files into place).
    """
    if not _main_thread():
        yield
        return
    arrived: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        arrived.append(signum)

    saved: dict[int, Any] = {}
    for sig in (signal.SIGINT, *TERMINATING):
        handler = signal.getsignal(sig)
        if handler not in (signal.SIG_IGN, None):
            saved[sig] = signal.signal(sig, record)
    try:
        yield
    finally:
        _restore(saved)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(
                signum
            )  # now handled as it would have been: KeyboardInterrupt, Terminated ...


_LIVE: dict[Path, int] = {}
"""The temporaries :func:`temporary` created and has not removed yet, each with its thread's ident."""


@contextlib.contextmanager
def temporary(parent: Path, prefix: str, suffix: str = "", directory: bool = False) -> Iterator[Path]:
    """A new empty file (mode 0600) or directory (0700) under ``parent``, removed when the body ends.

    Unlike :mod:`tempfile`, no signal can leave it behind: it is created and recorded with signals held,
    removed with signals held, and :func:`cleanup_on_signals` removes any a signal kept from their own
    clean-up (a signal between the body's end and the removal). Renaming it away in the body is the way
    to keep it.

    Args:
        parent: the directory to create it in.
        prefix: the start of its name (8 random hex characters and ``suffix`` follow).
        suffix: the end of its name.
        directory: create a directory instead of a file.
    """
    path: Path | None = None
    try:
        with deferred_signals():
            path = _create(parent, prefix, suffix, directory)
            _LIVE[path] = threading.get_ident()
        yield path
    finally:
        if path is not None:
            with deferred_signals():
                _remove(path)


def _create(parent: Path, prefix: str, suffix: str, directory: bool) -> Path:
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            if directory:
                os.mkdir(path, 0o700)
            else:
                flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
                os.close(os.open(path, flags, 0o600))
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(parent / f"{prefix}*{suffix}"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    _LIVE.pop(path, None)


def _remove_temporaries() -> None:
    """Remove the temporaries of this thread (the one the signal interrupted)."""
    for path, thread in list(_LIVE.items()):
        if thread == threading.get_ident():
            _remove(path)
